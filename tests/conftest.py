"""Fixtures shared by every test suite.

S3 servers (see ``tests/support/s3servers.py``) are started once per session, lazily: a run that
selects no S3 test starts none. Each test gets its own bucket with a unique name, so tests never see
each other's objects; buckets are not deleted, the server and its data directory go at session end.

- ``seaweed``: SeaweedFS on 127.0.0.1, signatures enforced. The reference server for integration
  tests.
- ``moto``: moto's server in a subprocess. Fast functional emulator, no signature checks.
- ``seaweed_bucket`` / ``moto_bucket``: a fresh empty bucket on that server, by name.
- ``aws_env``: put a server's credentials into ``os.environ`` for the test (monkeypatch), for code
  that reads the process environment. Stores created by tests prefer ``environ=server.env()``.

Fixtures for FUSE mounts live in ``tests/fuse/conftest.py``.
"""

from __future__ import annotations

import asyncio
import io
import os
import uuid
from typing import AsyncIterator, Callable, Iterator

# Before any test module imports grpc (it reads this once): the tests fork children as other users
# (subprocess.run(user=...): fork(), not vfork()) with channels open, and gRPC's fork handlers kill
# some of them before their exec, as they did the node plugin's daemons (see csi_driver/server.py).
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"

import pytest  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

from tests.support.s3servers import MotoS3, SeaweedS3, S3Server  # noqa: E402

# No per-example deadline: it is a timing assertion, and on a loaded 2-core CI runner (or with the
# suite running on two workers) a pure function can take 250 ms once and 130 ms the next time.
hypothesis_settings.register_profile("cachefs", deadline=None)
hypothesis_settings.load_profile("cachefs")


# The longest test files (about 0.5-2 minutes each on a 2-core runner), run first. `make test` hands
# whole files to two xdist workers in collection order (--dist loadfile with --no-loadscope-reorder:
# by default xdist sorts files by their number of tests, which put test_writeback_crash.py, 3 tests and
# 110 s, near the end), so a long file collected last keeps one worker busy for minutes after the
# other has finished; started first, the short files fill in around them. Only the order changes:
# every selected test still runs. By the file's total in a full run (`--durations=0`), longest first.
LONG_FILES_FIRST = (
    "tests/fuse/test_writeback_crash.py",
    "tests/bench/test_bench_smoke.py",
    "tests/fuse/test_cluster_tier.py",
    "tests/fuse/test_writeback_faults.py",
    "tests/integration/test_make_s3.py",
    "tests/fuse/test_durable_writeback.py",
    "tests/fuse/test_writeback_fio.py",
    "tests/bench/test_bench_cluster_smoke.py",
    "tests/fuse/test_frozen_store.py",
    "tests/csi/test_operator.py",
    "tests/csi/test_mount_pods.py",
    "tests/fuse/test_writeback.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONG_FILES_FIRST.index(path) if path in LONG_FILES_FIRST else len(LONG_FILES_FIRST)

    items.sort(key=rank)  # stable: the order within each file, and of all other files, is kept
    for item in items:  # every coroutine test: no task may outlive it unbounded (see the fixture)
        if item.get_closest_marker("asyncio") is not None and hasattr(item, "fixturenames"):
            item.fixturenames.insert(0, "_no_task_outlives_its_test")


# A coroutine test's tasks left running at its end are cancelled and get this long to finish.
LEFTOVER_TASK_WAIT_S = 10.0


@pytest.fixture
async def _no_task_outlives_its_test() -> AsyncIterator[None]:
    """Torn down last of a coroutine test's fixtures (before its event loop): the tasks still running
    are cancelled, as the loop's own teardown would, but with a bound. One that ignores its
    cancellation fails the test with its stack instead of holding the worker for ever (pytest-asyncio
    waits for every task without a deadline, and pytest-timeout's alarm is swallowed by the task it
    interrupts: seen once, a worker held 45 minutes after test_fs_writes' last test)."""
    yield
    current = asyncio.current_task()
    left = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    if not left:
        return
    for task in left:
        task.cancel()
    _, stuck = await asyncio.wait(left, timeout=LEFTOVER_TASK_WAIT_S)
    if not stuck:
        return
    stacks = io.StringIO()
    for task in stuck:
        task.print_stack(file=stacks)
        asyncio.tasks._unregister_task(task)  # the loop's teardown would otherwise wait for it for ever
    pytest.fail(f"{len(stuck)} task(s) ignored their cancellation for {LEFTOVER_TASK_WAIT_S:g} s after the "
                f"test:\n{stacks.getvalue()}", pytrace=False)


def unique_bucket_name(tag: str = "t") -> str:
    """A valid, unique S3 bucket name (lowercase, 3-63 chars)."""
    return f"{tag}-{uuid.uuid4().hex[:16]}"


# -- S3 servers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        yield server


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoS3]:
    with MotoS3() as server:
        yield server


@pytest.fixture
def seaweed_bucket(seaweed: SeaweedS3) -> str:
    name = unique_bucket_name("sw")
    seaweed.make_bucket(name)
    return name


@pytest.fixture
def moto_bucket(moto: MotoS3) -> str:
    name = unique_bucket_name("mt")
    moto.make_bucket(name)
    return name


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[S3Server], dict[str, str]]:
    """``aws_env(server)`` sets the server's AWS_* variables in ``os.environ`` for this test only."""

    def apply(server: S3Server) -> dict[str, str]:
        env = server.env()
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return env

    return apply


@pytest.fixture(autouse=True)
def _process_umask_restored() -> Iterator[None]:
    """`cachefs mount` sets umask 077 for its whole process (tiering.private): a test that runs the CLI
    in-process must not leave it on the test worker, where later tests' directories would come out
    0700 (tests/csi/test_node_owner.py's pods directory did, failing as EACCES for uid 65534)."""
    import os

    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)
