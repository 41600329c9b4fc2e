"""A daemon that outlives its stop deadline after its session ended is ended, with every thread's stack
in its log (``cachefs.daemon.main.ExitWatchdog``): seen under load, a daemon held past `cachefs unmount`'s
wait by something still unknown; the stacks are what tells next time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from cachefs.daemon.main import EXIT_STOP_OVERRUN

HELD = textwrap.dedent("""
    import threading, time
    from cachefs.daemon.main import ExitWatchdog
    watchdog = ExitWatchdog()
    watchdog.arm(0.3)
    threading.Thread(target=lambda: time.sleep(60), name="held-in-a-socket").start()  # not a daemon thread
    {disarm}
""")


def run(disarm: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HELD.format(disarm=disarm)], capture_output=True, text=True,
                          timeout=30)


def test_a_daemon_held_past_its_deadline_exits_with_every_threads_stack() -> None:
    result = run("")
    assert result.returncode == EXIT_STOP_OVERRUN
    assert "did not finish stopping" in result.stderr and "held-in-a-socket" not in result.stdout
    assert "time.sleep" in result.stderr or "<lambda>" in result.stderr  # the held thread's stack


def test_a_daemon_that_stops_in_time_is_left_alone() -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import time
        from cachefs.daemon.main import ExitWatchdog
        watchdog = ExitWatchdog()
        watchdog.arm(0.5)
        watchdog.disarm()
        time.sleep(1.0)
        print("exited on its own")
    """)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "exited on its own" in result.stdout and result.stderr == ""
