"""Replies on more than one core: a prototype FUSE server in four shapes, measured (issue 39).

Does serving one mount from several threads or processes (``FUSE_DEV_IOC_CLONE``d descriptors, one
per reader) lower the busiest thread's CPU, and raise files/s, for a Python daemon on this machine?
The server here is cachefs's own wire format (``cachefs.fuse.wire``) over a tree held in memory: a
root with ``--files`` files of 100 KiB and one 256 MiB file, every answer precomputed, so the figures
are the dispatch's and the kernel's, not a filesystem's. Shapes (``--mode``):

* ``loop``: what ``cachefs.fuse.session`` does: the asyncio loop reads the session descriptor
  (``add_reader``), OPEN and READ run as tasks (as cachefs's handlers that may wait), the rest inline;
* ``handoff``: ``--threads`` reader threads, each blocked in ``readv`` on its own cloned descriptor
  (GIL released), copy the request out and hand it to the loop (``call_soon_threadsafe``), which
  answers exactly as ``loop`` does, on the descriptor the request came from. The shape a daemon whose
  state lives on the loop can take;
* ``handoff-write``: as ``handoff``, and a READ's reply of more than a page is written by a writer
  thread (``os.writev`` releases the GIL: the kernel's copy into the reader's pages leaves the loop);
* ``threads``: each reader thread answers its requests itself (no loop: only possible for state that
  threads may share);
* ``procs``: one process per descriptor, each answering itself (the issue's "2 processes" row).

Workloads, each from ``--readers`` reader processes: ``warm`` (open, read 100 KiB from the page
cache, close: OPEN and RELEASE reach the server) and ``direct`` (1 MiB ``O_DIRECT`` reads of the big
file: one READ each, the reply copied by the kernel into the reader's buffer); with ``--daemon`` also
``buffered`` (one reader: the big file read through the page cache after its pages were dropped, so
the kernel copies each reply into fresh pages). Figures: server CPU
(``schedstat`` of every thread) in total and of its busiest thread, per file or per GiB, and the rate.

    .venv/bin/python -m benchmarks.fuse_clone --modes loop,handoff,threads,procs --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import os
import queue
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cachefs.fuse import wire  # noqa: E402
from cachefs.fuse.mounting import mount_syscall, open_device, unmount  # noqa: E402
from cachefs.fuse.session import BUFFER_SIZE, MAX_PAGES, MAX_WRITE  # noqa: E402

DEV_IOC_CLONE = 2 << 30 | 4 << 16 | wire.DEV_IOC_MAGIC << 8 | 0  # _IOR(229, 0, uint32_t)
SMALL = 100 * 1024
BIG = 256 * 1024 * 1024
TTL = 3600.0
BIG_INO = 2
PATTERN = memoryview(bytes(range(256)) * (MAX_WRITE // 256))


class Tree:
    """Precomputed answers: LOOKUP by name, GETATTR, OPEN, READ of the in-memory tree."""

    def __init__(self, files: int) -> None:
        now = time.time_ns()
        self.entries: dict[bytes, bytes] = {}
        self.attrs: dict[int, bytes] = {}
        self.sizes: dict[int, int] = {}
        root = wire.Attr(wire.ROOT_ID, 0, stat.S_IFDIR | 0o755, 2, 0, 0, now)
        self.attrs[wire.ROOT_ID] = wire.attr_out(root, TTL)
        for ino, name, size in [(BIG_INO, b"big", BIG)] + [(10 + i, b"f%d" % i, SMALL) for i in range(files)]:
            a = wire.Attr(ino, size, stat.S_IFREG | 0o644, 1, 0, 0, now)
            self.entries[name] = wire.entry_out(a, TTL, TTL)
            self.attrs[ino] = wire.attr_out(a, TTL)
            self.sizes[ino] = size
        self.open_reply = wire.open_out(1, wire.FOPEN_KEEP_CACHE | wire.FOPEN_NOFLUSH)

    def answer(self, req: wire.Request) -> tuple[int, object]:
        """(errno, reply buffers or None) for one request; (-1, None) for no reply."""
        op = req.opcode
        if op == wire.LOOKUP:
            e = self.entries.get(req.name())
            return (0, e) if e is not None else (errno.ENOENT, None)
        if op == wire.GETATTR:
            return 0, self.attrs[req.nodeid]
        if op == wire.OPEN or op == wire.OPENDIR:
            return 0, self.open_reply
        if op == wire.READ:
            _, offset, size = wire.READ_IN.unpack_from(req.body)[:3]
            size = max(0, min(size, self.sizes[req.nodeid] - offset))
            return 0, PATTERN[:size]
        if op in (wire.RELEASE, wire.RELEASEDIR, wire.FLUSH):
            return 0, None
        if op in (wire.FORGET, wire.BATCH_FORGET, wire.INTERRUPT):
            return -1, None
        return errno.ENOSYS, None


def send(fd: int, unique: int, error: int, reply: object) -> None:
    if error or reply is None:
        bufs = [wire.out_header(unique, error, 0)]
    else:
        bufs = [wire.out_header(unique, 0, len(reply)), reply]  # type: ignore[arg-type,list-item]
    try:
        os.writev(fd, bufs)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENODEV):
            raise


def init(fd: int) -> None:
    """Read and answer INIT on the session descriptor (the kernel sends nothing else before)."""
    buf = bytearray(BUFFER_SIZE)
    n = os.readv(fd, [buf])
    req = wire.parse_request(memoryview(buf)[:n])
    assert req.opcode == wire.INIT, req.opcode
    got = wire.parse_init(req.body)
    flags = got.flags & (wire.ASYNC_READ | wire.BIG_WRITES | wire.MAX_PAGES | wire.PARALLEL_DIROPS)
    send(fd, req.unique, 0, wire.init_out(minor=min(got.minor, wire.KERNEL_MINOR), max_readahead=got.max_readahead,
                                          flags=flags, max_background=64, congestion_threshold=48,
                                          max_write=MAX_WRITE, max_pages=MAX_PAGES))


def clone(session_fd: int) -> int:
    fd = open_device()
    fcntl.ioctl(fd, DEV_IOC_CLONE, struct.pack("<I", session_fd))
    return fd


def serve_blocking(fd: int, tree: Tree) -> None:
    """One thread or process answering every request it reads from ``fd`` until ENODEV."""
    buf = bytearray(BUFFER_SIZE)
    view = memoryview(buf)
    while True:
        try:
            n = os.readv(fd, [buf])
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINTR):
                continue
            return
        req = wire.parse_request(view[:n])
        error, reply = tree.answer(req)
        if error >= 0:
            send(fd, req.unique, error, reply)


class LockedSelector(selectors.EpollSelector):
    """Releases ``lock`` while the loop waits: the loop's thread holds it whenever it runs Python."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self.lock = lock

    def select(self, timeout: float | None = None) -> list:  # type: ignore[type-arg]
        self.lock.release()
        try:
            return super().select(timeout)
        finally:
            self.lock.acquire()


