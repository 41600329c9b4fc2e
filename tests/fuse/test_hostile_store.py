"""Real mounts of stores that never finish (issue 34); the server is ``tests/support/hostile_s3.py``.

- A listing without end: ``ls`` gets EIO, the daemon logs one line naming the directory, and the
  mount stays usable. Before the listing was bounded, the same ``ls`` sat in uninterruptible sleep
  while the daemon grew (100 -> 340 MB in 4 minutes) for as long as the server kept answering.
- A GET answered a byte a second: the read fails at ``--fetch-timeout`` and an unmount ends the daemon
  within ``--stop-timeout``. Before, the GET's worker thread stayed in its read, and the interpreter
  waited for it at exit: the daemon outlived its mount for as long as the server kept trickling.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.hostile_s3 import ENVIRON, HostileS3

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]

LS_BOUND_S = 30.0  # the error comes at the second page, in milliseconds; the bound is for a loaded machine


def test_a_listing_with_the_same_token_forever_is_eio_with_one_log_line(mounter) -> None:
    with HostileS3("same-token") as server:
        m = mounter.mount("s3://hostile/", "--endpoint-url", server.endpoint_url, "--read-only",
                          env={**os.environ, **ENVIRON})
        started = time.monotonic()
        for _attempt in range(2):  # nothing of a failed listing is cached: the second ls lists again
            with pytest.raises(OSError) as caught:
                os.listdir(m.path)
            assert caught.value.errno == errno.EIO
        assert time.monotonic() - started < LS_BOUND_S
        assert server.pages <= 2 * 2 + 2  # two pages per listing (and the mount's own first LIST)
        log = next(Path(m.cache_dir).glob("*/daemon.log")).read_text()
        lines = [line for line in log.splitlines() if "continuation token a second time" in line]
        assert len(lines) == 2 and all("LIST s3://hostile/:" in line for line in lines), lines
        assert m.mounted


STOP_TIMEOUT_S = 5


@pytest.mark.parametrize("mode", ["trickle-headers", "trickle-body"])
def test_a_trickled_read_fails_at_its_deadline_and_the_unmount_ends_the_daemon(mounter, mode: str) -> None:
    with HostileS3(mode) as server:
        m = mounter.mount("s3://hostile/", "--endpoint-url", server.endpoint_url, "--read-only",
                          "--fetch-timeout", "2", "--stop-timeout", str(STOP_TIMEOUT_S), "--disk-cache", "0",
                          # Longer than the wait below: the worker must stop at the fetch deadline, not
                          # when one socket read times out (a trickled body's MSG_WAITALL receive did).
                          "--read-timeout", "120",
                          env={**os.environ, **ENVIRON})
        with pytest.raises(OSError) as caught:
            (m.path / "f").read_bytes()
        assert caught.value.errno == errno.EIO
        assert m.unmount().returncode == 0
        assert m.pid is not None
        deadline = time.monotonic() + STOP_TIMEOUT_S + LS_BOUND_S  # the stop timeout, and room for a loaded machine
        while time.monotonic() < deadline:
            try:
                os.kill(m.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(m.pid, signal.SIGKILL)
            raise AssertionError(f"the daemon was still running {STOP_TIMEOUT_S + LS_BOUND_S:g} s after its unmount")
