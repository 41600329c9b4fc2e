"""cachefs's own FUSE layer against its limits, measured in the same run (issue 39).

Three figures, each beside the limit it is judged by:

* **daemon CPU per FUSE request**: ``getxattr`` of a mount's root, a request the kernel never answers
  from a cache (one GETXATTR, one reply), on a read-only cachefs mount and on a libfuse 3 low-level
  server that does nothing (``benchmarks/fuse_null.c``, built here with gcc and libfuse3-dev, run
  single-threaded); the ratio's target is <= 1.5;
* **a warm 100 KiB re-read**: open, read and close of files already in the page cache and the kernel's
  entry and attribute caches, on a manifest mount (pinned, read-only: the target is 0 requests reach
  the daemon) and on a writable mount (target: at most 2 requests and <= 25 us of daemon CPU per
  file); the reader's CPU per file on the same files on the local disk is the floor;
* the requests behind each, counted by the daemon's FUSE session (``/stats`` ``fuse.requests``, by
  kind; the getxattr of each ``/stats`` call left out);
* the same warm re-read from the null server, which serves as many files of the same size opened the
  way a writable cachefs mount opens them (keep_cache, noflush: an OPEN and a RELEASE each): the C
  floor for the writable mount's figure.

Files are opened unbuffered: Python's buffered ``open`` asks ``isatty`` of every file, an IOCTL the
kernel sends to the daemon whatever the mount (docs/statistics.md).

The trees are ``file://`` sources on the local disk, so no store's CPU is in the figures. Standalone:
``.venv/bin/python -m benchmarks.fuse_layer [--files 2000] [--calls 20000]``; ``make bench`` runs it
and adds a section to its results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cachefs import mounts  # noqa: E402
from cachefs.client import call  # noqa: E402
from cachefs.mounts import CONTROL_XATTR  # noqa: E402

NULL_SOURCE = Path(__file__).with_name("fuse_null.c")
REQUEST_RATIO_TARGET = 1.5
WARM_WRITABLE_REQUESTS_TARGET = 2
WARM_WRITABLE_US_TARGET = 25.0
MOUNT_WAIT_S = 30.0
LONG_TTL = "3600"


def cpu_s(pid: int) -> float:
    """The process's CPU time so far, to the nanosecond (``schedstat`` of each of its threads: the
    tick-counted ``stat`` cannot resolve a few microseconds per request over a short round)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def build_null_server(work: Path) -> tuple[Path | None, str | None]:
    """The null server's binary, or None and why it cannot be built here."""
    gcc, pkg_config = shutil.which("gcc") or shutil.which("cc"), shutil.which("pkg-config")
    if gcc is None or pkg_config is None:
        return None, "no C compiler or pkg-config"
    flags = subprocess.run([pkg_config, "fuse3", "--cflags", "--libs"], capture_output=True, text=True, timeout=30)
    if flags.returncode != 0:
        return None, "libfuse3-dev is not installed (pkg-config fuse3 failed)"
    binary = work / "fuse_null"
    built = subprocess.run([gcc, "-O2", "-o", str(binary), str(NULL_SOURCE), *flags.stdout.split()],
                           capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        return None, f"the null server did not build: {built.stderr.strip().splitlines()[-1:]}"
    return binary, None


def wait_mounted(path: Path, deadline_s: float = MOUNT_WAIT_S) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if mounts.find_mount(path) is not None:
            return True
        time.sleep(0.05)
    return False


class NullServer:
    def __init__(self, binary: Path, path: Path, files: int = 0, file_size: int = 0) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "FUSE_NULL_FILES": str(files), "FUSE_NULL_SIZE": str(file_size)}
        self.process = subprocess.Popen([str(binary), "-f", "-s", str(path)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        if not wait_mounted(path):
            self.close()
            raise RuntimeError("the null server did not mount")
        self.pid = self.process.pid

    def close(self) -> None:
        if mounts.find_mount(self.path) is not None:
            subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True, timeout=60)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


class CachefsMount:
    def __init__(self, source: Path, path: Path, cache: Path, *extra: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "cachefs", "mount", f"file://{source}", str(path),
                                 "--cache-dir", str(cache), "--attr-ttl", LONG_TTL, "--dir-ttl", LONG_TTL, *extra],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"cachefs mount failed: {result.stderr.strip()}")
        self.pid = int(call(path, "/info")["pid"])
        self.stats_calls = 1  # (the /info call's GETXATTR)

    def counters(self) -> dict[str, int]:
        """FUSE requests so far, by kind, less one GETXATTR per ``/stats`` call (the one of this call)."""
        requests = {k: int(v) for k, v in call(self.path, "/stats")["fuse"]["requests"].items()}
        self.stats_calls += 1
        requests["getxattr"] = requests.get("getxattr", 0) - self.stats_calls
        return requests

    def close(self) -> None:
        subprocess.run([sys.executable, "-m", "cachefs", "unmount", str(self.path)], capture_output=True, timeout=120)


