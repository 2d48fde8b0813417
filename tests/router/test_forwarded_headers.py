"""Which of a client's request headers reach the worker, through a gateway on 127.0.0.1 in front
of a stand-in that answers with the headers it got, on a path whose headers are passed on (the
Responses API; chat and completions send a fixed set). End-to-end headers pass; hop-by-hop
ones stop at the gateway (RFC 9110 7.6.1): the standard ones, those the client's Connection
header names, and Expect (the gateway answered it: it has the body already)."""

from __future__ import annotations

import asyncio

import httpx
from aiohttp import web

from tests.router.procs import start_gateway
from tests.router.stand_ins import serve_stand_in


async def _headers_seen(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"headers": [k.lower() for k in request.headers]})


def _post(gateway: str, headers: dict[str, str]) -> list[str]:
    r = httpx.post(gateway + "/v1/responses", json={"model": "m", "input": "x" * 2000},
                   headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["headers"]


async def test_hop_by_hop_headers_stop_at_the_gateway():
    runner, url = await serve_stand_in([("POST", "/v1/responses", _headers_seen)])
    proc, gateway = await asyncio.to_thread(start_gateway, "--workers", url)
    try:
        seen = await asyncio.to_thread(_post, gateway, {
            "Connection": "keep-alive, X-Hop-One, x-hop-two",
            "X-Hop-One": "1", "X-Hop-Two": "2", "Proxy-Connection": "keep-alive",
            "Expect": "100-continue", "OpenAI-Organization": "org-1", "X-Stays": "yes",
        })
    finally:
        proc.stop()
        await runner.cleanup()
    assert "openai-organization" in seen and "x-stays" in seen
    for hop in ("x-hop-one", "x-hop-two", "proxy-connection", "expect"):
        assert hop not in seen, (hop, seen)
