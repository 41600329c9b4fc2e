"""A daemon that outlives its stop deadline is ended, with every thread's stack in its log
(``cachefs.daemon.main.ExitWatchdog``): seen under load, a daemon held past `cachefs unmount`'s wait by
something still unknown; the stacks are what tells next time. Two deadlines: the stop deadline armed
at the session's end, and a short linger once the event loop has ended (the threads it leaves, which
the interpreter would otherwise join for as long as a socket holds them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from cachefs.daemon.main import EXIT_STOP_OVERRUN

HELD = textwrap.dedent("""
    import threading, time
    from cachefs.daemon.main import ExitWatchdog
    watchdog = ExitWatchdog()
    {arm}
    threading.Thread(target=lambda: time.sleep(60), name="held-in-a-socket").start()  # not a daemon thread
    {loop_ended}
""")


def run(arm: str = "", loop_ended: str = "") -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-c", HELD.format(arm=arm, loop_ended=loop_ended)],
                            capture_output=True, text=True, timeout=30)
    return result, time.monotonic() - began


def test_a_daemon_held_past_its_deadline_exits_with_every_threads_stack() -> None:
    result, _ = run(arm="watchdog.arm(0.3)")
    assert result.returncode == EXIT_STOP_OVERRUN
    assert "did not finish stopping" in result.stderr and "held-in-a-socket" not in result.stdout
    assert "time.sleep" in result.stderr or "<lambda>" in result.stderr  # the held thread's stack


def test_a_thread_left_after_the_loop_ended_does_not_hold_the_exit() -> None:
    """The stop finished (status 0): a thread still blocked does not keep the process for its minute."""
    result, took = run(loop_ended="watchdog.loop_ended(0)")
    assert result.returncode == 0, result.stderr
    assert took < 20, took
    assert "held-in-a-socket" in result.stderr and "exiting without them" in result.stderr


def test_the_earlier_deadline_wins() -> None:
    """The stop deadline armed at the session's end still holds when the loop ends near it (the stop
    itself finished, so the status is the daemon's own)."""
    result, took = run(arm="watchdog.arm(0.3)", loop_ended="watchdog.loop_ended(0, linger_s=60)")
    assert result.returncode == 0 and took < 20, (result.returncode, took)
    assert "held-in-a-socket" in result.stderr


def test_a_daemon_that_stops_in_time_is_left_alone() -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import time
        from cachefs.daemon.main import ExitWatchdog
        watchdog = ExitWatchdog()
        watchdog.arm(0.5)
        watchdog.loop_ended(0)
        print("exited on its own")
    """)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "exited on its own" in result.stdout and result.stderr == ""
