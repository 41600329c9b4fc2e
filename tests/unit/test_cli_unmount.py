"""`cachefs unmount` waits for its daemon to exit: an exited daemon not yet reaped by its parent (the
CSI plugin that started it) counts as gone, or every unmount of a plugin-started mount would wait out
its whole --timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from cachefs.cli.mount import _is_zombie, _wait_exit


def test_an_exited_unreaped_child_counts_as_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while not _is_zombie(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _is_zombie(child.pid)
        assert _wait_exit(child.pid, 1)  # without the zombie check this is False: kill(pid, 0) succeeds
    finally:
        child.wait(timeout=10)
    assert not _is_zombie(child.pid)


def test_a_live_process_is_not_a_zombie_and_is_waited_for() -> None:
    assert not _is_zombie(os.getpid())
    assert not _wait_exit(os.getpid(), 0.2)
