"""Re-reads of files whole on the disk tier: kernel passthrough against the daemon, against local disk.

The limits are the same bytes read from the local disk: the ``file://`` source's own files, their
pages dropped before each read (``drop``: written back first, since ``posix_fadvise(DONTNEED)`` leaves
dirty pages, and the files may just have been written), read interleaved with the passthrough mount's epochs: 64 MiB of the large file from one side,
then from the other, or one small file each, the side that starts taking turns too, each side
timed over its own slices (``interleaved``). This VM's disk is throttled after a burst: of two 1 GiB
reads made back to back (4 s apart), the first ran at 2,079-2,119 MB/s and the second at 519-580
MB/s, whichever file either was (passthrough or local, 8 pairs), and 400 MB of small files read
before a pair slowed its first read too; reads taking turns meet the same disk, and a passthrough
file's read-ahead is its backing file's, the kernel's, as the local file's. The daemon's epochs
(the writable mount's) are read whole, then the same files locally: its own read-ahead goes on
during the local side's turns, so interleaving flatters it (2.0x the local disk for the 1 GiB file).
Each ratio is the median over the epochs of the mount's rate against the local rate of its own
epoch. Two mounts of that source share one cache directory, one after the other:

* a writable one (no passthrough: the daemon serves every READ from the disk tier), after a first
  mount read every file cold (its blocks reach the disk tier), mounted again for each epoch (so the
  RAM tier is empty);
* a read-only one (passthrough where the kernel and this process allow it: Linux 6.9+ and
  CAP_SYS_ADMIN), whose opens first assemble the whole files; then every file is read again and
  the kernel reads the whole files itself.

Before each timed epoch every file of the cache directory is written back and its pages dropped
(the whole files were just assembled: their dirty pages would otherwise stay cached and overstate
the rate), and so are the mount's own pages of each file (``interleaved``). Each row gives the rate,
the daemon's CPU over the epoch (``schedstat`` of its threads: to the nanosecond), the READ requests
the daemon counted (the target with passthrough is 0) and, for the read-only mount, the passthrough
opens and backing files registered. The targets (issue 39): the 1 GiB file at >= 0.9x the local disk,
the epoch of 100 KiB files at >= 0.5x ext4's files/s. Where passthrough cannot be used (not root, an
older kernel, a mount refused), its rows say why and the rest is still measured.

Standalone (as root): ``.venv/bin/python -m benchmarks.passthrough [--big-mib 1024] [--files 2000]``;
``make bench`` runs ``run`` on its own local copies and adds a section to its results. Figures from
one run are comparable with each other only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fuse_layer import CachefsMount, NullServer, build_null_server, cpu_s, median  # noqa: E402
from cachefs.client import ControlError, UsageError, call  # noqa: E402
from cachefs.fuse.backingfiles import may_register_backing  # noqa: E402
from tests.support.diskblocks import drop_pages  # noqa: E402

MiB = 1024 * 1024
SMALL_FILE_BYTES = 100 * 1024
BIG_RATIO_TARGET = 0.9
EPOCH_RATIO_TARGET = 0.5
# Daemon CPU per file of the writable mount's epoch (a disk-tier hit served without passthrough: a
# LOOKUP, an OPEN, one READ of the whole file and a RELEASE), issue 35.
DAEMON_FILE_US_TARGET = 150.0
# Bound on waiting for the whole files to be assembled (the large one in the background: a copy of
# the file at disk speed, a few seconds for 1 GiB).
ASSEMBLY_WAIT_S = 300
POLL_S = 0.2
# How much of a large file is read before the other side's turn (``interleaved``).
SLICE_BYTES = 64 * MiB


def drop_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                drop_pages(path)
            except OSError:
                continue  # gone meanwhile (a temp file), or a socket: nothing cached to drop


def read_all(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the mount's own pages of this file
        while chunk := os.read(fd, MiB):
            total += len(chunk)
    finally:
        os.close(fd)
    return total


def timed_pass(root: Path, names: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    total = sum(read_all(root / name) for name in names)
    return time.perf_counter() - start, total


def stats(mount: CachefsMount) -> dict[str, Any]:
    return call(mount.path, "/stats")


def counters(doc: dict[str, Any]) -> dict[str, int]:
    fuse = doc.get("fuse", {})
    return {"reads": int(doc["filesystem"]["reads"]), "passthrough_opens": int(fuse.get("passthrough_opens", 0)),
            "registrations": int(fuse.get("backing_registrations", 0))}


def mount_epoch(mount: CachefsMount, cache: Path, source: Path, names: list[str], files: bool,
                interleave: bool) -> dict[str, float]:
    """One timed pass over ``names`` on ``mount``, and the same files read from ``source`` (the local
    disk), pages of both dropped first. ``interleave``: a slice of the mount's read and a slice of the
    local read in turn (``SLICE_BYTES`` of a large file, or one small file each, the first in turn
    too), each side timed over its own slices only: this VM's disk is throttled after a burst
    (module docstring), so two reads made one after the other meet different disks, and slices in
    turn meet the same one. That is fair only between readers whose read-ahead is the kernel's (a
    passthrough file's is its backing file's): the daemon fetches blocks ahead on its own while the
    local side has its turn (its 1 GiB file measured 2.0x the local disk so), so its epochs are read
    whole, then the local files, as before."""
    drop_tree(cache)
    for name in names:
        drop_pages(source / name)
    before, cpu = counters(stats(mount)), cpu_s(mount.pid)
    if interleave:
        mine, theirs, total = interleaved([mount.path / n for n in names], [source / n for n in names])
        cpu = cpu_s(mount.pid) - cpu
    else:
        mine, total = timed_pass(mount.path, names)
        cpu = cpu_s(mount.pid) - cpu
        theirs, _ = timed_pass(source, names)
    after = counters(stats(mount))
    out: dict[str, float] = {k: after[k] - before[k] for k in after}
    out["backing_ids"] = int(stats(mount).get("fuse", {}).get("backing_ids", 0))  # held at the end (a gauge)
    out["mb_s"], out["local_mb_s"] = total / mine / 1e6, total / theirs / 1e6
    if files:
        out["files_s"], out["local_files_s"] = len(names) / mine, len(names) / theirs
        out["daemon_us_per_file"] = 1e6 * cpu / len(names)
    else:
        out["daemon_cpu_s_per_gib"] = cpu / (total / 1024**3)
    return out


def interleaved(mine: list[Path], theirs: list[Path]) -> tuple[float, float, int]:
    """Seconds spent reading ``mine`` and ``theirs`` (pairs of files of the same bytes), slice by slice
    in turn, and the bytes of one side; the mount's own pages of each of ``mine`` dropped at its open."""
    spent = [0.0, 0.0]
    total = 0
    for n, pair in enumerate(zip(mine, theirs)):
        fds = [os.open(path, os.O_RDONLY) for path in pair]
        try:
            os.posix_fadvise(fds[0], 0, 0, os.POSIX_FADV_DONTNEED)
            done = [False, False]
            turn = n % 2  # which side reads first, in turn from file to file
            while not all(done):
                side = turn if not done[turn] else 1 - turn
                start, got = time.perf_counter(), 0
                while got < SLICE_BYTES and (chunk := os.read(fds[side], MiB)):
                    got += len(chunk)
                spent[side] += time.perf_counter() - start
                total += got if side == 0 else 0
                done[side] = got < SLICE_BYTES
                turn = 1 - side
        finally:
            for fd in fds:
                os.close(fd)
    return spent[0], spent[1], total


