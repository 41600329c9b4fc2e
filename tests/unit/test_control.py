"""The control API over a real unix socket and a real TCP port on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from cachefs.client import ControlError, _request_json, answer_value
from cachefs.daemon.control import ControlRequestError, ControlServer
from cachefs.mounts import RECORD_SUFFIX


@pytest.fixture
async def server(tmp_path: Path):
    srv = ControlServer(tmp_path / "c.sock", lambda: {"tiers": {}, "hit_ratio": 0.5}, {"pid": 42})

    async def echo(params):
        if params.get("fail"):
            raise ControlRequestError(409, "refused: " + params["fail"])
        return {"got": params}

    srv.add_json_route("POST", "/echo", echo)
    await srv.start("127.0.0.1", 0)
    try:
        yield srv
    finally:
        await srv.stop()


async def test_json_routes_over_the_unix_socket(server: ControlServer) -> None:
    sock = str(server.socket_path)
    assert (await _request_json(sock, "/stats", "GET", None, 5))["hit_ratio"] == 0.5
    # /info with the address the TCP listener bound (asked for port 0: the kernel's choice, named)
    assert (await _request_json(sock, "/info", "GET", None, 5)) == {"pid": 42,
                                                                    "stats_addr": f"127.0.0.1:{server.tcp_port}"}
    assert server.tcp_port
    record = json.loads(server.socket_path.with_suffix(RECORD_SUFFIX).read_text())
    assert record["stats_addr"] == f"127.0.0.1:{server.tcp_port}"  # (the record beside the socket too)
    assert (await _request_json(sock, "/echo?a=1", "POST", {"b": 2}, 5)) == {"got": {"a": "1", "b": 2}}
    with pytest.raises(ControlError, match="refused: no"):
        await _request_json(sock, "/echo", "POST", {"fail": "no"}, 5)
    assert server.socket_path.stat().st_mode & 0o777 == 0o600


async def test_tcp_listener_serves_only_public_routes(server: ControlServer) -> None:
    base = f"http://127.0.0.1:{server.tcp_port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/stats") as r:
            assert r.status == 200 and (await r.json())["hit_ratio"] == 0.5
        async with session.get(base + "/healthz") as r:
            assert r.status == 200
        async with session.post(base + "/echo", json={}) as r:
            assert r.status == 404  # control actions never on TCP
        async with session.get(base + "/info") as r:
            assert r.status == 404


async def test_unreachable_socket_is_a_control_error(tmp_path: Path) -> None:
    with pytest.raises(ControlError, match="cannot reach"):
        await _request_json(str(tmp_path / "none.sock"), "/stats", "GET", None, 2)
    await asyncio.sleep(0)


async def test_a_request_over_a_mebibyte_is_accepted(server: ControlServer) -> None:
    """aiohttp's default 1 MiB limit made a 12,000-file manifest fail (issue 19)."""
    entries = [{"path": f"dir/{i:08d}.bin", "etag": "e" * 34, "size": i} for i in range(20_000)]
    got = await _request_json(str(server.socket_path), "/echo", "POST", {"entries": entries}, 30)
    assert got["got"]["entries"] == entries


async def test_a_request_past_the_limit_is_a_true_one_line_error(tmp_path: Path) -> None:
    srv = ControlServer(tmp_path / "c.sock", dict, {}, max_request_bytes=1000)

    async def echo(params):
        return params

    srv.add_json_route("POST", "/echo", echo)
    await srv.start()
    try:
        body = {"x": "y" * 2000}
        sent = len(json.dumps(body))
        with pytest.raises(ControlError) as info:
            await _request_json(str(srv.socket_path), "/echo", "POST", body, 5)
        assert str(info.value) == f"request too large ({sent} bytes, limit 1000)"
    finally:
        await srv.stop()


@pytest.mark.parametrize(("status", "text", "message"), [
    (413, "Maximum request body size 1048576 exceeded, actual body size 1048577",
     "request too large (1048577 bytes): the daemon refused /jobs (Maximum request body size 1048576 exceeded, "
     "actual body size 1048577)"),
    (200, "<html>\nnot json", "the daemon answered /jobs with something that is not JSON: <html>"),
    (500, "", "the daemon answered /jobs with HTTP 500: (empty answer)"),
    (502, "x" * 500, "the daemon answered /jobs with HTTP 502: " + "x" * 200 + "..."),
    (409, '{"error": "a job is running"}', "a job is running"),
    (404, '{"other": 1}', 'the daemon answered /jobs with HTTP 404: {"other": 1}'),
])
def test_the_client_names_what_came_back(status: int, text: str, message: str) -> None:
    with pytest.raises(ControlError) as info:
        answer_value("/jobs", status, text, sent=1048577)
    assert str(info.value) == message and "cannot reach" not in message


def test_a_json_answer_is_its_value() -> None:
    assert answer_value("/stats", 200, '{"a": [1]}', sent=0) == {"a": [1]}
    assert answer_value("/stats", 200, "null", sent=0) is None


async def test_a_stats_port_in_use_is_said_in_words_not_as_a_python_tuple(tmp_path: Path) -> None:
    """Issue 37, item 9: binding --stats-addr to a busy port read "error while attempting to bind on
    address ('127.0.0.1', 9750): address already in use"."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        srv = ControlServer(tmp_path / "c.sock", lambda: {}, {"pid": 1})
        try:
            with pytest.raises(OSError) as info:
                await srv.start("127.0.0.1", port)
        finally:
            await srv.stop()
    assert info.value.strerror == "the port is in use by another process: pick another port"
    assert "(" not in str(info.value.strerror)


async def test_the_daemons_info_is_kept_beside_its_socket_while_it_serves(tmp_path: Path) -> None:
    """A daemon killed with SIGKILL cannot be asked for its cache directory: `cachefs unmount` reads
    this record instead (issue 37, item 5)."""
    srv = ControlServer(tmp_path / "c.sock", lambda: {}, {"pid": 7, "cache_dir": "/c/x", "source": "s3://b/"})
    await srv.start()
    try:
        assert json.loads((tmp_path / "c.json").read_text()) == {"pid": 7, "cache_dir": "/c/x", "source": "s3://b/"}
        assert (tmp_path / "c.json").stat().st_mode & 0o077 == 0
    finally:
        await srv.stop()
    assert not (tmp_path / "c.json").exists()
