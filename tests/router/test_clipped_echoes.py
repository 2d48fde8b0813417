"""The gateway's error messages quote a client's string cut short (scheduler/clip.py): a 100 KB
model name made a 404 of over 200 KB (the name twice: the gateway's words, then the
scheduler's quoted), and its access log line is bounded too. Same status, type and code as a
short value gets; only the message is shorter.

In the test's loop: a scheduler (its decision API, workers that serve "m") and a gateway in
front of it, its access log read from a buffer; the fallback gateway (no scheduler) too."""

from __future__ import annotations

import io
import logging
import re

import aiohttp
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from router.app import Gateway, build_app
from router.config import RouterConfig
from router.http_errors import OpenAIErrorAppRunner
from scheduler.app import build_app as build_scheduler_app
from scheduler.clip import MAX_SHOWN_CHARS
from tests.router.procs import free_port
from tests.router.stand_ins import serve_stand_in
from tests.scheduler.helpers import make_service, parser_refusals

HUGE = "a" * 100_000
# What aiohttp takes of a request line or a header value (8190 bytes): a path or a header
# this long gets to the routes.
LONG = "b" * 8000
# An error message with one or two clipped values in it, and the words around them.
BOUND = 3 * MAX_SHOWN_CHARS + 400
LOG_BOUND = 2000


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def gateway():
    """(gateway URL, its access log buffer), the gateway in front of an in-process scheduler."""
    scheduler, scheduler_url = await _serve(build_scheduler_app(make_service(n=1)))
    gw = Gateway(RouterConfig(scheduler=scheduler_url, cors_allowed_origins="https://app.example"))
    runner, url = await _serve(build_app(gw))
    assert gw.proxy.access_log is not None
    gw.proxy.access_log.stream = io.StringIO()
    try:
        yield url, gw
    finally:
        await runner.cleanup()
        await scheduler.cleanup()


async def _error(response: aiohttp.ClientResponse) -> dict:
    assert response.content_type == "application/json"
    return (await response.json())["error"]


def _clipped(error: dict) -> None:
    assert len(error["message"]) < BOUND, len(error["message"])
    assert re.search(r"…'? \(\d+ chars\)", error["message"]), error["message"][:300]
    assert error["param"] is None or len(error["param"]) < BOUND


def _log_bounded(gw: Gateway, logged: bool = True) -> str:
    """The access log's lines so far, each bounded (`logged`: there is one; /v1/models and the
    catch-all 404 write none)."""
    gw.proxy.access_log.flush()
    text = gw.proxy.access_log.stream.getvalue()
    assert bool(text) == logged, text[:300]
    assert all(len(line) < LOG_BOUND for line in text.splitlines())
    return text


async def test_a_huge_model_name_is_a_404_whose_message_and_log_line_are_bounded(gateway):
    url, gw = gateway
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"model": "nope", "messages": []}) as r:
            assert r.status == 404
            short = await _error(r)
        async with s.post(url + "/v1/chat/completions", json={"model": HUGE, "messages": []}) as r:
            assert r.status == 404
            error = await _error(r)
    assert short["message"] == "model 'nope' is not served here (no worker serves model 'nope')"
    assert (error["type"], error["code"], error["param"]) == (short["type"], short["code"], "model")
    _clipped(error)
    assert error["message"].startswith(f"model '{'a' * MAX_SHOWN_CHARS}…' (100000 chars) is not served")
    assert "model=" in _log_bounded(gw)


@pytest.mark.parametrize(("path", "code"), [("/v1/models/" + LONG, "model_not_found"),
                                          ("/" + LONG, "not_found")])
async def test_a_long_path_is_quoted_cut_in_a_404(gateway, path, code):
    url, gw = gateway
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        assert r.status == 404
        error = await _error(r)
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    _clipped(error)
    _log_bounded(gw, logged=False)


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_an_unknown_response_id_is_a_404_quoting_it_cut(gateway, method):
    """GET /v1/responses/{id} and a POST there (its cancel's path without /cancel): vLLM's
    not-found words, the id cut."""
    url, gw = gateway
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + "/v1/responses/resp_nobody") as r:
            short = await _error(r)
        async with s.request(method, url + "/v1/responses/" + LONG) as r:
            assert r.status == 404
            error = await _error(r)
    assert short["message"] == "Response with id 'resp_nobody' not found."
    assert {**error, "message": ""} == {**short, "message": ""}
    _clipped(error)
    assert error["message"].endswith(f"{'b' * MAX_SHOWN_CHARS}… (8000 chars)' not found.")
    _log_bounded(gw)


