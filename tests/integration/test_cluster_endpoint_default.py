"""The cluster tier's endpoint (issue 37, item 4): ``--cluster-endpoint-url`` defaults to the source's
endpoint, and a cluster tier at AWS's default endpoint that cannot be reached is refused at mount with
one line (no restart brings AWS back to a node that cannot reach it), where an in-cluster store that
is down is only a warning (tests/fuse/test_cluster_tier.py)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from cachefs.cli.main import build_parser
from cachefs.cli.mount import mount_settings
from cachefs.daemon.errors import SetupError
from cachefs.daemon.main import open_cluster_tier
from cachefs.settings import ClusterSettings, MountSettings
from tests.support.clusterkeys import write_key_file

pytestmark = [pytest.mark.timeout(60)]


def _settings(*extra: str, environ: dict[str, str] | None = None) -> MountSettings:
    args = build_parser().parse_args(["mount", "s3://src-bkt/ds", "/mnt/x", "--read-only", *extra])
    return mount_settings(args, environ or {})


def test_the_cluster_endpoint_defaults_to_the_sources(tmp_path: Path) -> None:
    key = str(write_key_file(tmp_path))  # a cluster tier needs one (issue 34)

    def cluster_endpoint(*extra: str, environ: dict[str, str] | None = None) -> str | None:
        cluster = _settings("--cluster-cache", "s3://cache", "--cluster-key-file", key, *extra, environ=environ).cluster
        assert cluster is not None
        return cluster.endpoint_url

    local = "http://127.0.0.1:8333"
    assert cluster_endpoint("--endpoint-url", local) == local
    assert cluster_endpoint(environ={"AWS_ENDPOINT_URL": local}) == local
    assert cluster_endpoint("--endpoint-url", local, "--cluster-endpoint-url", "http://127.0.0.1:9000") == (
        "http://127.0.0.1:9000")
    assert cluster_endpoint() is None  # an AWS source: AWS


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cluster_tier_at_aws_that_cannot_be_reached_is_refused(tmp_path: Path) -> None:
    # botocore's chain reads AWS_ENDPOINT_URL from the environment it is given: "AWS" is a closed
    # port on loopback here, so nothing leaves the machine.
    environ = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}", "AWS_ACCESS_KEY_ID": "k",
               "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
    settings = MountSettings(source="s3://src-bkt/ds", mountpoint=tmp_path / "m", cache_dir=tmp_path / "c",
                             cluster=ClusterSettings(url="s3://cache-bkt", endpoint_url=None, timeout_s=1.0,
                                                     key_file=write_key_file(tmp_path)))
    warnings: list[str] = []
    with pytest.raises(SetupError) as info:
        asyncio.run(open_cluster_tier(settings, environ, warnings.append))
    message = str(info.value)
    assert "\n" not in message and "default AWS S3 endpoint is unreachable" in message
    assert "--cluster-endpoint-url" in message and warnings == []
