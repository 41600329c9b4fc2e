"""``make s3`` (scripts/s3.py, issue 37, item 7): a local SeaweedFS that outlives the command, on ports
chosen free (gRPC ports included), with the environment to use it printed and written to a file;
``make s3-stop`` stops it, and the next start finds the data and keys again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from tests.support.s3servers import find_weed

pytestmark = [pytest.mark.s3, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


def s3(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "s3.py"), *args], capture_output=True, text=True,
                          timeout=150)


def env_of(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        out[name] = value
    return out


def client(env: dict[str, str]):
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])


def test_make_s3_keeps_a_server_running_and_prints_its_environment(tmp_path: Path) -> None:
    find_weed()
    directory = tmp_path / "s3"
    started = s3("start", "--dir", str(directory))
    try:
        assert started.returncode == 0, started.stderr
        env = env_of(directory / "env")
        assert set(env) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"}
        for name, value in env.items():
            assert f"export {name}={value}" in started.stdout
        assert (directory / "env").stat().st_mode & 0o077 == 0
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        # The command has returned: the server outlived it.
        client(env).put_object(Bucket="scratch", Key="kept.txt", Body=b"kept")
        again = s3("start", "--dir", str(directory))
        assert again.returncode == 0 and "already running" in again.stdout
        stopped = s3("stop", "--dir", str(directory))
        assert stopped.returncode == 0 and "stopped SeaweedFS" in stopped.stdout, stopped
        restarted = s3("start", "--dir", str(directory))
        assert restarted.returncode == 0, restarted.stderr
        env = env_of(directory / "env")
        assert client(env).get_object(Bucket="scratch", Key="kept.txt")["Body"].read() == b"kept"
    finally:
        s3("stop", "--dir", str(directory))
    assert "no SeaweedFS" in s3("stop", "--dir", str(directory)).stdout


def test_the_makefile_has_s3_targets_and_the_docs_say_how() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "\ns3:" in makefile and "\ns3-stop:" in makefile and "scripts/s3.py start" in makefile
    assert "make s3" in (REPO / "docs" / "testing.md").read_text() + (REPO / "README.md").read_text()
    assert os.access(REPO / "scripts" / "s3.py", os.R_OK)
