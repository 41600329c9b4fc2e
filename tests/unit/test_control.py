"""The control API over a real unix socket and a real TCP port on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from cachefs.client import ControlError, _request_json
from cachefs.daemon.control import ControlRequestError, ControlServer


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
    assert (await _request_json(sock, "/info", "GET", None, 5)) == {"pid": 42}
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