def assemble(mount: CachefsMount, names: list[str]) -> None:
    """Open every file until each has its whole file (a small one is assembled at its open, the large
    one in the background); ``RuntimeError`` past ``ASSEMBLY_WAIT_S``."""
    deadline = time.monotonic() + ASSEMBLY_WAIT_S
    while stats(mount)["fuse"]["whole_files"].get("files", 0) < len(names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the whole files were not assembled in {ASSEMBLY_WAIT_S} s")
        for name in names:
            with open(mount.path / name, "rb"):
                pass
        time.sleep(POLL_S)


def unavailable_reason(mount: CachefsMount) -> str | None:
    """Why the read-only mount does not pass through, or None if it does."""
    if stats(mount)["fuse"].get("passthrough"):
        return None
    if not may_register_backing():
        return "registering backing files needs CAP_SYS_ADMIN in the initial user namespace (run as root)"
    return "the kernel did not agree to passthrough (Linux 6.9+ built with CONFIG_FUSE_PASSTHROUGH)"


def run(source: Path, big: str, small: list[str], workdir: Path | None = None, rounds: int = 1) -> dict[str, Any]:
    """The section's figures (module docstring) for the files ``big`` and ``small`` under ``source``,
    medians over ``rounds`` timed epochs of each mount. ``unavailable`` says why the passthrough rows
    are missing, if they are; ``error`` why nothing was measured."""
    begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="cachefs-passthrough-", dir=workdir))
    big_bytes = (source / big).stat().st_size
    small_bytes = sum((source / name).stat().st_size for name in small)
    sets = {"big": [big], "small": small}
    disk = 2 * (big_bytes + small_bytes) + 256 * MiB  # blocks and whole files, with room to spare
    result: dict[str, Any] = {
        "big_bytes": big_bytes, "files": len(small), "file_size": small_bytes // max(len(small), 1),
        "rounds": rounds, "local": {}, "daemon": {}, "passthrough": {}, "unavailable": None, "error": None,
        "targets": {"big_ratio": BIG_RATIO_TARGET, "epoch_ratio": EPOCH_RATIO_TARGET, "reads": 0,
                    "daemon_file_us": DAEMON_FILE_US_TARGET},
        "null_file_us": None, "null_unavailable": None}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {"daemon": {}, "passthrough": {}}
    local: dict[str, list[float]] = {"big_mb_s": [], "small_files_s": [], "small_mb_s": []}
    cache = work / "cache"
    opened: list[CachefsMount] = []

    def mounted(*extra: str) -> CachefsMount:
        mount = CachefsMount(source, work / "mnt", cache, "--disk-cache", f"{disk // MiB}MiB", *extra)
        opened.append(mount)
        return mount

    def unmount(mount: CachefsMount) -> None:
        opened.remove(mount)
        mount.close()

    # Each passthrough epoch is read interleaved with the local read of the same files (``mount_epoch``):
    # a ratio of two reads made one after the other measures this VM's disk throttle as much as the
    # mount. The daemon's epochs cannot be (its own read-ahead works on during the local side's turns).
    pairs: dict[str, list[float]] = {"daemon_big": [], "daemon_epoch": [], "passthrough_big": [],
                                     "passthrough_epoch": []}

    def epoch(mode: str, mount: CachefsMount, label: str, names: list[str]) -> None:
        files = label == "small"
        run_ = mount_epoch(mount, cache, source, names, files, interleave=mode == "passthrough")
        samples[mode].setdefault(label, []).append(run_)
        if files:
            local["small_mb_s"].append(run_["local_mb_s"])
            local["small_files_s"].append(run_["local_files_s"])
            pairs[f"{mode}_epoch"].append(run_["files_s"] / run_["local_files_s"])
        else:
            local["big_mb_s"].append(run_["local_mb_s"])
            pairs[f"{mode}_big"].append(run_["mb_s"] / run_["local_mb_s"])

    try:
        first = mounted()  # the cold reads: every block reaches the disk tier
        for names in sets.values():
            timed_pass(first.path, names)
        unmount(first)
        for _ in range(rounds):
            daemon = mounted()  # after a remount the RAM tier is empty: every READ is a disk-tier hit
            for label, names in sets.items():
                epoch("daemon", daemon, label, names)
            unmount(daemon)
        readonly = mounted("--read-only")
        result["unavailable"] = unavailable_reason(readonly)
        if result["unavailable"] is None:
            assemble(readonly, [big, *small])
            for _ in range(rounds):
                for label, names in sets.items():
                    epoch("passthrough", readonly, label, names)
        unmount(readonly)
        result["null_file_us"], result["null_unavailable"] = null_floor(work, len(small), small_bytes // len(small),
                                                                        rounds)
    except (OSError, RuntimeError, KeyError, ValueError, ControlError, UsageError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for mount in reversed(opened):
            mount.close()
        shutil.rmtree(work, ignore_errors=True)
    result["local"] = {k: round(median(v), 1) if v else None for k, v in local.items()}
    for mode, by_set in samples.items():
        result[mode] = {label: {k: round(median([s[k] for s in runs]), 3) for k in runs[0]}
                        for label, runs in by_set.items()}
    result["ratios"] = {k: round(median(v), 2) if v else None for k, v in pairs.items()}
    result["ratio_samples"] = {k: [round(x, 2) for x in v] for k, v in pairs.items()}
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.monotonic() - begin, 1)
    return result


