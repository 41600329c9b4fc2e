"""A seeded random sequence of file operations on a writable mount, checked against a local directory.

Every operation (create, write at random offsets, append, truncate, overwrite, unlink, mkdir, rmdir,
rename of files and of small directories, reads, fsync, writes and reads through handles that stay
open across a rename or an unlink) is applied to the mount and to a plain local directory, the
model. After each step the outcome (value or errno) must be the same on both, and the paths the step
touched must look the same (type, size, bytes, the parent's listing); every ``FULL_CHECK_EVERY``
steps the whole trees are compared. A few times during the run, and at the end, ``cachefs flush``
must succeed and the bucket must hold exactly the model (see ``writeback_support.bucket_problems``
for how directories map to keys); at the very end the mount is unmounted (which flushes first) and a
fresh mount with an empty cache directory, which can only see what is in the bucket, must show the
model's tree too.

It runs twice: with the default upload delay (600 steps, ``CACHEFS_WB_STEPS``), and with
``--upload-delay 0`` so that uploads, server-side copies and deletes race with every step (300 steps,
``CACHEFS_WB_EAGER_STEPS``: most steps then wait for the store).

Reproducible: the seed is printed (and named in every failure with the mode, the step and the last
few operations); ``CACHEFS_WB_SEED=<n>`` replays a run.
"""

from __future__ import annotations

import os
import random
import stat
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.fuse.writeback_support import (
    bounded,
    bucket_problems,
    describe_diff,
    errno_name,
    flush_ok,
    s3env,
    sha256,
    tree_problems,
)

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

KiB = 1024
STEPS = int(os.environ.get("CACHEFS_WB_STEPS", "600"))
# With --upload-delay 0 most steps wait for the store (an object modified right after its upload is
# copied back into staging first), about five times slower: fewer steps keep it under a minute.
EAGER_STEPS = int(os.environ.get("CACHEFS_WB_EAGER_STEPS", "300"))
FULL_CHECK_EVERY = 25
# Flush and compare the bucket at these fractions of the run too, so that later steps modify,
# rename and delete objects that are already in the store (not only staged ones).
FLUSH_AT = (0.3, 0.65)
# The 64 KiB minimum block size, so that files of a few hundred KiB span several blocks when an
# object already in the store is copied back into staging on its first modification.
MOUNT_ARGS = ["--block-size", "64KiB"]
# A directory is renamed only when it holds at most this many entries (the mount limits directory
# renames to a configurable number of entries; this stays far below any sensible default).
SMALL_DIR_ENTRIES = 6
# Bound of one step on the mount: an operation that hangs fails the test instead of hanging it.
STEP_TIMEOUT_S = 60
DIR_NAMES = ["d0", "d1", "d2", "sub dir"]
FILE_NAMES = ["f0", "f1", "f2", "f3", "f4", "f5", "f6", "data.bin", "log.txt", "é-ü.txt"]


@dataclass
class Op:
    text: str
    fn: Callable[[Path], Any]
    touched: tuple[str, ...]


def outcome(fn: Callable[[Path], Any], root: Path) -> tuple[str, Any]:
    try:
        return ("ok", fn(root))
    except OSError as exc:
        return ("error", errno_name(exc.errno))


# -- the operations (each works on any root: the model or the mount) --------------------------------


