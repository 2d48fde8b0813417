"""The scheduler's error messages quote a caller's string cut short (scheduler/clip.py, and its
worker twin): a 100 KB model name made a 100 KB 404, which the gateway quoted again. Same
status, type, param and code as a short value gets; only the message is shorter. The HTTP API
in process (tests/scheduler/helpers.py), with its log read by caplog."""

from __future__ import annotations

import logging
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from scheduler.app import build_app, connection_error
from scheduler.clip import MAX_SHOWN_CHARS, clip, clip_repr
from scheduler.http_errors import OpenAIErrorAppRunner
from tests.scheduler.helpers import make_service, parser_refusals

HUGE = "a" * 100_000
LONG = "b" * 8000  # a path segment: aiohttp takes request lines up to 8190 bytes
BOUND = 2 * MAX_SHOWN_CHARS + 300
ADMIN = {"Authorization": "Bearer admin"}


def test_clip_keeps_short_values_and_cuts_long_ones_with_their_length():
    assert clip("m") == "m" and clip_repr("m") == "'m'" and clip_repr(None) == "None"
    assert clip("x" * MAX_SHOWN_CHARS) == "x" * MAX_SHOWN_CHARS
    assert clip(HUGE) == "a" * MAX_SHOWN_CHARS + "… (100000 chars)"
    assert clip_repr(HUGE) == "'" + "a" * MAX_SHOWN_CHARS + "…' (100000 chars)"
    assert clip_repr("it's") == '"it\'s"'  # repr's quoting, as before
    cut = clip_repr(list(range(100_000)))  # a JSON value where a string was expected
    assert cut.startswith("[0, 1, 2") and len(cut) < BOUND


@pytest.fixture
async def client(caplog):
    caplog.set_level(logging.DEBUG)
    svc = make_service(n=1, config={"admin_token": "admin", "registration_token": "reg",
                                    "startup_grace_s": 0})  # an unknown model: a 404 at once
    async with TestClient(TestServer(build_app(svc))) as c:
        yield c
    # Whatever the scheduler logged of the calls is bounded too (aiohttp's access log, which
    # the test server keeps and the scheduler turns off, aside).
    logged = [r for r in caplog.get_records("call") if r.name != "aiohttp.access"]
    assert all(len(r.getMessage()) < 2000 for r in logged)


async def _error(response) -> dict:
    assert response.content_type == "application/json"
    return (await response.json())["error"]


def _clipped(message: str) -> None:
    assert len(message) < BOUND, len(message)
    assert re.search(r"…'? \(\d+ chars\)", message), message[:300]


async def test_a_huge_model_is_a_404_quoting_it_cut(client):
    r = await client.post("/v1/schedule", json={"model": "nope"})
    assert r.status == 404
    short = await _error(r)
    assert short["message"] == "no worker serves model 'nope'"
    r = await client.post("/v1/schedule", json={"model": HUGE})
    assert r.status == 404
    error = await _error(r)
    assert {**error, "message": ""} == {**short, "message": ""}
    _clipped(error["message"])
    assert error["message"] == f"no worker serves model '{'a' * MAX_SHOWN_CHARS}…' (100000 chars)"


async def test_a_huge_model_in_a_batch_is_a_404_quoting_it_cut(client):
    """The batch and the gateway's channel (scheduler/channel.py) answer it the same way."""
    r = await client.post("/v1/batch", json=[{"op": "schedule", "model": HUGE},
                                             {"op": "schedule", "model": "nope"}])
    assert r.status == 200
    (status, body), (short_status, short) = await r.json()
    assert status == short_status == 404
    assert {**body["error"], "message": ""} == {**short["error"], "message": ""}
    _clipped(body["error"]["message"])


@pytest.mark.parametrize("action", ["cordon", "uncordon"])
async def test_a_long_unknown_worker_id_is_a_404_quoting_it_cut(client, action):
    r = await client.post(f"/v1/workers/{LONG}/{action}", headers=ADMIN)
    assert r.status == 404
    error = await _error(r)
    assert (error["param"], error["code"]) == ("worker_id", "worker_not_found")
    _clipped(error["message"])


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_long_unknown_path_is_a_404_quoting_it_cut(client, method):
    r = await client.request(method, "/" + LONG)
    assert r.status == 404
    error = await _error(r)
    assert error["code"] == "not_found"
    _clipped(error["message"])


async def test_a_registration_with_a_huge_url_is_a_400_quoting_it_cut(client):
    for url in ("ftp://x", "ftp://" + HUGE):
        r = await client.post("/v1/workers", json={"url": url}, headers={"Authorization": "Bearer reg"})
        assert r.status == 400
        error = await _error(r)
        assert (error["param"], error["type"]) == ("url", "invalid_request_error")
    assert error["message"].endswith("…' (100006 chars) does not start with http:// or https://")
    _clipped(error["message"])


async def test_a_request_the_http_parser_refuses_is_answered_and_logged_with_its_words_cut(caplog):
    """aiohttp's parser refuses a CONNECT whose authority is no host:port quoting the whole
    request target in its first line, which the runner's 400 and WARNING line (scheduler/
    http_errors.py, the gateway's too) showed whole: cut, the answer otherwise a short one's."""
    caplog.set_level(logging.WARNING, logger="scheduler.http")
    runner = OpenAIErrorAppRunner(build_app(make_service(n=1)), answer=connection_error,
                                  log=logging.getLogger("scheduler.http"))
    short, error = await parser_refusals(runner, ("b:99999999", LONG + ":99999999"))
    assert short["message"] == "malformed HTTP request: b:99999999"
    assert {**error, "message": ""} == {**short, "message": ""}
    _clipped(error["message"])
    assert error["message"].startswith("malformed HTTP request: bbb")
    lines = [r.getMessage() for r in caplog.records if r.name == "scheduler.http"]
    assert len(lines) == 2 and all(len(line) < BOUND for line in lines), [len(line) for line in lines]
