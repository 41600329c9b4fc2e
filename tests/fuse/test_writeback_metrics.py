"""Write-back series on ``/metrics`` of a real mount, read over ``--stats-addr`` (issue 12, item 7).

A file written through the mount is dirty (bytes, files, oldest age) until ``cachefs flush`` uploads
it; then the upload counters hold it and the dirty gauges are back to zero. A long ``--upload-delay``
keeps the file dirty until the flush, so nothing here depends on timing.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.fuse.conftest import Mounter, run_cli

PAYLOAD = b"checkpoint " * 1000
HTTP_TIMEOUT_S = 10


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_writeback_series_over_the_stats_address(tmp_path: Path, mounter: Mounter) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    m = mounter.mount(f"file://{root}", "--stats-addr", "127.0.0.1:0", "--upload-delay", "3600",
                      "--disk-cache", "64MiB")
    port = m.stats_port()
    (m.path / "out.bin").write_bytes(PAYLOAD)

    before = scrape(port)
    assert before[("cachefs_dirty_bytes", ())] == len(PAYLOAD)
    assert before[("cachefs_dirty_files", ())] == 1
    assert before[("cachefs_oldest_dirty_age_seconds", ())] >= 0
    assert before[("cachefs_uploads_total", ())] == 0
    assert before[("cachefs_upload_failures_total", ())] == 0
    assert before[("cachefs_writeback_store_state", (("state", "ok"),))] == 1
    assert before[("cachefs_writeback_store_state", (("state", "unreachable"),))] == 0
    assert before[("cachefs_staging_used_bytes", ())] >= len(PAYLOAD)
    assert before[("cachefs_staging_limit_bytes", ())] == 64 * 1024 * 1024

    flushed = run_cli("flush", str(m.path), "--timeout", "60")
    assert flushed.returncode == 0, flushed.stderr
    assert (root / "out.bin").read_bytes() == PAYLOAD
    after = scrape(port)
    assert after[("cachefs_uploads_total", ())] == 1
    assert after[("cachefs_uploaded_bytes_total", ())] == len(PAYLOAD)
    assert after[("cachefs_dirty_bytes", ())] == 0 and after[("cachefs_dirty_files", ())] == 0
    assert after[("cachefs_oldest_dirty_age_seconds", ())] == 0
    assert after[("cachefs_uploads_in_flight", ())] == 0
