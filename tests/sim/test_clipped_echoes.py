"""A sim worker's error messages quote a client's string cut short (inference_worker/server/clip.py):
a 100 KB model name made a 100 KB 404, a 100 KB tool_choice or dict key a 100 KB 400. Each is
answered with the status, type, param and code a short value gets, and vLLM's words around a
short value are unchanged; only a long value is cut (its head, an ellipsis, its length). The
worker's log stays bounded too. A real `python -m inference_worker --backend sim` on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import aiohttp
import httpx
import pytest

from inference_worker.server.clip import MAX_SHOWN_CHARS
from tests.worker.conftest import SIM_AVAILABLE, SIM_SKIP_REASON, launch_worker

pytestmark = pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)

MODEL = "tiny-sim"
HUGE = "a" * 100_000
HEAD = "a" * MAX_SHOWN_CHARS
LONG = "b" * 8000  # a path segment or a query value: aiohttp takes request lines up to 8190 bytes
# One clipped value and vLLM's words around it; pydantic's message is cut at 4x as a backstop.
BOUND = 6 * MAX_SHOWN_CHARS
MESSAGES = [{"role": "user", "content": "hi"}]
CMPL, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"


@pytest.fixture(scope="module")
def worker():
    with launch_worker("--backend", "sim", "--sim-profile", "tiny", model=MODEL) as w:
        yield w
        log = w.output()
        assert "Traceback" not in log
        assert max(map(len, log.splitlines())) < 2000, "a log line quoted a client's value whole"


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert len(error["message"]) < BOUND, len(error["message"])
    assert error["param"] is None or len(error["param"]) < BOUND, len(error["param"])
    return error


def _same_but_cut(worker, method: str, path: str, short: dict | None, long: dict | None,
                  status: int, cut: str, **kwargs) -> tuple[dict, dict]:
    """The errors for a short and a long value: alike but for the message, the long one's
    holding `cut` (the value's head, cut) and its length; ({short}, {long}) are their bodies."""
    url = worker.base_url + path
    small = _error(httpx.request(method, url, json=short, timeout=30, **kwargs), status)
    big = _error(httpx.request(method, url, json=long, timeout=30, **kwargs), status)
    assert {**big, "message": "", "param": ""} == {**small, "message": "", "param": ""}
    assert cut in big["message"] and re.search(r"…'? \(\d+ chars\)", big["message"]), big["message"][:400]
    return small, big


@pytest.mark.parametrize("path", [CMPL, CHAT, "/tokenize"])
def test_a_huge_model_is_vllms_404_with_the_name_cut(worker, path):
    body = {"prompt": "hi"} if path != CHAT else {"messages": MESSAGES}
    small, big = _same_but_cut(worker, "POST", path, {**body, "model": "nope"}, {**body, "model": HUGE},
                               404, f"The model `{HEAD}… (100000 chars)` does not exist.")
    assert small["message"] == "The model `nope` does not exist." and small["code"] == "model_not_found"
    assert big["param"] == "model"


def test_a_huge_tool_choice_is_vllms_400_with_the_value_cut(worker):
    body = {"model": MODEL, "messages": MESSAGES, "tools": []}
    small, big = _same_but_cut(worker, "POST", CHAT, {**body, "tool_choice": "sometimes"},
                               {**body, "tool_choice": HUGE}, 400,
                               f"Invalid value for `tool_choice`: '{HEAD}…' (100000 chars). Only")
    assert small["message"].startswith("Invalid value for `tool_choice`: 'sometimes'. Only")
    assert big["param"] == "tool_choice"


@pytest.mark.parametrize(("path", "body", "param"), [
    (CMPL, lambda v: {"prompt": "hi", "logit_bias": {v: 1}}, "logit_bias"),
    (CHAT, lambda v: {"messages": [{"role": "user", "content": [{"type": v}]}]}, "messages.0.content.0.type"),
    (RESPONSES, lambda v: {"input": [{"type": v}]}, "input.0.type"),
    (RESPONSES, lambda v: {"input": [{"role": "user", "content": [{"type": v}]}]}, "input.0.content.0.type"),
    (RESPONSES, lambda v: {"input": "hi", "text": {"format": {"type": v}}}, "text.format"),
], ids=["logit_bias-key", "chat-content-type", "input-item-type", "input-content-type", "text-format"])
def test_a_huge_field_value_is_a_400_with_the_value_cut(worker, path, body, param):
    """Values a message names (a key of logit_bias, an unknown type): cut, the rest as before."""
    small, big = _same_but_cut(worker, "POST", path, {"model": MODEL, **body("x")},
                               {"model": MODEL, **body(HUGE)}, 400, f"'{HEAD}…' (100000 chars)")
    assert small["param"] == big["param"] == param
    assert "'x'" in small["message"]


def test_a_huge_dict_key_in_a_validation_error_is_cut_in_param_and_message(worker):
    """pydantic names a dict's key in the error's location: the client's, so cut."""
    small, big = _same_but_cut(worker, "POST", RESPONSES,
                               {"model": MODEL, "input": "hi", "metadata": {"k": 1}},
                               {"model": MODEL, "input": "hi", "metadata": {HUGE: 1}}, 400,
                               f"metadata.{HEAD}… (100000 chars): Input should be a valid string")
    assert small == {"message": "metadata.k: Input should be a valid string", "type": "invalid_request_error",
                     "param": "metadata.k", "code": "invalid_value"}
    assert big["param"] == f"metadata.{HEAD}… (100000 chars)"


def test_an_unknown_response_id_is_vllms_404_with_the_id_cut(worker):
    body = {"model": MODEL, "input": "hi"}
    small, big = _same_but_cut(worker, "POST", RESPONSES, {**body, "previous_response_id": "resp_x"},
                               {**body, "previous_response_id": HUGE}, 404,
                               f"Response with id '{HEAD}… (100000 chars)' not found.")
    assert small["message"] == "Response with id 'resp_x' not found."
    assert big["param"] == "previous_response_id"
    got = _error(httpx.get(f"{worker.base_url}{RESPONSES}/{LONG}", timeout=30), 404)
    assert got["message"] == f"Response with id '{'b' * MAX_SHOWN_CHARS}… (8000 chars)' not found."
    assert got["param"] == "response_id"


def test_a_long_query_value_and_path_are_cut(worker):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    stored = httpx.post(worker.base_url + RESPONSES, json=body, timeout=30).json()["id"]
    url = f"{worker.base_url}{RESPONSES}/{stored}"
    assert _error(httpx.get(url, params={"stream": "maybe"}, timeout=30), 400)["message"] == \
        "stream must be true or false, got 'maybe'"
    error = _error(httpx.get(url, params={"stream": LONG}, timeout=30), 400)
    assert error["param"] == "stream" and "…' (8000 chars)" in error["message"]
    error = _error(httpx.get(f"{worker.base_url}/{LONG}", timeout=30), 404)
    assert error["message"] == f"Not found: GET /{'b' * (MAX_SHOWN_CHARS - 1)}… (8001 chars)"


def test_a_huge_endpoint_on_the_websocket_is_cut(worker):
    async def ask() -> dict:
        async with aiohttp.ClientSession() as session, session.ws_connect(worker.base_url + "/v1/ws") as ws:
            await ws.send_json({"model": MODEL, "prompt": "hi", "endpoint": HUGE})
            return await asyncio.wait_for(ws.receive_json(), 30)

    error = asyncio.run(ask())["error"]
    assert error["param"] == "endpoint" and len(error["message"]) < BOUND
    assert error["message"].startswith(f"unknown endpoint '{HEAD}…' (100000 chars): use")


@pytest.mark.parametrize(("headers", "words"), [
    (lambda v: {"Upgrade": v}, "No WebSocket UPGRADE hdr: "),
    (lambda v: {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": v},
     "Unsupported version: "),
], ids=["upgrade", "version"])
def test_a_long_websocket_handshake_header_is_cut(worker, headers, words):
    """aiohttp refuses a bad WebSocket handshake quoting the client's header whole (up to the
    32 KiB a header may have): the 400 is a short value's, its message cut."""
    url = worker.base_url + "/v1/ws"
    small = _error(httpx.get(url, headers=headers("x"), timeout=30), 400)
    big = _error(httpx.get(url, headers=headers(LONG), timeout=30), 400)
    assert small["message"].startswith(words + "x")
    assert {**big, "message": ""} == {**small, "message": ""}
    assert big["message"].startswith(words + "bbb") and re.search(r"… \(\d+ chars\)", big["message"])


def test_a_request_the_http_parser_refuses_is_answered_with_its_words_cut(worker):
    """aiohttp's parser refuses a CONNECT whose authority is no host:port quoting the whole
    request target in its first line, which the worker's 400 (server/http_errors.py) and its
    WARNING line showed whole: cut (the fixture bounds the log), the answer otherwise a short one's."""
    port = int(worker.base_url.rsplit(":", 1)[1])
    errors = []
    for target in ("b:99999999", LONG + ":99999999"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = b""
            while chunk := s.recv(65536):  # the worker closes after a request it could not parse
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 400"), head
        errors.append(json.loads(body)["error"])
    short, error = errors
    assert short["message"] == "malformed HTTP request: b:99999999"
    assert {**error, "message": ""} == {**short, "message": ""}
    assert len(error["message"]) < BOUND and error["message"].startswith("malformed HTTP request: bbb")
    assert re.search(r"… \(\d+ chars\)", error["message"]), error["message"][:300]