class LoopServer:
    """The loop answers; requests come from ``add_reader`` (loop) or from reader threads (handoff)."""

    def __init__(self, tree: Tree, write_thread: bool, lock: threading.Lock | None = None) -> None:
        self.tree = tree
        self.lock = lock
        if lock is not None:
            lock.acquire()
            self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop(LockedSelector(lock))
        else:
            self.loop = asyncio.new_event_loop()
        self.writes: queue.SimpleQueue[tuple[int, int, object] | None] | None = None
        if write_thread:
            self.writes = queue.SimpleQueue()
            threading.Thread(target=self._writer, name="writer", daemon=True).start()

    def _writer(self) -> None:
        assert self.writes is not None
        while (item := self.writes.get()) is not None:
            send(item[0], item[1], 0, item[2])

    def dispatch(self, fd: int, data: memoryview) -> None:
        req = wire.parse_request(data)
        if req.opcode in (wire.OPEN, wire.READ):
            req = req._replace(body=memoryview(req.body.tobytes()))
            self.loop.create_task(self._task(fd, req))
            return
        error, reply = self.tree.answer(req)
        if error >= 0:
            send(fd, req.unique, error, reply)

    async def _task(self, fd: int, req: wire.Request) -> None:
        error, reply = self.tree.answer(req)
        if self.writes is not None and req.opcode == wire.READ and reply is not None and len(reply) > 4096:  # type: ignore[arg-type]
            self.writes.put((fd, req.unique, reply))
            return
        send(fd, req.unique, error, reply)

    def run_loop(self, fd: int) -> None:
        buf = bytearray(BUFFER_SIZE)
        view = memoryview(buf)
        done = self.loop.create_future()

        def readable() -> None:
            for _ in range(16):
                try:
                    n = os.readv(fd, [buf])
                except BlockingIOError:
                    return
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        continue
                    self.loop.remove_reader(fd)
                    if not done.done():
                        done.set_result(None)
                    return
                self.dispatch(fd, view[:n])

        os.set_blocking(fd, False)
        self.loop.add_reader(fd, readable)
        self.loop.run_until_complete(done)

    def run_split(self, fds: list[int], everything: bool) -> None:
        """Reader threads answer what needs no waiting under the state lock (the loop holds it except
        while it waits); OPEN and READ go to the loop as tasks unless ``everything``."""
        assert self.lock is not None
        lock = self.lock
        done = self.loop.create_future()
        left = [len(fds)]

        def ended() -> None:
            left[0] -= 1
            if left[0] == 0 and not done.done():
                done.set_result(None)

        def reader(fd: int) -> None:
            buf = bytearray(BUFFER_SIZE)
            view = memoryview(buf)
            while True:
                try:
                    n = os.readv(fd, [buf])
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.EINTR):
                        continue
                    self.loop.call_soon_threadsafe(ended)
                    return
                req = wire.parse_request(view[:n])
                if not everything and req.opcode in (wire.OPEN, wire.READ):
                    self.loop.call_soon_threadsafe(self.dispatch, fd, memoryview(bytes(buf[:n])))
                    continue
                with lock:
                    error, reply = self.tree.answer(req)
                if error >= 0:
                    send(fd, req.unique, error, reply)

        for i, fd in enumerate(fds):
            threading.Thread(target=reader, args=(fd,), name=f"reader{i}", daemon=True).start()
        self.loop.run_until_complete(done)

    def run_handoff(self, fds: list[int]) -> None:
        done = self.loop.create_future()
        left = [len(fds)]

        def ended() -> None:
            left[0] -= 1
            if left[0] == 0 and not done.done():
                done.set_result(None)

        def reader(fd: int) -> None:
            buf = bytearray(BUFFER_SIZE)
            while True:
                try:
                    n = os.readv(fd, [buf])
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.EINTR):
                        continue
                    self.loop.call_soon_threadsafe(ended)
                    return
                self.loop.call_soon_threadsafe(self.dispatch, fd, memoryview(bytes(buf[:n])))

        for i, fd in enumerate(fds):
            threading.Thread(target=reader, args=(fd,), name=f"reader{i}", daemon=True).start()
        self.loop.run_until_complete(done)


