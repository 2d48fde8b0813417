"""An error nothing in the gateway expected, while it relays a worker's answer: the client gets
a 500 in the OpenAI error shape (not aiohttp's plain text) when nothing was sent yet.

The gateway runs in the test's own loop (so the fault can be injected: the known causes of
such errors are fixed), in front of an echo worker stand-in, without a scheduler (round robin
over --workers)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from router import whole_answers
from router.app import Gateway, build_app
from router.config import RouterConfig
from tests.router.procs import free_port
from tests.router.stand_ins import serve_stand_in


@pytest.fixture
async def gateway():
    echo = EchoWorker("m", 0.0, "w")
    worker, worker_url = await serve_stand_in([("POST", "/v1/completions", echo.completions)], echo)
    runner = web.AppRunner(build_app(Gateway(RouterConfig(workers=worker_url))))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await worker.cleanup()


async def test_an_unexpected_error_before_any_byte_is_an_openai_shaped_500(gateway, monkeypatch, caplog):
    def broken(_body: bytes):
        raise RuntimeError("injected")

    monkeypatch.setattr(whole_answers, "usage_of_body", broken)  # read in every non-streamed answer
    async with aiohttp.ClientSession() as s:
        async with s.post(gateway + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 500
            assert r.content_type == "application/json"
            body = await r.json()
    assert body["error"]["type"] == "internal_error" and body["error"]["code"] == "gateway_error"
    assert any("gateway error forwarding" in rec.message and rec.exc_info for rec in caplog.records)
    monkeypatch.undo()
    async with aiohttp.ClientSession() as s:  # the gateway itself is fine
        async with s.post(gateway + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 200
