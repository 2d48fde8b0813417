"""Raw-socket checks of --keepalive-timeout-s and --max-connections, for the gateway
(tests/router/test_connection_hygiene.py), the scheduler (tests/scheduler/test_connection_hygiene.py)
and the worker (tests/worker/test_server_connection_hygiene.py); scheduler/connection_limit.py.

Each service runs with KEEPALIVE_S and MAX_CONNECTIONS. Every read waits at most a given time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tests.router.slow_senders import HOST, read_answer

KEEPALIVE_S = 0.5
MAX_CONNECTIONS = 3
FLAGS = ("--keepalive-timeout-s", str(KEEPALIVE_S), "--max-connections", str(MAX_CONNECTIONS))
# How long past the keep-alive an idle connection may wait for its close: a loaded 2-core
# machine is slow, but without the setting the wait would be an hour.
SLACK_S = 5.0
REFUSED_WARNING = "the cap (--max-connections): new ones are answered 503"


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()


def post(path: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw


async def until_closed(reader: asyncio.StreamReader, bound_s: float) -> tuple[bool, bytes]:
    """Read until the service closes the connection (True) or `bound_s` passes (False)."""
    got = b""
    deadline = time.monotonic() + bound_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            break
        except ConnectionError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


@dataclass
class KeptAlive:
    status: int  # the long request's answer
    body: bytes
    busy_s: float  # from sending it to its answer's end
    closed: bool  # the service closed the connection once it was idle, within the bound
    idle_s: float  # from the answer's end to the close (or the bound)


async def long_request_then_idle(port: int, request: bytes) -> KeptAlive:
    """Send `request` (a Content-Length answer that takes longer than the keep-alive) on a
    kept-alive connection, read its answer, then send nothing and wait for the close."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        start = time.monotonic()
        writer.write(request)
        await writer.drain()
        status, body = await read_answer(reader, bound_s=60)
        busy_s = time.monotonic() - start
        closed, rest = await until_closed(reader, KEEPALIVE_S + SLACK_S)
        assert rest == b"", rest
        return KeptAlive(status, body, busy_s, closed, time.monotonic() - start - busy_s)
    finally:
        writer.close()


def assert_idle_closed(kept: KeptAlive) -> None:
    """In use longer than the keep-alive and answered whole; closed about the keep-alive after."""
    assert kept.busy_s > KEEPALIVE_S * 2, kept  # the long request outlasted the keep-alive
    assert kept.closed, f"an idle connection still open {kept.idle_s:.1f} s after its answer"
    assert KEEPALIVE_S * 0.5 <= kept.idle_s <= KEEPALIVE_S + SLACK_S, kept


@dataclass
class Refused:
    status: int
    headers: dict[str, str]
    body: dict
    closed: bool


async def refused(port: int, request: bytes) -> Refused:
    """What a connection beyond the cap gets for `request`, and whether it is closed after."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        await writer.drain()
        closed, raw = await until_closed(reader, 10)
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        try:
            answer = json.loads(body)
        except ValueError:
            answer = {"not JSON": body.decode(errors="replace")}
        return Refused(int(lines[0].split(" ", 2)[1]), headers, answer, closed)
    finally:
        writer.close()


def assert_refused(r: Refused) -> None:
    """A 503 in the OpenAI error shape, Retry-After: 1, Connection: close, and closed."""
    assert r.status == 503, r
    assert set(r.body) == {"error"} and set(r.body["error"]) == {"message", "type", "param", "code"}, r.body
    assert "too many connections" in r.body["error"]["message"], r.body
    assert r.headers.get("retry-after") == "1", r.headers
    assert r.headers.get("connection", "").lower() == "close", r.headers
    assert r.closed, "the refused connection stayed open"


async def served_again(port: int, bound_s: float = 10.0) -> int:
    """GET /health on new connections until one is served (the service sees a closed
    connection a moment after the client closes it): its status."""
    deadline = time.monotonic() + bound_s
    while True:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            writer.write(get("/health"))
            await writer.drain()
            status, _ = await read_answer(reader)
        finally:
            writer.close()
        if status != 503 or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.1)


async def check_cap(port: int, hold: Callable[[], Awaitable[object]], started: Callable[[], int],
                    while_full: Callable[[], Awaitable[None]] | None = None) -> list[object]:
    """MAX_CONNECTIONS connections each held by `hold()` (a long request, each on a connection
    of its own; `started()` counts those the service has begun), the next one refused, then,
    once one of them is closed, a new one served; the others' answers are returned whole.
    `while_full` runs while the cap is reached."""
    holders = [asyncio.create_task(hold()) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 30
        while started() < MAX_CONNECTIONS:
            assert time.monotonic() < deadline, f"only {started()} long requests began"
            assert not any(t.done() for t in holders), [t.result() for t in holders if t.done()]
            await asyncio.sleep(0.05)
        assert_refused(await refused(port, get("/health")))
        if while_full is not None:
            await while_full()
        holders[0].cancel()  # its connection closes
        await asyncio.gather(holders[0], return_exceptions=True)
        assert await served_again(port) == 200
        return list(await asyncio.gather(*holders[1:]))
    finally:
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)


async def stream_on_own_connection(port: int, request: bytes, began: list[int]) -> bytes:
    """Send a streaming `request` on a connection of its own; note in `began` when its answer
    starts; return the whole chunked answer (up to its last chunk)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        began.append(1)
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            chunk = await asyncio.wait_for(reader.read(65536), 30)
            assert chunk, f"the stream was cut: {raw[-300:]!r}"
            raw += chunk
        return raw
    finally:
        writer.close()


def sse_events(raw: bytes) -> list[str]:
    """The `data:` lines of a chunked SSE answer."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n", 1)[0], head
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size.split(b";", 1)[0], 16)
        if n == 0:
            break
        body, rest = body + rest[:n], rest[n + 2:]
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
