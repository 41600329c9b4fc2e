"""fio verify jobs on a writable mount: several engines, sequential and random writes.

Each job writes through the mount with fio's own checksummed blocks (``--verify``) and reads them
back (``--do_verify=1``, ``--verify_fatal=1``): fio must exit 0. Then ``cachefs flush`` must
succeed, each file fio wrote must be an object of the right size whose bytes equal what the mount
serves, and, on a fresh mount with an empty cache directory (so every byte comes from the bucket),
the same job run with ``--verify_only`` must verify every block again.

Sizes are modest (16-64 MiB per job) to keep the run short on a 2-core CI machine. Buffered I/O
only (``--direct=0``): the point is the data path through the mount, not O_DIRECT support.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.fuse.writeback_support import flush_ok, get_bytes, list_keys, s3env, sha256

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

# Bound of one fio run (write + verify of at most 64 MiB through FUSE on a slow runner).
FIO_TIMEOUT_S = 240

COMMON = ["--fallocate=none", "--direct=0", "--do_verify=1", "--verify_fatal=1", "--randrepeat=1",
          "--verify_state_save=0", "--output-format=normal"]

# name: fio options. Sequential and random writes over psync, libaio, posixaio and mmap; one job
# fsyncs while it rewrites random blocks (rewrites inside an acknowledged version); one runs four
# writers at once on files of their own.
JOBS: dict[str, list[str]] = {
    "psync-seq": ["--ioengine=psync", "--rw=write", "--bs=128k", "--size=32M", "--verify=crc32c"],
    "psync-rand": ["--ioengine=psync", "--rw=randwrite", "--bs=16k", "--size=16M", "--verify=crc32c"],
    "libaio-rand": ["--ioengine=libaio", "--iodepth=8", "--rw=randwrite", "--bs=64k", "--size=32M",
                    "--verify=md5"],
    "posixaio-seq": ["--ioengine=posixaio", "--iodepth=4", "--rw=write", "--bs=256k", "--size=64M",
                     "--verify=crc32c"],
    "mmap-rand": ["--ioengine=mmap", "--rw=randwrite", "--bs=16k", "--size=16M", "--verify=crc32c"],
    "psync-rand-fsync": ["--ioengine=psync", "--rw=randwrite", "--bs=64k", "--size=16M", "--fsync=32",
                         "--verify=crc32c"],
    "psync-4jobs": ["--ioengine=psync", "--rw=randwrite", "--bs=32k", "--size=8M", "--numjobs=4",
                    "--verify=crc32c"],
}


def fio_engines() -> set[str]:
    out = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True, timeout=30).stdout
    return {line.strip() for line in out.splitlines()[1:] if line.strip()}


def run_fio(name: str, options: list[str], directory: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["fio", f"--name={name}", f"--directory={directory}", *options, *COMMON, *extra],
        capture_output=True, text=True, timeout=FIO_TIMEOUT_S, cwd=cwd,
    )

@pytest.mark.parametrize("job", sorted(JOBS))
def test_fio_verify_then_bytes_in_the_bucket(job: str, seaweed, mounter, tmp_path: Path) -> None:
    if shutil.which("fio") is None:
        pytest.fail("fio is not installed (scripts/setup.sh installs Debian's fio)")
    options = JOBS[job]
    engine = next(o.split("=", 1)[1] for o in options if o.startswith("--ioengine="))
    if engine not in fio_engines():
        pytest.skip(f"this fio has no {engine} engine")
    bucket = f"wbfio-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(bucket)
    env = s3env(seaweed)
    m = mounter.mount(f"s3://{bucket}/fio", env=env)
    work = tmp_path / "fio-cwd"
    work.mkdir()

    result = run_fio(job, options, m.path, work)
    assert result.returncode == 0, f"fio {job} failed (exit {result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "verify failed" not in result.stdout + result.stderr

    jobs = int(next((o.split("=", 1)[1] for o in options if o.startswith("--numjobs=")), "1"))
    size = _size(next(o.split("=", 1)[1] for o in options if o.startswith("--size=")))
    expected_names = {f"{job}.{n}.0" for n in range(jobs)}
    assert set(os.listdir(m.path)) == expected_names
    served = {}
    for name in expected_names:
        data = (m.path / name).read_bytes()
        assert len(data) == size, f"{name}: the mount serves {len(data)} bytes, fio wrote {size}"
        served[name] = sha256(data)

    flush_ok(m)
    client = seaweed.client()
    objects = list_keys(client, bucket, "fio/")
    assert {k: v["size"] for k, v in objects.items()} == {f"fio/{n}": size for n in expected_names}
    for name, digest in served.items():
        assert sha256(get_bytes(client, bucket, f"fio/{name}")) == digest, f"fio/{name}: bucket bytes differ from the mount's"

    # A fresh mount, empty cache: fio verifies every block again, now read from the bucket.
    assert m.unmount().returncode == 0
    # (Writable: fio opens the files read-write even when it only verifies.)
    fresh = mounter.mount(f"s3://{bucket}/fio", env=env)
    again = run_fio(job, options, fresh.path, work, "--verify_only")
    assert again.returncode == 0, f"fio {job} --verify_only on a fresh mount failed:\n{again.stdout[-4000:]}\n{again.stderr[-4000:]}"
    print(f"fio {job}: {jobs} x {size // (1024 * 1024)} MiB written, verified, flushed, verified again from the bucket")


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    return int(text[:-1]) * units[text[-1].lower()]
