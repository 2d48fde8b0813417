"""The gateway's own WebSocket refusals come in their turn: a request sent while an answer
streams, refused because the gateway drains or because the socket's key was revoked since it
opened, is refused after that answer's `done`, not inside it. Refused at once, the error came
among the answer's chunks, and a client pairing each answer's end with its requests in order
took it for that answer's end.

A real gateway process (--workers) in front of a stand-in worker in the test's own loop, whose
answer is one chunk and then, once `go` is set, its `done`. The client sends a ping after the
request to be refused: the gateway answers pings as it reads the socket, in order, so the pong
says that the request before it was read (and, refused at once, already answered).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

from tests.router.procs import Proc, start_gateway
from tests.router.stand_ins import serve_stand_in, until

_CHUNK = json.dumps({"choices": [{"index": 0, "text": " tok"}]}, separators=(",", ":"))
_REQUEST = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8})
_KEY = "sk-socket-1"
_PONG = "pong"


class GatedWorker:
    """Its /v1/ws answers each request with one chunk, then its `done` once `go` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.requests = 0

    async def ws(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:
            self.requests += 1
            await ws.send_str(_CHUNK)
            await self.go.wait()
            await ws.send_str(json.dumps({"type": "done", "id": f"r{self.requests}"}))
        return ws


@pytest.fixture
async def worker() -> AsyncIterator[tuple[GatedWorker, str]]:
    gated = GatedWorker()
    runner, url = await serve_stand_in([("GET", "/v1/ws", gated.ws)])
    try:
        yield gated, url
    finally:
        await runner.cleanup()


@pytest.fixture
async def gateway(worker, tmp_path: Path) -> AsyncIterator[tuple[Proc, str, Path]]:
    _, url = worker
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{_KEY}\nsk-other-2\n")
    proc, gw = await asyncio.to_thread(start_gateway, "--workers", url, "--api-key-file", str(keys),
                                       "--api-key-reload-s", "0.2")
    try:
        yield proc, gw, keys
    finally:
        await asyncio.to_thread(proc.stop)


async def _connect(session: aiohttp.ClientSession, gw: str) -> aiohttp.ClientWebSocketResponse:
    # autoping off: the test sees the gateway's pong (see the module's docstring).
    return await session.ws_connect(gw + "/v1/ws", headers={"Authorization": f"Bearer {_KEY}"},
                                    autoping=False)


async def _next(ws: aiohttp.ClientWebSocketResponse) -> str | int:
    """The next message: its text, "pong", or the close code."""
    msg = await ws.receive(timeout=10)
    if msg.type == aiohttp.WSMsgType.TEXT:
        return msg.data
    if msg.type == aiohttp.WSMsgType.PONG:
        return _PONG
    assert msg.type == aiohttp.WSMsgType.CLOSE, msg
    return msg.data


async def _until_pong(ws: aiohttp.ClientWebSocketResponse) -> list[str | int]:
    """What came before the pong (the refusals sent at once)."""
    await ws.ping(b"read")
    got: list[str | int] = []
    while (msg := await _next(ws)) != _PONG:
        got.append(msg)
        assert len(got) < 200, got
    return got


def _error_code(message: str | int) -> object:
    return json.loads(message)["error"]["code"] if isinstance(message, str) else message


def _is_done(message: str | int) -> bool:
    return isinstance(message, str) and json.loads(message).get("type") == "done"


async def _draining(proc: Proc) -> None:
    """Until the gateway says it stops (its log line as it begins to send its sockets away)."""
    await until(lambda: "shutting down:" in proc.output())


async def test_a_request_sent_while_the_gateway_drains_is_refused_after_the_answer_owed(worker, gateway):
    gated, _ = worker
    proc, gw, _ = gateway
    async with aiohttp.ClientSession() as session:
        ws = await _connect(session, gw)
        await ws.send_str(_REQUEST)
        assert await _next(ws) == _CHUNK  # its answer streams
        proc.p.send_signal(signal.SIGTERM)
        await _draining(proc)
        await ws.send_str(_REQUEST)
        assert await _until_pong(ws) == [], "the refusal came inside the answer streaming"
        gated.go.set()
        rest = [await _next(ws) for _ in range(3)]
        assert _is_done(rest[0]), rest
        assert _error_code(rest[1]) == "shutting_down", rest
        assert rest[2] == 1001, rest  # sent away once the refusal is out too
        await ws.close()
    assert await asyncio.to_thread(proc.p.wait, 20) == 0
    assert gated.requests == 1  # the refused request reached no worker


async def test_a_request_sent_after_the_key_was_revoked_is_refused_after_the_answer_owed(worker, gateway):
    gated, _ = worker
    _, gw, keys = gateway
    async with aiohttp.ClientSession() as session:
        ws = await _connect(session, gw)
        await ws.send_str(_REQUEST)
        assert await _next(ws) == _CHUNK
        keys.write_text("sk-other-2\n")  # revoked mid-answer

        def revoked() -> bool:
            headers = {"Authorization": f"Bearer {_KEY}"}
            return httpx.get(gw + "/v1/models", headers=headers, timeout=10).status_code == 401

        await until(revoked)
        await ws.send_str(_REQUEST)
        assert await _until_pong(ws) == [], "the refusal came inside the answer streaming"
        gated.go.set()
        rest = [await _next(ws) for _ in range(2)]
        assert _is_done(rest[0]), rest
        assert _error_code(rest[1]) == "invalid_api_key", rest
        await ws.send_str(_REQUEST)  # nothing owed now: refused at once, the socket still open
        assert _error_code(await _next(ws)) == "invalid_api_key"
        await ws.close()
    assert gated.requests == 1


async def test_refusals_waiting_their_turn_are_bounded(worker, gateway):
    """A client that sends many requests while one answer streams does not make the gateway
    keep a refusal for each: past 64 owed (the answer and 63 refusals) the rest are refused at
    once, out of their turn, as a request past them gets a 429."""
    gated, _ = worker
    _, gw, keys = gateway
    async with aiohttp.ClientSession() as session:
        ws = await _connect(session, gw)
        await ws.send_str(_REQUEST)
        assert await _next(ws) == _CHUNK
        keys.write_text("sk-other-2\n")

        def revoked() -> bool:
            headers = {"Authorization": f"Bearer {_KEY}"}
            return httpx.get(gw + "/v1/models", headers=headers, timeout=10).status_code == 401

        await until(revoked)
        for _ in range(100):
            await ws.send_str(_REQUEST)
        at_once = await _until_pong(ws)
        assert [_error_code(m) for m in at_once] == ["invalid_api_key"] * 37, at_once
        gated.go.set()
        rest = [await _next(ws) for _ in range(64)]
        assert _is_done(rest[0]), rest[:3]
        assert [_error_code(m) for m in rest[1:]] == ["invalid_api_key"] * 63
        await ws.close()
