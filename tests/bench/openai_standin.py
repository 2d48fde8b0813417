"""A tiny OpenAI-compatible streaming server used as "any OpenAI-compatible endpoint".

It is a legitimate stand-in for a third-party server (a real vLLM cannot run
here): it streams one token per chunk with fixed delays, sends the usage chunk
when asked, and records what it received so tests can check the client's
payloads, concurrency and ordering. Our own worker is exercised separately
(tests/bench/test_serve_sim.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from aiohttp import web

MODEL = "stub"
WORD = " hello"  # one token per chunk
FIRST_TOKEN_DELAY = 0.005
TOKEN_DELAY = 0.002


@dataclass
class Seen:
    path: str
    body: dict
    arrived: float
    finished: float = 0.0
    headers: dict = field(default_factory=dict)


@dataclass
class StandIn:
    send_usage: bool = True
    requests: list[Seen] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    url: str = ""

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
        return web.json_response(body, status=status)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return self.error(400, "body is not JSON")
        seen = Seen(request.path, body, time.perf_counter(), headers=dict(request.headers))
        self.requests.append(seen)
        if body.get("model") != MODEL:
            return self.error(404, f"The model `{body.get('model')}` does not exist.", "model")
        n = body.get("max_completion_tokens") if chat else body.get("max_tokens")
        if not isinstance(n, int) or n < 1:
            return self.error(400, "max_tokens must be a positive integer", "max_tokens")
        prompt = json.dumps(body.get("messages")) if chat else str(body.get("prompt"))
        if "FAIL" in prompt:
            return self.error(400, "prompt rejected by the stand-in", "prompt")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._stream(request, body, chat, n, hang="HANG" in prompt, seen=seen)
        finally:
            self.active -= 1

    async def _stream(self, request, body, chat, n, hang, seen) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                "model": MODEL, "created": 0}

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if chat:  # role announcement before any token, as OpenAI servers do
            await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(FIRST_TOKEN_DELAY)
        for i in range(n):
            if i:
                await asyncio.sleep(TOKEN_DELAY)
            choice = {"index": 0, "delta": {"content": WORD}} if chat else {"index": 0, "text": WORD}
            choice["finish_reason"] = "length" if i == n - 1 else None
            await send({**base, "choices": [choice]})
            while hang:  # keep-alive comments until the client goes away
                await asyncio.sleep(0.05)
                await resp.write(b": ping\n\n")
        if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            await send({**base, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        seen.finished = time.perf_counter()
        return resp


async def start_standin(**kwargs) -> tuple[StandIn, web.AppRunner]:
    standin = StandIn(**kwargs)
    app = web.Application()
    app.router.add_post("/v1/completions", standin.handle)
    app.router.add_post("/v1/chat/completions", standin.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    standin.url = f"http://127.0.0.1:{port}"
    return standin, runner
