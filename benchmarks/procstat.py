"""CPU, threads and memory of the processes a benchmark measures, read from /proc; and how quiet the machine is.

Every figure of CPU in the benchmarks comes from here, so that a daemon, a peer and a raw GET engine
are counted the same way:

- ``tree_cpu_s(pid)``: user + system CPU of ``pid`` and every live descendant (a daemon that spreads
  its work over child processes is charged for all of them), plus what the root has reaped from
  children that already exited (``cutime`` + ``cstime``; a child that exits and is not yet reaped is
  missed, which only ever under-counts);
- ``thread_cpu(pid)`` / ``busiest_thread_s(before, after)``: CPU per thread of the same tree
  (``/proc/PID/task/TID/stat``), and the largest increase of one thread between two snapshots: the
  share of the work that one core has to carry, whatever the number of cores;
- ``tree_peak_rss_mib(pid)``: the sum of the tree's ``VmHWM`` (each process's own peak; their sum
  is an upper bound of the tree's peak, exact for one process);
- ``quiet_sample(window_s, own)``: the load average, and the share of the machine's CPU that
  processes *outside* ``own`` (the harness and the servers it started) used over a short window
  while the harness itself is idle: the load that the benchmark did not cause.

Linux only (the benchmarks mount FUSE, so they are Linux only anyway).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
# How often SpanMeter reads the threads of a measured process (see there): a few reads of /proc per
# second cost the harness nothing noticeable, and threads that live less than this are rare.
THREAD_SAMPLE_S = 0.25
# /proc/PID/stat fields after the command name: state is 0, ppid 1, utime 11, stime 12, cutime 13,
# cstime 14 (proc(5), counted from "state").
_PPID, _UTIME, _STIME, _CUTIME, _CSTIME = 1, 11, 12, 13, 14


def _fields(path: Path) -> list[str] | None:
    """The fields after ``(comm)`` of a stat file; None when the process or thread is gone."""
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text.rsplit(")", 1)[1].split()


def children_map() -> dict[int, list[int]]:
    """Parent PID -> child PIDs of every process visible in /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _fields(Path(entry.path) / "stat")
        if fields is not None:
            out.setdefault(int(fields[_PPID]), []).append(int(entry.name))
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    kids = children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def process_cpu_s(pid: int, *, reaped: bool = False) -> float:
    """User + system CPU seconds of ``pid`` (with ``reaped``: plus its exited, reaped children)."""
    fields = _fields(Path(f"/proc/{pid}/stat"))
    if fields is None:
        raise ProcessLookupError(pid)
    ticks = int(fields[_UTIME]) + int(fields[_STIME])
    if reaped:
        ticks += int(fields[_CUTIME]) + int(fields[_CSTIME])
    return ticks / CLK_TCK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``, its live descendants and the children it reaped (see the docstring)."""
    total = process_cpu_s(pid, reaped=True)
    for p in tree(pid)[1:]:
        try:
            total += process_cpu_s(p)
        except ProcessLookupError:
            continue
    return total


def thread_cpu(pid: int) -> dict[tuple[int, int], float]:
    """(PID, TID) -> CPU seconds of every thread of ``pid``'s tree."""
    out: dict[tuple[int, int], float] = {}
    for p in tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tids:
            fields = _fields(Path(f"/proc/{p}/task/{tid}/stat"))
            if fields is not None:
                out[(p, int(tid))] = (int(fields[_UTIME]) + int(fields[_STIME])) / CLK_TCK
    return out


def busiest_thread_s(before: dict[tuple[int, int], float], after: dict[tuple[int, int], float]) -> float:
    """The largest CPU increase of one thread between two ``thread_cpu`` snapshots (a new thread from 0)."""
    return max((cpu - before.get(key, 0.0) for key, cpu in after.items()), default=0.0)


def peak_rss_mib(pid: int) -> float:
    """``VmHWM`` of the live process ``pid`` in MiB; ``ProcessLookupError`` if it is gone or a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(pid)


def tree_peak_rss_mib(pid: int) -> float:
    """The sum of ``VmHWM`` over ``pid``'s tree (MiB)."""
    total = 0.0
    for p in tree(pid):
        try:
            total += peak_rss_mib(p)
        except ProcessLookupError:
            continue
    return total


@dataclass(frozen=True)
class Span:
    """What one process tree spent over a timed span: CPU in all, and on its busiest thread."""

    cpu_s: float
    busiest_thread_s: float


class SpanMeter:
    """Start before a timed span, ``stop()`` after it: the tree's CPU and its busiest thread's CPU.

    A thread that exits inside the span takes its CPU out of /proc/PID/task with it (the process
    total keeps it), so a sampler thread reads the threads every ``THREAD_SAMPLE_S`` and the busiest
    thread is taken over the last value seen of each: only a thread that lived less than one sampling
    period is missed, and that only ever lowers the busiest-thread figure.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._cpu = tree_cpu_s(pid)
        self._threads = thread_cpu(pid)
        self._seen = dict(self._threads)
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="span-meter", daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._done.wait(THREAD_SAMPLE_S):
            self._seen.update(thread_cpu(self.pid))

    def stop(self) -> Span:
        self._done.set()
        self._sampler.join()
        self._seen.update(thread_cpu(self.pid))
        return Span(tree_cpu_s(self.pid) - self._cpu, busiest_thread_s(self._threads, self._seen))


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far (/proc/stat; idle and iowait count as not busy)."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in parts[:8]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


@dataclass(frozen=True)
class QuietSample:
    """The load average (1, 5, 15 min) and the share of all CPUs used by others over a short window."""

    loadavg: tuple[float, float, float]
    foreign_busy: float  # 0..1 of the machine's CPU, the harness's own process tree excluded
    window_s: float
    cpus: int


def quiet_sample(window_s: float, own_pids: list[int]) -> QuietSample:
    """Sample how busy the machine is while the harness idles for ``window_s`` seconds.

    ``own_pids`` are the roots of what the harness started (itself, its servers): their CPU over the
    window is subtracted, so that an idle server's housekeeping is not counted as foreign load.
    """
    load = os.getloadavg()

    def own() -> float:
        total = 0.0
        for pid in own_pids:
            try:
                total += tree_cpu_s(pid)
            except ProcessLookupError:
                continue
        return total

    busy0, total0 = machine_busy_ticks()
    own0 = own()
    time.sleep(window_s)
    busy1, total1 = machine_busy_ticks()
    own1 = own()
    ticks = max(total1 - total0, 1)
    foreign = max(0.0, (busy1 - busy0) - (own1 - own0) * CLK_TCK) / ticks
    return QuietSample((round(load[0], 2), round(load[1], 2), round(load[2], 2)), round(min(foreign, 1.0), 3),
                       window_s, os.cpu_count() or 1)