async def test_an_unknown_previous_response_id_is_a_404_quoting_it_cut(gateway):
    url, gw = gateway
    body = {"model": "m", "input": "hi", "previous_response_id": HUGE}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/responses", json=body) as r:
        assert r.status == 404
        error = await _error(r)
    assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
    _clipped(error)
    assert error["message"].startswith(f"Response with id '{'a' * MAX_SHOWN_CHARS}… (100000 chars)'")
    _log_bounded(gw)


async def test_a_long_origin_refused_is_quoted_cut(gateway):
    url, _ = gateway
    headers = {"Origin": "https://" + LONG, "Access-Control-Request-Method": "POST"}
    async with aiohttp.ClientSession() as s, s.options(url + "/v1/chat/completions", headers=headers) as r:
        assert r.status == 403
        error = await _error(r)
    assert error["code"] == "cors_origin_not_allowed"
    _clipped(error)


@pytest.mark.parametrize(("headers", "words"), [
    (lambda v: {"Upgrade": v}, "No WebSocket UPGRADE hdr: "),
    (lambda v: {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": v},
     "Unsupported version: "),
], ids=["upgrade", "version"])
async def test_a_long_websocket_handshake_header_is_quoted_cut(gateway, headers, words):
    """/v1/ws relays aiohttp's refusal of a bad handshake, which quotes the client's header
    whole (up to the 32 KiB a header may have on the gateway): cut, the rest as a short one's."""
    url, _ = gateway
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/ws", headers=headers("x")) as r:
            assert r.status == 400
            short = await _error(r)
        async with s.get(url + "/v1/ws", headers=headers(LONG)) as r:
            assert r.status == 400
            error = await _error(r)
    assert short["message"].startswith(f"/v1/ws takes a WebSocket handshake: {words}x")
    assert {**error, "message": ""} == {**short, "message": ""}
    _clipped(error)
    assert error["message"].startswith(f"/v1/ws takes a WebSocket handshake: {words}bbb")


async def test_the_fallback_gateway_quotes_a_huge_model_cut():
    """Without a scheduler (round robin over --workers): its own "no known worker" 404."""
    echo = EchoWorker("m", 0.0, "w")
    worker, worker_url = await serve_stand_in([("POST", "/v1/completions", echo.completions)], echo)
    gw = Gateway(RouterConfig(workers=worker_url))
    runner, url = await _serve(build_app(gw))
    gw.proxy.access_log.stream = io.StringIO()
    try:
        async with aiohttp.ClientSession() as s, \
                s.post(url + "/v1/completions", json={"model": HUGE, "prompt": "x"}) as r:
            assert r.status == 404
            error = await _error(r)
    finally:
        await runner.cleanup()
        await worker.cleanup()
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    _clipped(error)
    _log_bounded(gw)


async def test_a_request_the_http_parser_refuses_is_answered_and_logged_with_its_words_cut(caplog):
    """aiohttp's parser refuses a CONNECT whose authority is no host:port quoting the whole
    request target in its first line, which the gateway's 400 and WARNING line (router/
    http_errors.py, on scheduler/http_errors.py) showed whole: cut, the answer otherwise a
    short one's."""
    caplog.set_level(logging.WARNING, logger="router.http")
    runner = OpenAIErrorAppRunner(build_app(Gateway(RouterConfig(workers="http://127.0.0.1:9"))))
    short, error = await parser_refusals(runner, ("b:99999999", LONG + ":99999999"))
    assert short["message"] == "malformed HTTP request: b:99999999"
    assert {**error, "message": ""} == {**short, "message": ""}
    _clipped(error)
    assert error["message"].startswith("malformed HTTP request: bbb")
    lines = [r.getMessage() for r in caplog.records if r.name == "router.http"]
    assert len(lines) == 2 and all(len(line) < LOG_BOUND for line in lines), [len(line) for line in lines]
