"""The test S3 servers start on new ports when another process takes one of theirs between
``free_ports`` choosing it and the server binding it (with three xdist workers starting servers at
once, CI lost that race once: SeaweedFS's volume server, "bind: address already in use")."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest

from tests.support import s3servers
from tests.support.s3servers import HOST, MotoS3, S3ServerError, SeaweedS3

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    """A port another process holds, listening."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    s.listen()
    try:
        yield s
    finally:
        s.close()


def first_choice_taken(monkeypatch: pytest.MonkeyPatch, port: int) -> list[list[int]]:
    """``free_ports`` hands out ``port`` in its first answer (as a race lost would), then real ones."""
    real = s3servers.free_ports
    answers: list[list[int]] = []

    def free_ports(count: int) -> list[int]:
        ports = real(count)
        if not answers:
            ports[-1 if count > 2 else 0] = port  # moto: its one port; SeaweedFS: the S3 gRPC port
        answers.append(ports)
        return ports

    monkeypatch.setattr(s3servers, "free_ports", free_ports)
    return answers


@pytest.mark.parametrize("server_class", [MotoS3, SeaweedS3], ids=["moto", "seaweed"])
def test_a_port_taken_before_the_server_binds_it_is_chosen_again(
        server_class: type[MotoS3] | type[SeaweedS3], taken: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    port = taken.getsockname()[1]
    answers = first_choice_taken(monkeypatch, port)
    with server_class() as server:
        assert len(answers) == 2 and port in answers[0] and port not in answers[1]
        bucket = "ports-chosen-again"
        server.client().create_bucket(Bucket=bucket)
        server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
        assert server.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"


def test_a_restart_keeps_its_ports_and_says_why_it_failed(taken: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart serves the data on the ports it had: no second choice there, the failure named."""
    server = MotoS3()
    try:
        server.start()
        server.stop_keep_data()
        server.s3_port = taken.getsockname()[1]  # as if another process took its port meanwhile
        with pytest.raises(S3ServerError, match="exited with status"):
            server.start()
        assert server.s3_port == taken.getsockname()[1]
    finally:
        server.stop()


def test_a_refusing_port_refuses_is_given_to_nobody_and_can_be_taken_over() -> None:
    """``refusing_port``: "nobody answers there" holds while it is held, no other bind gets the port,
    and a server binding it by number with ``SO_REUSEADDR`` listens there (the API double, kopf)."""
    with s3servers.refusing_port() as port:
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect((HOST, port))
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind((HOST, port))
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((HOST, port))
            server.listen()
            with socket.create_connection((HOST, port), timeout=5):
                pass
