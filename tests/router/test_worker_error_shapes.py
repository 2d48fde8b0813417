"""A worker's error answer reaches the client in the OpenAI error shape, whatever shape the
engine wrote it in (TGI's, SGLang's and older vLLM's, FastAPI's, plain text, nothing), with the
worker's status and message, streamed or not. One already in the shape is relayed byte for byte.

A stand-in worker answers each prompt with one engine's error; the gateway runs as a real
process in front of it (round robin over --workers, no scheduler)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aiohttp import web

from tests.router.procs import start_gateway
from tests.router.stand_ins import serve_stand_in

OPENAI_SHAPED = json.dumps({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                      "param": "max_tokens", "code": 400}}, indent=1).encode()
BIG = b"x" * (3 * 1024 * 1024)

# prompt -> (status, body, content type) the stand-in answers it with
ANSWERS: dict[str, tuple[int, bytes, str]] = {
    "tgi": (422, b'{"error":"Input validation error: `inputs` must have less than 4096 tokens",'
                 b'"error_type":"validation"}', "application/json"),
    "sglang": (400, b'{"object":"error","message":"The model `x` does not exist.",'
                    b'"type":"NotFoundError","param":null,"code":404}', "application/json"),
    "detail": (404, b'{"detail":"Not Found"}', "application/json"),
    "validation": (422, b'{"detail":[{"loc":["body","max_tokens"],"msg":"Input should be a valid '
                        b'integer","type":"int_parsing"}]}', "application/json"),
    "text": (403, b"Forbidden: no such adapter\n", "text/plain"),
    "empty": (401, b"", "text/plain"),
    "big": (400, BIG, "text/plain"),
    "openai": (400, OPENAI_SHAPED, "application/json"),
}

# prompt -> (message, type, code, param) the client reads
EXPECTED = {
    "tgi": ("Input validation error: `inputs` must have less than 4096 tokens", "validation", 422,
            None),
    "sglang": ("The model `x` does not exist.", "NotFoundError", 404, None),
    "detail": ("Not Found", "invalid_request_error", 404, None),
    "validation": ("max_tokens: Input should be a valid integer", "invalid_request_error", 422,
                   "max_tokens"),
    "text": ("Forbidden: no such adapter", "permission_error", 403, None),
    "empty": ("the worker answered 401 Unauthorized", "authentication_error", 401, None),
}


async def _answer(request: web.Request) -> web.Response:
    status, body, ctype = ANSWERS[(await request.json())["prompt"]]
    return web.Response(status=status, body=body, headers={"Content-Type": ctype})


@pytest.fixture
async def gateway():
    worker, url = await serve_stand_in([("POST", "/v1/completions", _answer)])
    g, gu = await asyncio.to_thread(start_gateway, "--workers", url)
    try:
        yield gu
    finally:
        g.stop()
        await worker.cleanup()


async def _post(client: httpx.AsyncClient, gw: str, prompt: str, stream: bool) -> httpx.Response:
    return await client.post(gw + "/v1/completions",
                             json={"model": "m", "prompt": prompt, "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
async def test_worker_errors_reach_the_client_in_the_openai_shape(gateway, stream):
    async with httpx.AsyncClient(timeout=30) as client:
        for prompt, (message, type_, code, param) in EXPECTED.items():
            r = await _post(client, gateway, prompt, stream)
            assert r.status_code == ANSWERS[prompt][0], prompt
            assert r.headers["content-type"].startswith("application/json"), prompt
            assert r.json() == {"error": {"message": message, "type": type_, "param": param,
                                          "code": code}}, prompt


@pytest.mark.parametrize("stream", [False, True])
async def test_an_openai_shaped_error_passes_unchanged_and_a_big_one_is_bounded(gateway, stream):
    async with httpx.AsyncClient(timeout=30) as client:
        r = await _post(client, gateway, "openai", stream)
        assert r.status_code == 400 and r.content == OPENAI_SHAPED
        r = await _post(client, gateway, "big", stream)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["message"].startswith("xxx") and len(r.content) < 64 * 1024
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        # The connection a half-read body left is not reused: the next request is served.
        r = await _post(client, gateway, "openai", stream)
        assert r.status_code == 400 and r.content == OPENAI_SHAPED