def per_request_us(pid: int, path: Path, name: str, calls: int) -> float:
    os.getxattr(path, name)
    before = cpu_s(pid)
    for _ in range(calls):
        os.getxattr(path, name)
    return 1e6 * (cpu_s(pid) - before) / calls


def read_files(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass


def thread_cpu_s() -> float:
    return time.thread_time()  # CLOCK_THREAD_CPUTIME_ID: to the nanosecond, unlike getrusage's ticks


def warm_pass(paths: list[Path], passes: int, mount: CachefsMount | NullServer | None) -> dict[str, Any]:
    """Per file over ``passes`` warm passes: the reader's CPU (us); with a mount, the server's CPU
    (us); with a cachefs mount, the requests it saw, by kind."""
    read_files(paths)  # the first pass warms the page cache and the kernel's entry and attribute caches
    read_files(paths)  # (the first pass's GETATTR of each file's atime, made stale by its cold READs)
    counted = isinstance(mount, CachefsMount)
    before = mount.counters() if isinstance(mount, CachefsMount) else {}
    daemon = cpu_s(mount.pid) if mount else 0.0
    reader = thread_cpu_s()
    for _ in range(passes):
        read_files(paths)
    n = len(paths) * passes
    out: dict[str, Any] = {"reader_us": round(1e6 * (thread_cpu_s() - reader) / n, 2)}
    if mount:
        out["daemon_us"] = round(1e6 * (cpu_s(mount.pid) - daemon) / n, 2)
    if counted:
        assert isinstance(mount, CachefsMount)
        after = mount.counters()
        out["requests"] = {k: round((after[k] - before.get(k, 0)) / n, 3) for k in after
                           if after[k] != before.get(k, 0)}
        out["requests_per_file"] = round(sum(out["requests"].values()), 3)
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def run(files: int = 2000, file_size: int = 100 * 1024, calls: int = 20000, passes: int = 3, rounds: int = 3,
        workdir: Path | None = None) -> dict[str, Any]:
    """The section's figures (see the module docstring), medians over ``rounds``; ``unavailable``
    says why the null server's figure is missing, if it is."""
    work = Path(tempfile.mkdtemp(prefix="cachefs-fuse-layer-", dir=workdir))
    opened: list[CachefsMount | NullServer] = []
    try:
        src = work / "src"
        (src / "d").mkdir(parents=True)
        body = os.urandom(file_size)
        names = [f"d/f{i:05d}" for i in range(files)]
        for i, name in enumerate(names):
            (src / name).write_bytes(i.to_bytes(8, "little") + body[8:])
        binary, unavailable = build_null_server(work)
        null = NullServer(binary, work / "null", files, file_size) if binary else None
        if null:
            opened.append(null)
        readonly = CachefsMount(src, work / "ro", work / "cache-ro", "--read-only")
        opened.append(readonly)
        writable = CachefsMount(src, work / "rw", work / "cache-rw")
        opened.append(writable)
        read_files([readonly.path / n for n in names])
        manifest = work / "manifest.jsonl"
        snap = subprocess.run([sys.executable, "-m", "cachefs", "snapshot", str(readonly.path), "-o", str(manifest)],
                              capture_output=True, text=True, timeout=300)
        if snap.returncode != 0:
            raise RuntimeError(f"cachefs snapshot failed: {snap.stderr.strip()}")
        pinned = CachefsMount(src, work / "pinned", work / "cache-pinned", "--manifest", str(manifest))
        opened.append(pinned)

        samples: dict[str, list[float]] = {"null_us": [], "null_file_us": [], "cachefs_us": [], "ext4_reader_us": [],
                                           "pinned_daemon_us": [], "pinned_requests": [],
                                           "writable_daemon_us": [], "writable_requests": []}
        requests: dict[str, Any] = {}
        for _ in range(rounds):  # alternating, so that a change of load falls on each alike
            if null:
                samples["null_us"].append(per_request_us(null.pid, null.path, "user.null", calls))
            samples["cachefs_us"].append(per_request_us(readonly.pid, readonly.path, CONTROL_XATTR, calls))
            local = warm_pass([src / n for n in names], passes, None)
            samples["ext4_reader_us"].append(local["reader_us"])
            if null:
                served = warm_pass([null.path / f"f{i:05d}" for i in range(files)], passes, null)
                samples["null_file_us"].append(served["daemon_us"])
            for label, mount in (("pinned", pinned), ("writable", writable)):
                got = warm_pass([mount.path / n for n in names], passes, mount)
                samples[f"{label}_daemon_us"].append(got["daemon_us"])
                samples[f"{label}_requests"].append(got["requests_per_file"])
                requests[label] = got["requests"]
        result: dict[str, Any] = {k: round(median(v), 3) if v else None for k, v in samples.items()}
        result["request_ratio"] = (round(result["cachefs_us"] / result["null_us"], 2)
                                   if result["null_us"] else None)
        result.update(files=files, file_size=file_size, calls=calls, passes=passes, rounds=rounds,
                      requests_by_kind=requests, unavailable=unavailable,
                      loadavg_1m=round(os.getloadavg()[0], 2),
                      targets={"request_ratio": REQUEST_RATIO_TARGET, "pinned_requests": 0,
                               "writable_requests": WARM_WRITABLE_REQUESTS_TARGET,
                               "writable_daemon_us": WARM_WRITABLE_US_TARGET})
        return result
    finally:
        for item in reversed(opened):
            item.close()
        shutil.rmtree(work, ignore_errors=True)


def markdown(section: dict[str, Any] | None) -> list[str]:
    """The section of results.md (empty if it did not run)."""
    if not section:
        return []
    t = section["targets"]

    def fmt(value: float | None, unit: str = "") -> str:
        return "—" if value is None else f"{value:,.2f}{unit}"

    def verdict(ok: bool | None) -> str:
        return "—" if ok is None else ("met" if ok else "missed")

    ratio = section["request_ratio"]
    lines = ["", "## The FUSE layer against libfuse and the page cache (issue 39)", "",
             (f"{section['files']} files of {section['file_size'] // 1024} KiB on the local disk (`file://`), "
              f"{section['calls']:,} getxattr calls per round, {section['passes']} warm passes, median of "
              f"{section['rounds']} rounds, load {section['loadavg_1m']}."), "",
             "| figure | cachefs | limit | target | |", "|---|---|---|---|---|",
             (f"| daemon CPU per FUSE request (GETXATTR) | {fmt(section['cachefs_us'], ' us')} | "
              f"{fmt(section['null_us'], ' us')} (libfuse 3 low-level null server) | <= {t['request_ratio']}x: "
              f"{fmt(ratio, 'x')} | {verdict(None if ratio is None else ratio <= t['request_ratio'])} |"),
             (f"| warm 100 KiB re-read, manifest mount: requests per file | {fmt(section['pinned_requests'])} "
              f"(daemon {fmt(section['pinned_daemon_us'], ' us')}) | reader on ext4: {fmt(section['ext4_reader_us'], ' us')} | "
              f"0 | {verdict(section['pinned_requests'] == 0)} |"),
             (f"| warm 100 KiB re-read, writable mount: requests per file | {fmt(section['writable_requests'])} | | "
              f"<= {t['writable_requests']} | {verdict(section['writable_requests'] <= t['writable_requests'])} |"),
             (f"| warm 100 KiB re-read, writable mount: daemon CPU per file | {fmt(section['writable_daemon_us'], ' us')} "
              f"| the null server serving the same files (OPEN, RELEASE): {fmt(section.get('null_file_us'), ' us')} "
              f"| <= {t['writable_daemon_us']:g} us | {verdict(section['writable_daemon_us'] <= t['writable_daemon_us'])} |")]
    if section.get("unavailable"):
        lines += ["", f"The null server's figure is missing: {section['unavailable']}."]
    by_kind = section.get("requests_by_kind") or {}
    if by_kind:
        lines += ["", "Requests per warm file, by kind: " + "; ".join(
            f"{label}: " + (", ".join(f"{k} {v:g}" for k, v in kinds.items()) or "none")
            for label, kinds in by_kind.items()) + "."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuse_layer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-kib", type=int, default=100)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    section = run(args.files, args.file_kib * 1024, args.calls, args.passes, args.rounds)
    print(json.dumps(section, indent=1))
    print("\n".join(markdown(section)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