def serve(args: argparse.Namespace) -> None:
    tree = Tree(args.files)
    fd = open_device()
    mount_syscall(fd, args.mountpoint, "fuseclone", read_only=True, allow_other=False)
    init(fd)
    fds = [fd] + [clone(fd) for _ in range(args.threads - 1)]
    Path(args.ready).write_text(str(os.getpid()))
    if args.mode == "loop":
        LoopServer(tree, False).run_loop(fd)
    elif args.mode in ("handoff", "handoff-write"):
        LoopServer(tree, args.mode == "handoff-write").run_handoff(fds)
    elif args.mode in ("split", "locked"):
        LoopServer(tree, False, threading.Lock()).run_split(fds, args.mode == "locked")
    elif args.mode == "threads":
        threads = [threading.Thread(target=serve_blocking, args=(f, tree), name=f"reader{i}") for i, f in enumerate(fds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif args.mode == "procs":
        children = []
        for f in fds[1:]:
            pid = os.fork()
            if pid == 0:
                serve_blocking(f, tree)
                os._exit(0)
            children.append(pid)
        serve_blocking(fd, tree)
        for pid in children:
            os.waitpid(pid, 0)


# ------------------------------------------------------------------------------------- measuring
def threads_cpu(pids: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out[f"{pid}/{task.name}"] = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError):
                continue
    return out


def server_pids(pid: int) -> list[int]:
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    return pids


READER = r"""
import os, sys, time
mode, root, count, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "warm":
    names = [os.path.join(root, "f%d" % i) for i in range(files)]
    for i in range(count):
        fd = os.open(names[i % files], os.O_RDONLY)
        os.read(fd, 131072)
        os.close(fd)
elif mode == "buffered":
    fd = os.open(os.path.join(root, "big"), os.O_RDONLY)
    size = 256 << 20
    for _ in range(max(1, count // 256)):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the mount's pages of it dropped
        offset = 0
        while offset < size:
            offset += len(os.pread(fd, 1 << 20, offset))
    os.close(fd)
else:
    import mmap
    buf = mmap.mmap(-1, 1 << 20)
    fd = os.open(os.path.join(root, "big"), os.O_RDONLY | os.O_DIRECT)
    size = 256 << 20
    for i in range(count):
        os.preadv(fd, [buf], (i * (1 << 20)) % size)
    os.close(fd)
"""


def run_readers(workload: str, mountpoint: str, count: int, readers: int, files: int) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", READER, workload, mountpoint, str(count // readers), str(files)])
             for _ in range(readers)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"reader failed: {p.returncode}")
    return time.perf_counter() - start


def measure(args: argparse.Namespace, mode: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fuseclone-") as work:
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        ready = os.path.join(work, "ready")
        server = subprocess.Popen([sys.executable, "-m", "benchmarks.fuse_clone", "serve", "--mode", mode,
                                   "--threads", str(args.threads if mode != "loop" else 1), "--files",
                                   str(args.files), "--ready", ready, mnt], cwd=Path(__file__).parent.parent)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(ready):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"{mode}: the server did not start")
                time.sleep(0.05)
            pid = server.pid
            run_readers("warm", mnt, args.files, 1, args.files)  # lookups and pages cached
            result: dict[str, float] = {}
            for workload, count, unit in (("warm", args.calls, 1), ("direct", args.mib, 1 / 1024)):
                before = threads_cpu(server_pids(pid))
                wall = run_readers(workload, mnt, count, args.readers, args.files)
                after = threads_cpu(server_pids(pid))
                used = {k: after[k] - before.get(k, 0.0) for k in after}
                amount = count * unit
                result[f"{workload}_total"] = sum(used.values()) / amount
                result[f"{workload}_busiest"] = max(used.values()) / amount
                result[f"{workload}_rate"] = amount / wall
            return result
        finally:
            unmount(mnt, privileged=True)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.send_signal(signal.SIGKILL)
                server.wait()


# ---------------------------------------------------------------------------- the daemon itself
def daemon_rounds(args: argparse.Namespace) -> None:
    """cachefs itself, ``--fuse-threads 1`` against ``--threads``, two mounts of one ``file://`` tree
    side by side (read-only, long timeouts, RAM tier large enough), rounds alternating."""
    from cachefs.client import call

    work = Path(tempfile.mkdtemp(prefix="fuseclone-daemon-"))
    src = work / "src"
    src.mkdir()
    body = os.urandom(SMALL)
    for i in range(args.files):
        (src / f"f{i}").write_bytes(body)
    with open(src / "big", "wb") as fh:
        for _ in range(BIG >> 20):
            fh.write(os.urandom(1 << 20))
    variants = [1, args.threads]
    mounts: list[tuple[int, str, int]] = []
    try:
        for n in variants:
            mnt = work / f"mnt{n}"
            mnt.mkdir()
            result = subprocess.run([sys.executable, "-m", "cachefs", "mount", f"file://{src}", str(mnt), "--read-only",
                                     "--cache-dir", str(work / f"cache{n}"), "--attr-ttl", "3600", "--dir-ttl", "3600",
                                     "--ram-cache", "512MiB", "--no-passthrough", "--fuse-threads", str(n)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise SystemExit(f"mount --fuse-threads {n} failed: {result.stderr}")
            mounts.append((n, str(mnt), int(call(mnt, "/info")["pid"])))
        for _, mnt, _ in mounts:  # pages, dentries and attributes cached; the big file in the RAM tier
            run_readers("warm", mnt, args.files, 1, args.files)
            run_readers("direct", mnt, BIG >> 20, 1, args.files)
        print(f"cachefs --fuse-threads 1 vs {args.threads}, {args.readers} readers, load {os.getloadavg()[0]:.1f}")
        print(f"{'round':>5} {'threads':>7} | warm file: us total, us busiest, files/s | O_DIRECT RAM re-read: "
              "CPU-s/GiB total, busiest, GiB/s | page-cache refill from the RAM tier: the same")
        for r in range(args.rounds):
            for n, mnt, pid in mounts:
                m: dict[str, float] = {}
                for workload, count, unit in (("warm", args.calls, 1), ("direct", args.mib, 1 / 1024),
                                              ("buffered", args.mib, 1 / 1024)):
                    before = threads_cpu([pid])
                    readers = 1 if workload == "buffered" else args.readers  # (one reader drops the pages)
                    wall = run_readers(workload, mnt, count, readers, args.files)
                    after = threads_cpu([pid])
                    used = {k: after[k] - before.get(k, 0.0) for k in after}
                    amount = count * unit
                    m[f"{workload}_total"] = sum(used.values()) / amount
                    m[f"{workload}_busiest"] = max(used.values()) / amount
                    m[f"{workload}_rate"] = amount / wall
                print(f"{r:>5} {n:>7} | {m['warm_total'] * 1e6:8.1f} {m['warm_busiest'] * 1e6:8.1f} "
                      f"{m['warm_rate']:9.0f} | {m['direct_total']:6.3f} {m['direct_busiest']:6.3f} "
                      f"{m['direct_rate']:6.2f} | {m['buffered_total']:6.3f} {m['buffered_busiest']:6.3f} "
                      f"{m['buffered_rate']:6.2f}  (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for _, mnt, _ in mounts:
            subprocess.run([sys.executable, "-m", "cachefs", "unmount", mnt], capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    s = sub.add_parser("serve")
    s.add_argument("--mode", required=True)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--files", type=int, default=1000)
    s.add_argument("--ready", required=True)
    s.add_argument("mountpoint")
    parser.add_argument("--modes", default="loop,handoff,handoff-write,split,locked,threads,procs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--daemon", action="store_true", help="measure cachefs itself, --fuse-threads 1 against --threads")
    args = parser.parse_args()
    if args.cmd == "serve":
        serve(args)
        return
    if args.daemon:
        daemon_rounds(args)
        return
    print(f"load {os.getloadavg()[0]:.1f}; {args.threads} threads/processes, {args.readers} readers")
    print(f"{'round':>5} {'mode':>13} | warm file: us total, us busiest, files/s | direct: CPU-s/GiB total, busiest, GiB/s")
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            m = measure(args, mode)
            print(f"{r:>5} {mode:>13} | {m['warm_total'] * 1e6:8.1f} {m['warm_busiest'] * 1e6:8.1f} "
                  f"{m['warm_rate']:9.0f} | {m['direct_total']:6.3f} {m['direct_busiest']:6.3f} "
                  f"{m['direct_rate']:6.2f}  (load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
