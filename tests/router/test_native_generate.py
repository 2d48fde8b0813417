"""SGLang's and TGI's native generation APIs through the gateway: `POST /generate` (SGLang:
text, sampling_params, stream; TGI: inputs, parameters) and TGI's `POST /generate_stream`. They
name no model, and were a 404 at the gateway (no /v1 path); now each goes to the pool's one
model (router/default_model.py), leased and queued as a completion is, estimated from its text
and max_new_tokens, and streamed through where it streams."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from router.tokens import max_tokens_of, render_prompt
from tests.router.procs import gateway_over_an_echo_worker


@pytest.fixture(scope="module", params=["scheduled", "static"])
def gateway(request):
    with gateway_over_an_echo_worker(request.param) as (url, gw):
        yield url, gw


def _events(gateway_url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", gateway_url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_sglang_generate_whole_and_streamed(gateway):
    url, _ = gateway
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 5}}
    r = httpx.post(url + "/generate", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["text"] == " tok" * 5, r.text
    events = _events(url, "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == " tok" * 5


def test_tgi_generate_stream_is_streamed(gateway):
    url, _ = gateway
    events = _events(url, "/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    assert [json.loads(e)["token"]["text"] for e in events] == [" tok"] * 4
    assert json.loads(events[-1])["generated_text"] == " tok" * 4


def test_counted_and_logged_as_a_generation(gateway):
    url, proc = gateway
    r = httpx.post(url + "/generate", json={"text": "x" * 400, "sampling_params": {"max_new_tokens": 3}},
                   headers={"X-Request-Id": "native-1"}, timeout=30)
    assert r.status_code == 200
    for _ in range(100):
        line = next((x for x in proc.output().splitlines() if "router.access: id=native-1 " in x), "")
        if line:
            break
        time.sleep(0.05)
    assert "POST /generate model=m" in line and "status=200" in line, line


def test_the_native_bodies_are_estimated_like_completions():
    assert render_prompt({"text": "hello"}) == render_prompt({"prompt": "hello"})
    assert render_prompt({"inputs": "hello"}) == render_prompt({"prompt": "hello"})
    assert render_prompt({"input_ids": [1, 2, 3]}) == ("", 3)
    assert max_tokens_of({"sampling_params": {"max_new_tokens": 7}}) == 7
    assert max_tokens_of({"parameters": {"max_new_tokens": 9}}) == 9
