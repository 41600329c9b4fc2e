"""Issue 24, item 6: a busy mount. ``cachefs unmount`` names the processes holding it and suggests
``--lazy``; ``cachefs unmount --lazy`` detaches it at once, the holder keeps reading the file it has
open, and the daemon exits once the holder lets go. A read-only file:// source keeps it cheap."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fuse.conftest import Mounter, run_cli
from tests.fuse.writeback_support import pid_alive

pytestmark = pytest.mark.fuse

EXIT_WAIT_S = 30
HOLDER = """
import sys
f = open(sys.argv[1], "rb")
print("open", flush=True)
sys.stdin.readline()          # wait for the test
print(f.read().decode(), flush=True)
"""


def test_a_busy_mount_names_its_holder_and_lazy_detaches_it(mounter: Mounter, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_text("still readable")
    m = mounter.mount(f"file://{src}/", "--read-only")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(m.path / "f.txt")], cwd=m.path,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "open"
        busy = run_cli("unmount", str(m.path))
        assert busy.returncode == 1 and busy.stderr.count("\n") == 1, busy.stderr
        assert f"pid {holder.pid} (python" in busy.stderr and f"cachefs unmount --lazy {m.path}" in busy.stderr
        assert m.mounted

        lazy = run_cli("unmount", "--lazy", str(m.path))
        assert lazy.returncode == 0 and f"pid {holder.pid}" in lazy.stderr, lazy.stderr
        assert not m.mounted  # out of the mount table at once
        assert m.pid is not None and pid_alive(m.pid)  # still serving its holder
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "still readable"
        assert holder.wait(timeout=EXIT_WAIT_S) == 0
    finally:
        if holder.poll() is None:
            holder.kill()  # our own child, by its handle
            holder.wait(timeout=EXIT_WAIT_S)
    deadline = time.monotonic() + EXIT_WAIT_S
    while pid_alive(m.pid):
        assert time.monotonic() < deadline, "the daemon did not exit after its last user let go"
        time.sleep(0.05)
