"""Raw GET engines side by side: what this machine's S3 clients fetch from one server, and at what CPU cost.

A limit is only a limit if nothing beats it. So the cold-read limit of the benchmark is not one
client's rate but the fastest of several engines, each given the same work (the same objects, the
same part size, the same number of requests in flight) on the same server in the same run:

  engine    what it is                                            how it runs here
  daemon    cachefs's own store path, ``S3ObjectStore.get_range``, whatever it is built on (now: libcurl
            for ranges under 1 MiB, ``http.client`` threads for larger ones; at
            a115150: presigned URLs on aiohttp, one asyncio loop), without FUSE or the tiers
  aiohttp   aiohttp alone: GETs on presigned URLs (botocore's presigner, inside the span), a 4 MiB
            read buffer, ``threads`` in flight on one asyncio loop
  boto3     boto3/botocore (urllib3) ``get_object`` with a ``Range``, in ``threads`` Python threads,
            each part received with ``readinto`` into the thread's own preallocated buffer
  obstore   obstore (Rust object_store; releases the GIL) ``get_range`` in ``threads`` threads
  awscrt    the AWS Common Runtime S3 client (C; splits an object into ``part_size`` ranged GETs
            itself, ``threads`` event-loop threads); the body handed to a Python callback

A big object is fetched as ``part_size`` ranged GETs (``threads`` in flight); objects no larger than
``part_size`` are fetched whole, one GET each (the small-file limit). Bytes are received and thrown
away. Each engine reports bytes, wall seconds, the CPU seconds of the process over the span
(``time.process_time``: every thread, native ones included) and the CPU of its busiest thread.

The benchmark runs each engine in its own child process (``measure_jobs``: one per engine and
round, for all of the round's objects): a clean CPU account, no threads or event loops left over
from another engine, and an engine that crashes or hangs costs one row, not the run. ``fetch`` is the in-process call for anyone who wants a figure from Python
(``get_object_timed`` for one object). Credentials travel in the environment, never in argv.

  .venv/bin/python -m benchmarks.engines --engine boto3 --endpoint URL --bucket B --key K [--threads 8]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import procstat  # noqa: E402

MiB = 1024 * 1024
GiB = 1024 * MiB
# The defaults the issue compares at (cachefs's block size; 8 threads fill two cores and a
# loopback server without queueing on the GIL more than they fetch).
DEFAULT_THREADS = 8
DEFAULT_PART_SIZE = 8 * MiB
ENGINES = ("daemon", "aiohttp", "boto3", "obstore", "awscrt")
# A child engine run that takes longer than this is stuck, not slow (1 GiB at 10 MiB/s is 100 s).
CHILD_TIMEOUT_S = 300.0
# The awscrt client aims its parallelism at this many Gbit/s; with part_size it sets how many parts
# it keeps in flight. 10 is the CRT's own example for a big instance; here threads and the
# loopback server are the bound anyway.
CRT_TARGET_GBPS = 10.0
# aiohttp's read buffer: the daemon's (64 KiB, the default, pauses the socket every 128 KiB).
AIOHTTP_READ_BUFFER = 4 * 1024 * 1024
# The presigned URLs of the aiohttp engine are used at once; a few minutes covers any run.
PRESIGN_EXPIRES_S = 600
ENV_ACCESS_KEY = "BENCH_ENGINE_ACCESS_KEY"
ENV_SECRET_KEY = "BENCH_ENGINE_SECRET_KEY"


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def __repr__(self) -> str:  # never print a secret, not even in a traceback
        return f"Credentials(access_key=<{len(self.access_key)} chars>, region={self.region!r})"


@dataclass(frozen=True)
class EngineRun:
    """One engine over one set of objects: what it fetched, how long it took and what it cost."""

    engine: str
    bytes: int
    seconds: float
    cpu_s: float
    busiest_thread_s: float
    requests: int
    threads: int
    part_size: int

    @property
    def mib_s(self) -> float:
        return self.bytes / self.seconds / MiB if self.seconds > 0 else 0.0

    @property
    def requests_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_s_per_gib(self) -> float:
        return self.cpu_s / (self.bytes / GiB) if self.bytes else 0.0

    @property
    def busiest_thread_s_per_gib(self) -> float:
        return self.busiest_thread_s / (self.bytes / GiB) if self.bytes else 0.0

    def to_json(self) -> dict[str, float | int | str]:
        return {**dataclasses.asdict(self), "mib_s": self.mib_s, "requests_s": self.requests_s,
                "cpu_s_per_gib": self.cpu_s_per_gib, "busiest_thread_s_per_gib": self.busiest_thread_s_per_gib}


class EngineUnavailable(RuntimeError):
    """The engine's library is not installed here."""


