"""A stream whose every event reached the client, [DONE] included, is a 200 however soon the
client closes after it. The gateway (handler_cancellation on, as `python -m router` runs it)
was cancelled when the client closed while the stream's last bytes (the chunked terminator)
were still being written, and counted the whole answer as 499 "client_disconnected": a
clean-clone CI run under load saw router_requests_total miss a 200 so. The gateway in the
test's own loop (an echo worker in its own process), the terminator's write held until the
client has closed."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from router.app import Gateway, build_app
from router.config import RouterConfig
from tests.router.procs import free_port, start_echo_worker
from tests.router.stand_ins import serve_stand_in


@pytest.fixture
async def gateway():
    worker, worker_url = start_echo_worker()  # its own process: the patch below is the gateway's
    runner = web.AppRunner(build_app(Gateway(RouterConfig(workers=worker_url))), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()
        worker.stop()


async def test_a_stream_read_to_its_done_then_closed_is_a_200(gateway, monkeypatch):
    client_closed = asyncio.Event()
    write_eof = web.StreamResponse.write_eof

    async def late_write_eof(self, data: bytes = b"") -> None:
        await client_closed.wait()  # the client has read [DONE] and gone
        await asyncio.sleep(0.1)  # its close reaches the gateway
        await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", late_write_eof)
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    seen = b""
    async with asyncio.timeout(10):
        while b"data: [DONE]" not in seen:
            seen += await reader.read(65536)
    writer.close()
    client_closed.set()
    monkeypatch.undo()
    counted = await _counted(gateway)
    assert len(counted) == 1 and 'status="200"' in counted[0], counted


async def test_a_client_gone_at_done_before_the_workers_end_is_a_200():
    """The client reads [DONE] and closes (JavaScript clients commonly abort there) while the
    worker has not yet ended its response: the gateway, waiting for that end, was cancelled and
    counted the answer as 499 though every event had reached the client."""
    worker_done = asyncio.Event()

    async def slow_to_end(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await worker_done.wait()  # the response's end comes late
        await resp.write_eof()
        return resp

    worker, worker_url = await serve_stand_in([("POST", "/v1/completions", slow_to_end)])
    runner = web.AppRunner(build_app(Gateway(RouterConfig(workers=worker_url))), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        seen = b""
        async with asyncio.timeout(10):
            while b"data: [DONE]" not in seen:
                seen += await reader.read(65536)
        writer.close()
        counted = await _counted(port)
        assert len(counted) == 1 and 'status="200"' in counted[0], counted
    finally:
        worker_done.set()
        await runner.cleanup()
        await worker.cleanup()


async def _counted(port: int) -> list[str]:
    """router_requests_total's series once the answer is counted (as its handler ends)."""
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                page = await r.text()
            counted = [line for line in page.splitlines() if line.startswith("router_requests_total{")]
            if counted:
                return counted
            await asyncio.sleep(0.05)
    return []
