"""Metadata at scale: a manifest mount of millions of entries, and a remount of a large bucket.

Real mounts made by the ``cachefs`` CLI, over a ``file://`` source (a local directory stands in for
the bucket: metadata figures do not depend on the store once nothing is listed, and creating a
million objects in SeaweedFS on a shared 2-core machine takes longer than the rest together).

  manifest mount   the RSS of a daemon with an empty source (the baseline), then a ``--manifest`` of ``--entries`` lines (one directory of ``--big-dir`` entries,
                   the rest in directories of 1,000), ``--ram-cache 0 --disk-cache 0``: the time of
                   the first mount (the manifest imported into the index) and of a remount (the
                   index reused), the daemon's RSS after mounting and after the work below (VmRSS,
                   and VmHWM, the peak), ``stat`` of ``--stats`` random paths per second (each a
                   kernel lookup: the kernel has cached none of them), and walking the big directory
                   as ``ls -l`` does (readdir + stat of every entry)
  bucket remount   a source of ``--objects`` empty objects in directories of 1,000: a first mount
                   walks everything (LISTs it all), is unmounted, and a second mount with the same
                   cache dir and ``--dir-ttl`` is timed to its first ``ls`` and walks everything
                   again: directory LISTs it issues (expected 0: the index answers) and its RSS

Run: .venv/bin/python -m benchmarks.metadata [--entries 10000000] [--objects 1000000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cachefs import mounts  # noqa: E402
from cachefs.client import call  # noqa: E402

CLI = [sys.executable, "-m", "cachefs"]
# A 10 M-line manifest imports in about 2 min here (8 min before the import's fast path); the CLI waits up to
# MOUNT_WAIT_S for the daemon.
MOUNT_TIMEOUT_S = 900
FILES_PER_DIR = 1000
MiB = 1024 * 1024


def cli(*args: str, timeout: float = MOUNT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"cachefs {' '.join(args[:1])} failed: {result.stderr.strip()}")
    return result


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


class Mounted:
    def __init__(self, source: str, mountpoint: Path, cache_dir: Path, *extra: str) -> None:
        self.mountpoint = mountpoint
        mountpoint.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        cli("mount", source, str(mountpoint), "--cache-dir", str(cache_dir), *extra)
        self.mount_s = time.perf_counter() - start
        self.pid = int(call(mountpoint, "/info")["pid"])

    def stats(self) -> dict:
        return call(self.mountpoint, "/stats")

    def unmount(self) -> None:
        if mounts.find_mount(self.mountpoint) is not None:
            cli("unmount", str(self.mountpoint), timeout=120)


def big_name(i: int) -> str:
    return f"big/img{i:07d}.jpg"


def write_manifest(path: Path, entries: int, big: int) -> None:
    with open(path, "w") as out:
        for i in range(entries):
            name = big_name(i) if i < big else f"d{(i - big) // FILES_PER_DIR:05d}/f{i:08d}.jpg"
            out.write(f'{{"etag": "\\"{i:032x}\\"", "path": "{name}", "size": {100_000 + i % 1000}}}\n')


def random_path(entries: int, big: int) -> str:
    i = random.randrange(entries)
    return big_name(i) if i < big else f"d{(i - big) // FILES_PER_DIR:05d}/f{i:08d}.jpg"


def manifest_figures(work: Path, entries: int, big: int, stats_n: int) -> dict:
    source = work / "empty-source"
    source.mkdir()
    manifest = work / "manifest.jsonl"
    start = time.perf_counter()
    write_manifest(manifest, entries, big)
    print(f"manifest: {entries:,} lines, {manifest.stat().st_size / MiB:.0f} MiB, "
          f"written in {time.perf_counter() - start:.0f} s", flush=True)
    empty = Mounted(f"file://{source}", work / "mnt-empty", work / "cache-empty", "--read-only",
                    "--ram-cache", "0", "--disk-cache", "0")
    try:
        baseline = rss_mib(empty.pid)[0]  # a daemon with nothing to hold
    finally:
        empty.unmount()
    opts = ("--manifest", str(manifest), "--ram-cache", "0", "--disk-cache", "0")
    cache = work / "cache-manifest"
    first = Mounted(f"file://{source}", work / "mnt-manifest", cache, *opts)
    try:
        after_mount = rss_mib(first.pid)
    finally:
        first.unmount()
    m = Mounted(f"file://{source}", work / "mnt-manifest", cache, *opts)
    try:
        rss_remount = rss_mib(m.pid)
        paths = [random_path(entries, big) for _ in range(stats_n)]
        start = time.perf_counter()
        for p in paths:
            os.stat(m.mountpoint / p)
        stat_rate = stats_n / (time.perf_counter() - start)
        start = time.perf_counter()
        seen = 0
        with os.scandir(m.mountpoint / "big") as it:
            for entry in it:
                entry.stat()
                seen += 1
        walk_s = time.perf_counter() - start
        assert seen == big, (seen, big)
        doc = m.stats()
        rss_after, hwm = rss_mib(m.pid)
        return {
            "entries": entries,
            "index_entries": doc["filesystem"]["index_entries"],
            "first_mount_s": round(first.mount_s, 2),
            "remount_s": round(m.mount_s, 2),
            "rss_after_first_mount_mib": round(after_mount[0], 1),
            "peak_rss_first_mount_mib": round(after_mount[1], 1),
            "rss_after_remount_mib": round(rss_remount[0], 1),
            "rss_after_work_mib": round(rss_after, 1),
            "peak_rss_remount_mib": round(hwm, 1),
            "rss_empty_mount_mib": round(baseline, 1),
            "rss_bytes_per_entry_above_empty": round((rss_after - baseline) * MiB / entries, 1),
            "stat_random_paths_per_s": round(stat_rate),
            "big_dir_entries": big,
            "big_dir_ls_l_s": round(walk_s, 2),
            "big_dir_entries_per_s": round(big / walk_s),
            "directory_listings": doc["filesystem"]["listings"],
            "list_requests": doc["object_store"]["list_requests"],
            "index_bytes": sum(p.stat().st_size for p in cache.rglob("manifest-*.db")),
        }
    finally:
        m.unmount()


def make_source(root: Path, objects: int) -> None:
    for i in range(objects):
        directory = root / f"d{i // FILES_PER_DIR:05d}"
        if i % FILES_PER_DIR == 0:
            directory.mkdir(parents=True)
        os.close(os.open(directory / f"f{i:08d}.jpg", os.O_CREAT | os.O_WRONLY, 0o644))


def walk_names(root: Path) -> int:
    count = 0
    for _, _, names in os.walk(root):
        count += len(names)
    return count


def remount_figures(work: Path, objects: int) -> dict:
    source = work / "bucket"
    start = time.perf_counter()
    make_source(source, objects)
    print(f"source: {objects:,} objects made in {time.perf_counter() - start:.0f} s", flush=True)
    cache = work / "cache-bucket"
    opts = ("--read-only", "--dir-ttl", "3600", "--ram-cache", "0", "--disk-cache", "0")
    first = Mounted(f"file://{source}", work / "mnt-bucket", cache, *opts)
    try:
        start = time.perf_counter()
        assert walk_names(first.mountpoint) == objects
        first_walk_s = time.perf_counter() - start
        first_doc = first.stats()
        first_rss = rss_mib(first.pid)
    finally:
        first.unmount()
    second = Mounted(f"file://{source}", work / "mnt-bucket", cache, *opts)
    try:
        start = time.perf_counter()
        top = os.listdir(second.mountpoint)
        first_ls_s = time.perf_counter() - start
        assert len(top) == (objects + FILES_PER_DIR - 1) // FILES_PER_DIR
        start = time.perf_counter()
        assert walk_names(second.mountpoint) == objects
        second_walk_s = time.perf_counter() - start
        doc = second.stats()
        return {
            "objects": objects,
            "first_mount_directory_listings": first_doc["filesystem"]["listings"],
            "first_mount_list_requests": first_doc["object_store"]["list_requests"],
            "first_walk_s": round(first_walk_s, 2),
            "first_mount_rss_mib": round(first_rss[0], 1),
            "remount_s": round(second.mount_s, 2),
            "remount_first_ls_s": round(first_ls_s, 3),
            "remount_walk_s": round(second_walk_s, 2),
            "remount_directory_listings": doc["filesystem"]["listings"],
            "remount_list_requests": doc["object_store"]["list_requests"],
            "remount_index_listings": doc["filesystem"]["index_listings"],
            "remount_rss_mib": round(rss_mib(second.pid)[0], 1),
            "index_bytes": sum(p.stat().st_size for p in cache.rglob("metadata.db*")),
        }
    finally:
        second.unmount()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000_000, help="manifest lines (default 10,000,000)")
    parser.add_argument("--big-dir", type=int, default=100_000, help="entries of the one big directory")
    parser.add_argument("--stats", type=int, default=20_000, help="random paths stat'ed")
    parser.add_argument("--objects", type=int, default=1_000_000, help="objects of the remounted source")
    parser.add_argument("--out", type=Path, default=None, help="write metadata.json here")
    parser.add_argument("--workdir", type=Path, default=None, help="where to put sources and caches (default: a temp dir)")
    args = parser.parse_args(argv)
    if not 0 < args.big_dir <= args.entries:
        parser.error("--big-dir must be between 1 and --entries")
    work = Path(tempfile.mkdtemp(prefix="cachefs-metadata-", dir=args.workdir))
    try:
        results = {"manifest_mount": manifest_figures(work, args.entries, args.big_dir, args.stats),
                   "bucket_remount": remount_figures(work, args.objects)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "metadata.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