def unavailable_reason(engine: str) -> str | None:
    """None when ``engine`` can run here, else why not."""
    module = {"daemon": "tiering.objectstore.s3", "aiohttp": "aiohttp", "boto3": "boto3", "obstore": "obstore", "awscrt": "awscrt.s3"}.get(engine)
    if module is None:
        return f"unknown engine {engine!r} (known: {', '.join(ENGINES)})"
    try:
        __import__(module)
    except ImportError as exc:
        return f"{module} is not installed ({exc.name})"
    return None


def plan(sizes: Sequence[tuple[str, int]], part_size: int) -> list[tuple[str, int, int]]:
    """The requests for ``sizes`` (key, size): ``part_size`` ranges, [start, end), in key order."""
    return [(key, start, min(start + part_size, size)) for key, size in sizes for start in range(0, max(size, 1), part_size)]


# -- the engines: each takes the plan and returns the bytes received ----------------------------------


class _Clock:
    """Started by an engine once its client is built (set-up is not timed), read by ``fetch``."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.threads: dict[tuple[int, int], float] = {}

    def start(self) -> None:
        self.threads = procstat.thread_cpu(os.getpid())
        self.wall, self.cpu = time.perf_counter(), time.process_time()


def _threaded(clock: _Clock, parts: list[tuple[str, int, int]], threads: int,
              make: Callable[[], Callable[[str, int, int], int]]) -> tuple[int, dict[tuple[int, int], float]]:
    """Run ``parts`` over ``threads`` threads, each with its own fetcher from ``make``; also the thread CPU."""
    local = threading.local()

    def one(part: tuple[str, int, int]) -> int:
        if part[1] == part[2]:
            return 0  # an empty object: nothing to request
        fetch = getattr(local, "fetch", None)
        if fetch is None:
            fetch = local.fetch = make()
        return fetch(*part)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        # Every thread exists before the clock starts: each of these waits until all have started.
        barrier = threading.Barrier(threads)
        list(pool.map(lambda _: barrier.wait(), range(threads)))
        clock.start()
        total = sum(pool.map(one, parts))
        snapshot = procstat.thread_cpu(os.getpid())  # before the pool's threads exit
    return total, snapshot


def _boto3(clock: _Clock, endpoint: str, bucket: str, creds: Credentials, parts: list[tuple[str, int, int]],
        threads: int, part_size: int) -> tuple[int, dict[tuple[int, int], float]]:
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key,
        region_name=creds.region, config=Config(max_pool_connections=threads * 2, s3={"addressing_style": "path"},
                                                retries={"max_attempts": 3}))

    def make() -> Callable[[str, int, int], int]:
        view = memoryview(bytearray(part_size))

        def fetch(key: str, start: int, end: int) -> int:
            body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
            n = 0
            while got := body.readinto(view[n:] if n < len(view) else view):
                n += got
            return n
        return fetch

    try:
        return _threaded(clock, parts, threads, make)
    finally:
        client.close()


def _obstore(clock: _Clock, endpoint: str, bucket: str, creds: Credentials, parts: list[tuple[str, int, int]],
        threads: int, part_size: int) -> tuple[int, dict[tuple[int, int], float]]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint, access_key_id=creds.access_key, secret_access_key=creds.secret_key,
                    region=creds.region, virtual_hosted_style_request=False,
                    client_options={"allow_http": True, "pool_max_idle_per_host": str(threads * 2)})

    def make() -> Callable[[str, int, int], int]:
        def fetch(key: str, start: int, end: int) -> int:
            return len(obstore.get_range(store, key, start=start, end=end))
        return fetch

    return _threaded(clock, parts, threads, make)


def _awscrt(clock: _Clock, endpoint: str, bucket: str, creds: Credentials, parts: list[tuple[str, int, int]],
        threads: int, part_size: int) -> tuple[int, dict[tuple[int, int], float]]:
    from awscrt import auth, http, io, s3

    # The CRT splits objects itself: one meta request per object, at most ``threads`` objects at once.
    objects: dict[str, int] = {}
    for key, _start, end in parts:
        objects[key] = max(objects.get(key, 0), end)
    elg = io.EventLoopGroup(threads)
    bootstrap = io.ClientBootstrap(elg, io.DefaultHostResolver(elg))
    client = s3.S3Client(bootstrap=bootstrap, region=creds.region, part_size=part_size,
                         credential_provider=auth.AwsCredentialsProvider.new_static(creds.access_key, creds.secret_key),
                         throughput_target_gbps=CRT_TARGET_GBPS, tls_mode=s3.S3RequestTlsMode.DISABLED)
    host = endpoint.split("://", 1)[1].rstrip("/")
    received = [0]
    lock = threading.Lock()

    def on_body(chunk: bytes, offset: int, **_: object) -> None:
        with lock:
            received[0] += len(chunk)

    slots = threading.Semaphore(threads)
    pending = []
    clock.start()
    for key in objects:
        slots.acquire()
        request = http.HttpRequest("GET", f"/{bucket}/{key}", http.HttpHeaders([("Host", host)]))
        meta = client.make_request(type=s3.S3RequestType.GET_OBJECT, request=request, on_body=on_body,
                                   on_done=lambda **_: slots.release())
        pending.append(meta)
    for meta in pending:
        meta.finished_future.result(CHILD_TIMEOUT_S)
    snapshot = procstat.thread_cpu(os.getpid())
    return received[0], snapshot


def _daemon(clock: _Clock, endpoint: str, bucket: str, creds: Credentials, parts: list[tuple[str, int, int]],
            threads: int, part_size: int) -> tuple[int, dict[tuple[int, int], float]]:
    from tiering.objectstore.s3 import S3ObjectStore

    environ = {"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key,
               "AWS_DEFAULT_REGION": creds.region, "AWS_REGION": creds.region}

    async def go() -> int:
        store = S3ObjectStore(bucket, "", endpoint_url=endpoint, connect_timeout_s=5, read_timeout_s=60,
                              max_pool_connections=threads * 2, environ=environ)
        try:
            etags = {key: (await store.head(key)).etag for key in {p[0] for p in parts}}
            slots = asyncio.Semaphore(threads)
            clock.start()

            async def one(key: str, start: int, end: int) -> int:
                async with slots:
                    return len(await store.get_range(key, etags[key], start, end))
            return sum(await asyncio.gather(*(one(*p) for p in parts)))
        finally:
            await store.close()

    total = asyncio.run(go())
    return total, procstat.thread_cpu(os.getpid())


def _aiohttp(clock: _Clock, endpoint: str, bucket: str, creds: Credentials, parts: list[tuple[str, int, int]],
             threads: int, part_size: int) -> tuple[int, dict[tuple[int, int], float]]:
    import aiohttp
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key,
        region_name=creds.region, config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"))

    async def go() -> int:
        connector = aiohttp.TCPConnector(limit=threads * 2)
        async with aiohttp.ClientSession(connector=connector, read_bufsize=AIOHTTP_READ_BUFFER) as session:
            slots = asyncio.Semaphore(threads)
            clock.start()

            async def one(key: str, start: int, end: int) -> int:
                if start == end:
                    return 0
                async with slots:
                    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                        ExpiresIn=PRESIGN_EXPIRES_S)
                    async with session.get(url, headers={"Range": f"bytes={start}-{end - 1}"}) as response:
                        if response.status not in (200, 206):
                            raise RuntimeError(f"GET {key} [{start}, {end}): HTTP {response.status}")
                        n = 0
                        async for chunk in response.content.iter_chunked(AIOHTTP_READ_BUFFER):
                            n += len(chunk)
                        return n
            return sum(await asyncio.gather(*(one(*p) for p in parts)))

    try:
        total = asyncio.run(go())
    finally:
        client.close()
    return total, procstat.thread_cpu(os.getpid())


_RUNNERS = {"daemon": _daemon, "aiohttp": _aiohttp, "boto3": _boto3, "obstore": _obstore, "awscrt": _awscrt}


def fetch(engine: str, endpoint: str, bucket: str, sizes: Sequence[tuple[str, int]], credentials: Credentials,
          threads: int = DEFAULT_THREADS, part_size: int = DEFAULT_PART_SIZE) -> EngineRun:
    """Fetch every object of ``sizes`` ((key, size) pairs) with ``engine`` in this process, timed.

    ``EngineUnavailable`` if its library is missing; a short read is a ``RuntimeError``. (The daemon
    engine HEADs each object for its ETag before the span: its ``get_range`` needs it, and the daemon
    has it from the listing.) Building the client is not timed either.
    """
    reason = unavailable_reason(engine)
    if reason:
        raise EngineUnavailable(reason)
    if threads < 1 or part_size < 1:
        raise ValueError(f"threads ({threads}) and part_size ({part_size}) must be >= 1")
    parts = plan(sizes, part_size)
    expected = sum(size for _key, size in sizes)
    clock = _Clock()
    total, threads_after = _RUNNERS[engine](clock, endpoint, bucket, credentials, parts, threads, part_size)
    seconds, cpu = time.perf_counter() - clock.wall, time.process_time() - clock.cpu
    if total != expected:
        raise RuntimeError(f"{engine}: received {total} bytes, expected {expected}")
    return EngineRun(engine, total, seconds, cpu, procstat.busiest_thread_s(clock.threads, threads_after),
                     len(parts), threads, part_size)


def object_size(endpoint: str, bucket: str, key: str, credentials: Credentials) -> int:
    """The size of ``key`` (one HEAD through boto3)."""
    import boto3

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=credentials.access_key,
        aws_secret_access_key=credentials.secret_key, region_name=credentials.region)
    try:
        return int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
    finally:
        client.close()


def get_object_timed(endpoint: str, bucket: str, key: str, credentials: Credentials, threads: int = DEFAULT_THREADS,
                     part_size: int = DEFAULT_PART_SIZE, *, engine: str = "boto3",
                     size: int | None = None) -> EngineRun:
    """One object with ``engine`` in this process: ``.bytes``, ``.seconds``, ``.cpu_s`` (and the rest of
    an ``EngineRun``). ``size`` saves the HEAD that finds it (the HEAD is not timed)."""
    if size is None:
        size = object_size(endpoint, bucket, key, credentials)
    return fetch(engine, endpoint, bucket, [(key, size)], credentials, threads, part_size)


# -- one engine in a child process (what the benchmark calls) -----------------------------------------


@dataclass(frozen=True)
class Job:
    """One set of objects for an engine to fetch: where, what, with which credentials and settings."""

    endpoint: str
    bucket: str
    sizes: Sequence[tuple[str, int]]
    credentials: Credentials
    threads: int = DEFAULT_THREADS
    part_size: int = DEFAULT_PART_SIZE


def measure(engine: str, endpoint: str, bucket: str, sizes: Sequence[tuple[str, int]], credentials: Credentials,
            threads: int = DEFAULT_THREADS, part_size: int = DEFAULT_PART_SIZE,
            timeout_s: float = CHILD_TIMEOUT_S) -> EngineRun:
    """``fetch`` in a fresh child process (see the module docstring); RuntimeError naming what failed."""
    (run,) = measure_jobs(engine, [Job(endpoint, bucket, sizes, credentials, threads, part_size)], timeout_s)
    if isinstance(run, str):
        raise RuntimeError(run)
    return run


def measure_jobs(engine: str, jobs: Sequence[Job], timeout_s: float = CHILD_TIMEOUT_S) -> list[EngineRun | str]:
    """Each job fetched by ``engine``, one after the other, in one fresh child process.

    One child for several jobs pays the interpreter's start once (a second or so on a busy small
    machine); each job keeps its own clock and CPU account. A job that fails is its error text in
    the list; ``EngineUnavailable`` or ``RuntimeError`` when the child itself cannot run.
    """
    reason = unavailable_reason(engine)
    if reason:
        raise EngineUnavailable(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    request = []
    for n, job in enumerate(jobs):
        env.update({f"{ENV_ACCESS_KEY}_{n}": job.credentials.access_key, f"{ENV_SECRET_KEY}_{n}": job.credentials.secret_key})
        request.append({"endpoint": job.endpoint, "bucket": job.bucket, "sizes": list(job.sizes),
                        "region": job.credentials.region, "threads": job.threads, "part_size": job.part_size})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        result = subprocess.run([sys.executable, "-m", "benchmarks.engines", "--child"],
                                input=json.dumps({"engine": engine, "jobs": request}), env=env,
                                cwd=root, capture_output=True, text=True, timeout=timeout_s * max(len(jobs), 1))
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{engine}: no answer within {timeout_s * max(len(jobs), 1):g} s") from exc
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{engine}: child exited {result.returncode}: {tail}")
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    return [EngineRun(**{f.name: a[f.name] for f in dataclasses.fields(EngineRun)}) if "error" not in a
            else f"{engine}: {a['error']}" for a in answers]


def _child() -> int:
    request = json.loads(sys.stdin.read())
    answers = []
    for n, job in enumerate(request["jobs"]):
        creds = Credentials(os.environ[f"{ENV_ACCESS_KEY}_{n}"], os.environ[f"{ENV_SECRET_KEY}_{n}"], job["region"])
        try:
            run = fetch(request["engine"], job["endpoint"], job["bucket"], [tuple(s) for s in job["sizes"]],
                        creds, job["threads"], job["part_size"])
            answers.append(run.to_json())
        except Exception as exc:  # one job's failure is its answer; the other jobs still run
            answers.append({"error": f"{type(exc).__name__}: {exc}"})
    print(json.dumps(answers), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, action="append", help="repeat for several (default: all)")
    parser.add_argument("--endpoint")
    parser.add_argument("--bucket")
    parser.add_argument("--key")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--part-size-mib", type=int, default=DEFAULT_PART_SIZE // MiB)
    args = parser.parse_args(argv)
    if args.child:
        return _child()
    if not (args.endpoint and args.bucket and args.key):
        parser.error("--endpoint, --bucket and --key are needed (credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    try:
        creds = Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"],
                            os.environ.get("AWS_REGION", "us-east-1"))
    except KeyError as exc:
        parser.error(f"{exc.args[0]} is not set")
    size = object_size(args.endpoint, args.bucket, args.key, creds)
    for engine in args.engine or ENGINES:
        try:
            run = measure(engine, args.endpoint, args.bucket, [(args.key, size)], creds, args.threads,
                          args.part_size_mib * MiB)
        except (EngineUnavailable, RuntimeError) as exc:
            print(f"{engine:8} unavailable: {exc}")
            continue
        print(f"{engine:8} {run.mib_s:9.1f} MiB/s  {run.cpu_s_per_gib:5.2f} CPU-s/GiB  "
              f"busiest thread {run.busiest_thread_s_per_gib:5.2f} CPU-s/GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