def op_create(path: str, data: bytes, fsync: bool) -> Callable[[Path], Any]:
    def run(root: Path) -> None:
        fd = os.open(root / path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    return run


def op_pwrite(path: str, offset: int, data: bytes, fsync: bool) -> Callable[[Path], Any]:
    def run(root: Path) -> None:
        fd = os.open(root / path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    return run


def op_append(path: str, data: bytes) -> Callable[[Path], Any]:
    def run(root: Path) -> int:
        fd = os.open(root / path, os.O_WRONLY | os.O_APPEND)
        try:
            _write_all(fd, data)
            return os.fstat(fd).st_size
        finally:
            os.close(fd)
    return run


def op_truncate(path: str, size: int) -> Callable[[Path], Any]:
    def run(root: Path) -> None:
        os.truncate(root / path, size)
    return run


def op_ftruncate_and_write(path: str, size: int, offset: int, data: bytes) -> Callable[[Path], Any]:
    """One handle: shrink or grow, write, read the whole file back through the same handle."""
    def run(root: Path) -> bytes:
        fd = os.open(root / path, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, data, offset)
            return _read_all(fd)
        finally:
            os.close(fd)
    return run


def op_read(path: str, offset: int, size: int) -> Callable[[Path], Any]:
    def run(root: Path) -> bytes:
        fd = os.open(root / path, os.O_RDONLY)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)
    return run


def op_two_handles(path: str, offset: int, data: bytes) -> Callable[[Path], Any]:
    """Read-after-write before close: a second handle sees bytes the first has not closed yet."""
    def run(root: Path) -> bytes:
        w = os.open(root / path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(w, data, offset)
            r = os.open(root / path, os.O_RDONLY)
            try:
                return _read_all(r)
            finally:
                os.close(r)
        finally:
            os.close(w)
    return run


def op_rename_while_open(src: str, dst: str, offset: int, data: bytes) -> Callable[[Path], Any]:
    """Keep writing through a handle opened before the file was renamed (a log being rotated)."""
    def run(root: Path) -> bytes:
        fd = os.open(root / src, os.O_RDWR)
        try:
            os.rename(root / src, root / dst)
            os.pwrite(fd, data, offset)
            return _read_all(fd)
        finally:
            os.close(fd)
    return run


def op_unlink_while_open(path: str, offset: int, data: bytes) -> Callable[[Path], Any]:
    """An unlinked file stays readable and writable through a handle opened before."""
    def run(root: Path) -> bytes:
        fd = os.open(root / path, os.O_RDWR)
        try:
            os.unlink(root / path)
            os.pwrite(fd, data, offset)
            return _read_all(fd)
        finally:
            os.close(fd)
    return run


def op_unlink(path: str) -> Callable[[Path], Any]:
    return lambda root: os.unlink(root / path)


def op_mkdir(path: str) -> Callable[[Path], Any]:
    return lambda root: os.mkdir(root / path)


def op_rmdir(path: str) -> Callable[[Path], Any]:
    return lambda root: os.rmdir(root / path)


def op_rename(src: str, dst: str) -> Callable[[Path], Any]:
    return lambda root: os.rename(root / src, root / dst)


def op_listdir(path: str) -> Callable[[Path], Any]:
    return lambda root: sorted(os.listdir(root / path))


def op_stat(path: str) -> Callable[[Path], Any]:
    def run(root: Path) -> tuple[str, int | None]:
        st = os.stat(root / path)
        if stat.S_ISDIR(st.st_mode):
            return ("dir", None)
        return ("file", st.st_size)
    return run


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    data = os.pread(fd, size + 1, 0)
    return data


# -- the generator ----------------------------------------------------------------------------------


class Generator:
    """Draws the next operation from the model's current state (the model directory is the truth)."""

    def __init__(self, rng: random.Random, model: Path) -> None:
        self.rng = rng
        self.model = model

    # the model's state
    def files(self) -> list[str]:
        return self._walk()[0]

    def dirs(self) -> list[str]:
        return self._walk()[1]

    def _walk(self) -> tuple[list[str], list[str]]:
        files: list[str] = []
        dirs: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self.model):
            rel = os.path.relpath(dirpath, self.model)
            rel = "" if rel == "." else rel
            for d in dirnames:
                dirs.append(f"{rel}/{d}" if rel else d)
            for f in filenames:
                files.append(f"{rel}/{f}" if rel else f)
        return sorted(files), sorted(dirs)

    def size(self, path: str) -> int:
        return (self.model / path).stat().st_size

    def entries_below(self, path: str) -> int:
        return sum(len(d) + len(f) for _, d, f in os.walk(self.model / path))

    # random pieces
    def data(self) -> bytes:
        r = self.rng.random()
        if r < 0.1:
            n = 0
        elif r < 0.6:
            n = self.rng.randint(1, 8 * KiB)
        elif r < 0.9:
            n = self.rng.randint(8 * KiB, 96 * KiB)
        else:
            n = self.rng.randint(96 * KiB, 400 * KiB)  # several 64 KiB blocks
        return self.rng.randbytes(n)

    def parent(self) -> str:
        dirs = self.dirs()
        if dirs and self.rng.random() < 0.6:
            return self.rng.choice(dirs)
        return ""

    def new_path(self, names: list[str]) -> str:
        """A path in an existing directory (sometimes a missing one, for ENOENT)."""
        if self.rng.random() < 0.05:
            base = f"missing-{self.rng.randint(0, 9)}"
        else:
            base = self.parent()
        name = self.rng.choice(names)
        return f"{base}/{name}" if base else name

    def some_file(self) -> str:
        files = self.files()
        if files and self.rng.random() < 0.92:
            return self.rng.choice(files)
        return self.new_path(FILE_NAMES)  # maybe missing, maybe a directory's name

    def some_dir(self) -> str | None:
        dirs = self.dirs()
        return self.rng.choice(dirs) if dirs else None

    def offset(self, size: int) -> int:
        r = self.rng.random()
        if r < 0.15:
            return 0
        if r < 0.25:
            return size  # exactly at the end
        if r < 0.35:
            return size + self.rng.randint(1, 100 * KiB)  # past the end: a hole of zeros
        return self.rng.randint(0, max(0, size))

    # the next operation
    def next(self) -> Op:
        rng = self.rng
        kind = rng.choices(
            ["create", "pwrite", "append", "truncate", "ftruncate", "read", "two_handles", "unlink",
             "mkdir", "rmdir", "rename_file", "rename_dir", "rename_open", "unlink_open", "listdir", "stat",
             "error"],
            weights=[20, 14, 8, 6, 3, 8, 3, 4, 6, 4, 7, 3, 1, 1, 3, 2, 4],
        )[0]
        files = self.files()
        if kind == "create":
            path = rng.choice(files) if files and rng.random() < 0.3 else self.new_path(FILE_NAMES)
            data = self.data()
            fsync = rng.random() < 0.3
            return Op(f"create {path!r} with {len(data)} bytes{' +fsync' if fsync else ''}",
                      op_create(path, data, fsync), (path,))
        if kind in ("pwrite", "append", "truncate", "ftruncate", "read", "two_handles") and not files:
            kind = "create_missing"
        if kind == "create_missing":
            path = self.new_path(FILE_NAMES)
            data = self.data()
            return Op(f"create {path!r} with {len(data)} bytes", op_create(path, data, False), (path,))
        if kind == "pwrite":
            path = self.some_file()
            size = self.size(path) if path in files else 0
            off, data = self.offset(size), self.data()
            fsync = rng.random() < 0.2
            return Op(f"pwrite {path!r} at {off} {len(data)} bytes{' +fsync' if fsync else ''}",
                      op_pwrite(path, off, data, fsync), (path,))
        if kind == "append":
            path = self.some_file()
            data = self.data()
            return Op(f"append {len(data)} bytes to {path!r}", op_append(path, data), (path,))
        if kind == "truncate":
            path = self.some_file()
            size = self.size(path) if path in files else 0
            new = rng.choice([0, rng.randint(0, size), size + rng.randint(1, 64 * KiB), max(0, size - 1)])
            return Op(f"truncate {path!r} to {new}", op_truncate(path, new), (path,))
        if kind == "ftruncate":
            path = rng.choice(files)
            size = self.size(path)
            new = rng.randint(0, size + 32 * KiB)
            off, data = self.offset(new), self.data()
            return Op(f"ftruncate {path!r} to {new} then write {len(data)} bytes at {off}",
                      op_ftruncate_and_write(path, new, off, data), (path,))
        if kind == "read":
            path = self.some_file()
            size = self.size(path) if path in files else 0
            off = self.offset(size)
            n = rng.choice([1, 4096, 65536, 200 * KiB, size + 10])
            return Op(f"read {path!r} at {off} {n} bytes", op_read(path, off, n), ())
        if kind == "two_handles":
            path = rng.choice(files)
            off, data = self.offset(self.size(path)), self.data()
            return Op(f"two handles on {path!r}: write {len(data)} at {off}, read all before close",
                      op_two_handles(path, off, data), (path,))
        if kind == "unlink":
            r = rng.random()
            dirs = self.dirs()
            if r < 0.1 and dirs:
                path = rng.choice(dirs)  # EISDIR
            else:
                path = self.some_file()
            return Op(f"unlink {path!r}", op_unlink(path), (path,))
        if kind == "mkdir":
            r = rng.random()
            dirs = self.dirs()
            if r < 0.08 and dirs:
                path = rng.choice(dirs)  # EEXIST
            elif r < 0.12 and files:
                path = rng.choice(files)  # EEXIST (a file)
            else:
                path = self.new_path(DIR_NAMES)
            return Op(f"mkdir {path!r}", op_mkdir(path), (path,))
        if kind == "rmdir":
            r = rng.random()
            dirs = self.dirs()
            if r < 0.1 and files:
                path = rng.choice(files)  # ENOTDIR
            elif dirs:
                empty = [d for d in dirs if not os.listdir(self.model / d)]
                path = rng.choice(empty) if empty and rng.random() < 0.7 else rng.choice(dirs)  # maybe ENOTEMPTY
            else:
                path = self.new_path(DIR_NAMES)  # ENOENT
            return Op(f"rmdir {path!r}", op_rmdir(path), (path,))
        if kind == "rename_file":
            src = self.some_file()
            r = rng.random()
            dirs = self.dirs()
            if r < 0.3 and files:
                dst = rng.choice(files)  # replace an existing file (or itself)
            elif r < 0.38 and dirs:
                dst = rng.choice(dirs)  # EISDIR
            else:
                dst = self.new_path(FILE_NAMES)
            return Op(f"rename file {src!r} -> {dst!r}", op_rename(src, dst), (src, dst))
        if kind == "rename_dir":
            dirs = [d for d in self.dirs() if self.entries_below(d) <= SMALL_DIR_ENTRIES]
            if not dirs:
                path = self.new_path(DIR_NAMES)
                return Op(f"mkdir {path!r}", op_mkdir(path), (path,))
            src = rng.choice(dirs)
            r = rng.random()
            all_dirs = self.dirs()
            if r < 0.25 and all_dirs:
                dst = rng.choice(all_dirs)  # an empty one is replaced; ENOTEMPTY; EINVAL into itself
            elif r < 0.35 and files:
                dst = rng.choice(files)  # ENOTDIR
            elif r < 0.42:
                dst = f"{src}/{rng.choice(DIR_NAMES)}"  # EINVAL: into its own subtree
            else:
                dst = self.new_path(DIR_NAMES)
            return Op(f"rename dir {src!r} -> {dst!r}", op_rename(src, dst), (src, dst))
        if kind == "rename_open" and files:
            src = rng.choice(files)
            dst = self.new_path(FILE_NAMES)
            off, data = self.offset(self.size(src)), self.data()
            return Op(f"open {src!r}, rename it to {dst!r}, write {len(data)} at {off} through the handle",
                      op_rename_while_open(src, dst, off, data), (src, dst))
        if kind == "unlink_open" and files:
            path = rng.choice(files)
            off, data = self.offset(self.size(path)), self.data()
            return Op(f"open {path!r}, unlink it, write {len(data)} at {off} and read through the handle",
                      op_unlink_while_open(path, off, data), (path,))
        if kind == "listdir":
            path = self.some_dir() or ""
            return Op(f"listdir {path!r}", op_listdir(path), ())
        if kind == "stat":
            path = self.some_file()
            return Op(f"stat {path!r}", op_stat(path), ())
        # "error": operations that must fail the same way on both sides.
        return self.error_op()

    def error_op(self) -> Op:
        rng = self.rng
        files, dirs = self.files(), self.dirs()
        choices: list[Op] = [
            Op("open a missing file for reading", op_read("no-such-file", 0, 10), ()),
            Op("write into a missing directory", op_create("no-such-dir/x", b"x", False), ("no-such-dir/x",)),
            Op("mkdir in a missing directory", op_mkdir("no-such-dir/y"), ("no-such-dir/y",)),
        ]
        if dirs:
            d = rng.choice(dirs)
            choices += [
                Op(f"open directory {d!r} for writing", op_pwrite(d, 0, b"x", False), (d,)),
                Op(f"truncate directory {d!r}", op_truncate(d, 0), (d,)),
                Op(f"read directory {d!r} as a file", op_read(d, 0, 10), ()),
            ]
        if files:
            f = rng.choice(files)
            choices += [
                Op(f"mkdir below file {f!r}", op_mkdir(f"{f}/x"), (f,)),
                Op(f"create below file {f!r}", op_create(f"{f}/x", b"x", False), (f,)),
                Op(f"listdir file {f!r}", op_listdir(f), ()),
            ]
        return rng.choice(choices)


# -- the test ---------------------------------------------------------------------------------------


# "default": uploads start 2 s after a close (most steps act on staged files, some on uploaded ones);
# "eager": --upload-delay 0, so uploads, renames and deletes in the store race with every step.
UPLOAD_MODES = {"default": ([], STEPS), "eager": (["--upload-delay", "0"], EAGER_STEPS)}


@pytest.mark.parametrize("mode", sorted(UPLOAD_MODES))
def test_random_operations_match_a_local_directory_and_the_bucket(mode: str, seaweed, mounter, tmp_path: Path) -> None:
    seed = int(os.environ.get("CACHEFS_WB_SEED", str(int.from_bytes(os.urandom(4), "big"))))
    mount_args, steps = UPLOAD_MODES[mode]
    print(f"\nwrite-back model test ({mode} uploads): seed {seed}, {steps} steps "
          f"(replay: CACHEFS_WB_SEED={seed} ... -k {mode})")
    rng = random.Random(seed)
    bucket = f"wbmodel-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(bucket)
    prefix = "data/"
    client = seaweed.client()
    model = tmp_path / "model"
    model.mkdir()
    m = mounter.mount(f"s3://{bucket}/{prefix.rstrip('/')}", *MOUNT_ARGS, *mount_args, env=s3env(seaweed))
    gen = Generator(rng, model)
    recent: deque[str] = deque(maxlen=12)
    flush_steps = {int(steps * f) for f in FLUSH_AT}
    counts: dict[str, int] = {}
    errors_matched = 0
    started = time.monotonic()

    def fail(step: int, message: str) -> None:
        history = "\n  ".join(recent)
        pytest.fail(f"{mode} uploads, seed {seed}, step {step}: {message}\nlast operations:\n  {history}", pytrace=False)

    for step in range(1, steps + 1):
        op = gen.next()
        recent.append(f"{step}: {op.text}")
        kind = op.text.split(" ")[0]
        counts[kind] = counts.get(kind, 0) + 1
        expected = outcome(op.fn, model)
        try:
            got = bounded(lambda fn=op.fn: outcome(fn, m.path), STEP_TIMEOUT_S, f"step {step} ({op.text})")
        except AssertionError as exc:
            fail(step, str(exc))
        if expected != got:
            fail(step, f"{op.text}: model {_show(expected)}, mount {_show(got)}")
        if expected[0] == "error":
            errors_matched += 1
        for problem in _touched_problems(model, m.path, op.touched):
            fail(step, f"after {op.text}: {problem}")
        if step % FULL_CHECK_EVERY == 0 or step == steps:
            problems = tree_problems(model, m.path)
            if problems:
                fail(step, "the trees differ:\n  " + "\n  ".join(problems))
        if step in flush_steps:
            flush_ok(m)
            problems = bucket_problems(client, bucket, prefix, model, every_dir_marked=True)
            if problems:
                fail(step, "after cachefs flush the bucket differs from the model:\n  " + "\n  ".join(problems))

    flush_ok(m)
    problems = bucket_problems(client, bucket, prefix, model, every_dir_marked=True)
    if problems:
        fail(steps, "after the final cachefs flush the bucket differs from the model:\n  " + "\n  ".join(problems))
    result = m.unmount()
    assert result.returncode == 0, f"unmount after a successful flush failed: {result.stderr}"
    # A fresh mount knows only the bucket: it must show the same tree (empty directories included).
    fresh = mounter.mount(f"s3://{bucket}/{prefix.rstrip('/')}", *MOUNT_ARGS, env=s3env(seaweed))
    problems = tree_problems(model, fresh.path)
    if problems:
        fail(steps, "a fresh mount of the bucket differs from the model:\n  " + "\n  ".join(problems))
    files, dirs = gen._walk()
    print(f"write-back model test ({mode} uploads): seed {seed}: {steps} steps matched ({errors_matched} failing the same way) "
          f"in {time.monotonic() - started:.1f} s; final tree {len(files)} files, {len(dirs)} directories; "
          f"operations: {dict(sorted(counts.items()))}")


def _show(result: tuple[str, Any]) -> str:
    kind, value = result
    if kind == "error":
        return f"error {value}"
    if isinstance(value, bytes):
        return f"ok ({len(value)} bytes, sha256 {sha256(value)[:12]})"
    return f"ok ({value!r})"


def _touched_problems(model: Path, mount: Path, touched: tuple[str, ...]) -> list[str]:
    problems: list[str] = []
    parents = set()
    for path in touched:
        parents.add(os.path.dirname(path))
        a, b = _look(model / path), _look(mount / path)
        if a != b:
            if a[0] == b[0] == "file":
                problems.append(f"{path!r} differs: {describe_diff(a[1], b[1])}")
            else:
                problems.append(f"{path!r}: model {a[0]}, mount {b[0]}")
        if a[0] == "dir":
            listing = _look_dir(model / path), _look_dir(mount / path)
            if listing[0] != listing[1]:
                problems.append(f"listing of {path!r}: model {listing[0]}, mount {listing[1]}")
    for parent in sorted(parents):
        listing = _look_dir(model / parent), _look_dir(mount / parent)
        if listing[0] != listing[1]:
            problems.append(f"listing of {parent or '/'!r}: model {listing[0]}, mount {listing[1]}")
    return problems


def _look(path: Path) -> tuple[str, Any]:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return (f"missing ({errno_name(exc.errno)})", None)
    if stat.S_ISDIR(st.st_mode):
        return ("dir", None)
    data = path.read_bytes()
    if len(data) != st.st_size:
        return ("file with stat size", (st.st_size, len(data)))
    return ("file", data)


def _look_dir(path: Path) -> Any:
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return f"error {errno_name(exc.errno)}"
