"""The metadata benchmark end to end, tiny: a 3,000-line manifest mount and a 2,000-object remount.

Checks the shape and the counts of the results (no directory listed by the manifest mount nor by
the remount, every entry in the index), never a timing, and that the harness left nothing mounted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachefs import mounts
from tests.fuse.conftest import require_fuse

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def _require_fuse() -> None:
    require_fuse("benchmark smoke tests")


def test_metadata_bench_runs_end_to_end(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.metadata", "--entries", "3000", "--big-dir", "1000", "--stats", "100",
         "--objects", "2000", "--out", str(out), "--workdir", str(work)],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not [m for m in mounts.mount_entries() if m.mountpoint.startswith(str(tmp_path))], "left mounted"
    data = json.loads((out / "metadata.json").read_text())
    pinned, remount = data["manifest_mount"], data["bucket_remount"]
    # 3,000 files; directories: big/ and d00000, d00001 (1,000 + 1,000 files).
    assert pinned["entries"] == 3000 and pinned["index_entries"] == 3003
    assert pinned["directory_listings"] == 0 and pinned["list_requests"] == 0
    assert remount["first_mount_directory_listings"] == 3  # the root, d00000, d00001
    assert remount["remount_directory_listings"] == 0 and remount["remount_list_requests"] == 0
    assert remount["remount_index_listings"] == 3
    assert list(work.iterdir()) == []  # the harness cleans its work dir