def null_floor(work: Path, files: int, file_size: int, rounds: int) -> tuple[float | None, str | None]:
    """The C floor of the daemon's epoch: a libfuse 3 low-level server that does nothing
    (``benchmarks/fuse_null.c``, single-threaded) serving ``files`` files of ``file_size`` bytes from
    memory, mounted afresh for each of ``rounds`` epochs (every name unknown to the kernel, as after the
    daemon's remount), each file read once the same way: a LOOKUP, an OPEN, one READ and a RELEASE
    each, no disk read. Its CPU per file (us, the median), or None and why it was not measured."""
    binary, why = build_null_server(work)
    if binary is None:
        return None, why
    samples = []
    names = [f"f{i:05d}" for i in range(files)]  # (the null server's own names)
    for _ in range(rounds):
        try:
            null = NullServer(binary, work / "null", files, file_size)
        except (OSError, RuntimeError) as exc:  # (the daemon's figures stand without it)
            return None, f"the null server did not mount: {exc}"
        try:
            cpu = cpu_s(null.pid)
            timed_pass(null.path, names)
            samples.append(1e6 * (cpu_s(null.pid) - cpu) / files)
        finally:
            null.close()
    return round(median(samples), 1), None


def markdown(section: dict[str, Any] | None) -> list[str]:
    """The section of results.md (empty if it did not run)."""
    if not section:
        return []
    lines = ["", "## Files whole on the disk tier: kernel passthrough (issue 39)", ""]
    if section.get("error"):
        return lines + [f"Not measured: {section['error']}."]
    t, r, local = section["targets"], section["ratios"], section["local"]
    pt, dm = section["passthrough"], section["daemon"]
    size = section["big_bytes"]
    big_label = f"{size / 1024**3:g} GiB" if size >= 1024**3 else f"{size / MiB:g} MiB"

    def fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
        return "—" if value is None else f"{value:,.{digits}f}{unit}"

    def verdict(ok: bool | None) -> str:
        return "—" if ok is None else ("met" if ok else "missed")

    def at(mode: dict[str, Any], label: str, key: str) -> float | None:
        return mode.get(label, {}).get(key)

    lines += [(f"A {big_label} file and {section['files']} files of {section['file_size'] // 1024} KiB, whole on "
               "the disk tier; every page dropped before each epoch (the cache directory's files written back "
               f"first); median of {section['rounds']} epoch(s), load {section['loadavg_1m']}. Each passthrough epoch is "
               "read interleaved with the same files on the local disk (64 MiB of the large file, or one small file, "
               "from each side in turn): this disk is throttled after a burst (the second of two 1 GiB reads back "
               "to back ran at a quarter of the first's rate, whichever file), so reads made one after the other "
               "would compare two different disks. The daemon's row is a writable mount (no passthrough) on the "
               "same cache directory, each epoch read whole and then the local files (its own read-ahead would "
               "work on during the local side's turns); its ratios carry the throttle. Each ratio is the median "
               "of the epochs' own; the limit column is the local reads' median, both kinds."), "",
              "| figure | passthrough | daemon (disk tier) | limit | target | |", "|---|---|---|---|---|---|",
              (f"| {big_label} file, MB/s | {fmt(at(pt, 'big', 'mb_s'))} ({fmt(r['passthrough_big'], 'x', 2)}) | "
               f"{fmt(at(dm, 'big', 'mb_s'))} ({fmt(r['daemon_big'], 'x', 2)}) | local disk {fmt(local['big_mb_s'])} | "
               f">= {t['big_ratio']}x | {verdict(None if r['passthrough_big'] is None else r['passthrough_big'] >= t['big_ratio'])} |"),
              (f"| epoch of {section['files']} files, files/s | {fmt(at(pt, 'small', 'files_s'))} "
               f"({fmt(r['passthrough_epoch'], 'x', 2)}) | {fmt(at(dm, 'small', 'files_s'))} ({fmt(r['daemon_epoch'], 'x', 2)}) "
               f"| ext4 {fmt(local['small_files_s'])} | >= {t['epoch_ratio']}x | "
               f"{verdict(None if r['passthrough_epoch'] is None else r['passthrough_epoch'] >= t['epoch_ratio'])} |")]
    daemon_us, file_target = at(dm, "small", "daemon_us_per_file"), t.get("daemon_file_us", DAEMON_FILE_US_TARGET)
    reads = None if not pt else at(pt, "big", "reads") + at(pt, "small", "reads")  # type: ignore[operator]
    daemon_reads = None if not dm else at(dm, "big", "reads") + at(dm, "small", "reads")  # type: ignore[operator]
    lines += [(f"| READ requests reaching the daemon (both sets) | {fmt(reads)} | {fmt(daemon_reads)} | | "
               f"{t['reads']} | {verdict(None if reads is None else reads == t['reads'])} |"),
              (f"| daemon CPU per file (epoch), us | {fmt(at(pt, 'small', 'daemon_us_per_file'), '', 1)} | "
               f"{fmt(daemon_us, '', 1)} | libfuse null server {fmt(section.get('null_file_us'), '', 1)} | "
               f"daemon <= {file_target:g} | {verdict(None if daemon_us is None else daemon_us <= file_target)} |"),
              (f"| daemon CPU per GiB ({big_label} file), CPU-s | {fmt(at(pt, 'big', 'daemon_cpu_s_per_gib'), '', 3)} | "
               f"{fmt(at(dm, 'big', 'daemon_cpu_s_per_gib'), '', 3)} | | | |")]
    if pt:
        lines += ["", (f"Passthrough opens in the epoch: {fmt(at(pt, 'small', 'passthrough_opens'))}; backing files "
                       f"registered for them: {fmt(at(pt, 'small', 'registrations'))}; backing ids held after it: "
                       f"{fmt(at(pt, 'small', 'backing_ids'))} (an id registered at a file's first open, when its "
                       "whole file was assembled, is kept for its later opens).")]
    lines += ["", ("The limit beside the daemon's CPU per file is the C floor of the same four requests (LOOKUP, "
                   "OPEN, one READ of the whole file, RELEASE) on this machine: a libfuse 3 low-level server that does "
                   "nothing, single-threaded, serving as many files of the same size from memory, mounted afresh "
                   "for each epoch (no disk read, no check, no index: what any FUSE server pays in the kernel and "
                   "its loop)." if section.get("null_file_us") is not None else
                   f"The libfuse floor was not measured: {section.get('null_unavailable') or 'not run'}.")]
    if section.get("unavailable"):
        lines += ["", f"Passthrough was not measured: {section['unavailable']}."]
    return lines


def generate(store: Path, big_mib: int, files: int) -> tuple[str, list[str]]:
    (store / "small").mkdir(parents=True, exist_ok=True)
    big = store / "big.bin"
    if not big.exists() or big.stat().st_size != big_mib * MiB:
        with open(big, "wb") as fh:
            for _ in range(big_mib):
                fh.write(os.urandom(MiB))
    rng = random.Random(1)
    small = [f"small/{i:05d}" for i in range(files)]
    for name in small:
        if not (store / name).exists():
            (store / name).write_bytes(rng.randbytes(SMALL_FILE_BYTES))
    return "big.bin", small


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.passthrough", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/cachefs-passthrough-bench"),
                        help="the source files (kept for the next run) and the mounts' work directory")
    parser.add_argument("--big-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    big, small = generate(args.dir / "store", args.big_mib, args.files)
    section = run(args.dir / "store", big, small, args.dir, args.rounds)
    print(json.dumps(section, indent=1))
    print("\n".join(markdown(section)))
    return 1 if section["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
