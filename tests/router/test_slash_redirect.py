"""A trailing slash on one of the gateway's endpoints is redirected to the path without it
(307: the method and the body are kept), as vLLM's server does (router/slash_redirect.py):
`GET /v1/models/`, `POST /tokenize/` and a request naming no model on `POST /v1/responses/` were
a 404 "no such endpoint" at the gateway (benchmarks/vllm_diff_fuzz.py found them), where a
client that follows redirects (the OpenAI SDKs' httpx client) was served by vLLM; and a
streamed `POST /v1/chat/completions/` was passed on as a request for an unknown path."""

from __future__ import annotations

import httpx
import pytest

from tests.router.procs import start_echo_worker, start_gateway

BASE = "/api/llm"


@pytest.fixture(scope="module")
def gateway():
    worker, worker_url = start_echo_worker()
    gw, url = start_gateway("--workers", worker_url, "--base-path", BASE)
    try:
        yield url
    finally:
        gw.stop()
        worker.stop()


@pytest.mark.parametrize("prefix", ["", BASE])
@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/models/", None),
    ("POST", "/score/", {"model": "m", "text_1": "a", "text_2": "b"}),
    ("POST", "/v1/completions/", {"prompt": "hi", "max_tokens": 2}),  # no model: the pool's
    ("POST", "/v1/chat/completions/", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/embeddings/", {"model": "m", "input": "hi"}),
    ("GET", "/health/", None),
])
def test_a_trailing_slash_is_redirected_to_the_endpoint(gateway, prefix, method, path, body):
    url = gateway + prefix + path
    r = httpx.request(method, url + "?x=1", json=body, timeout=30)
    assert r.status_code == 307, r.text
    assert r.headers["location"] == prefix + path.rstrip("/") + "?x=1"
    followed = httpx.request(method, url, json=body, timeout=30, follow_redirects=True)
    assert followed.status_code == 200, followed.text
    assert followed.url.path == prefix + path.rstrip("/")


def test_a_path_served_with_other_methods_is_redirected_and_then_a_405(gateway):
    r = httpx.patch(gateway + "/v1/models/", timeout=30, follow_redirects=True)
    assert r.history and r.history[0].status_code == 307
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text


@pytest.mark.parametrize(("method", "path"), [("GET", "/nothing/"), ("POST", "/v1/nothing/"),
                                              ("GET", "/")])
def test_a_path_the_gateway_does_not_serve_without_the_slash_is_still_a_404(gateway, method, path):
    r = httpx.request(method, gateway + path, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_the_tokenizer_paths_are_redirected_too(gateway):
    r = httpx.post(gateway + "/tokenize/", json={"model": "m", "prompt": "hi"}, timeout=30)
    assert r.status_code == 307 and r.headers["location"] == "/tokenize"


@pytest.mark.parametrize(("path", "location"), [
    ("/v1/models/%C3%BC/", "/v1/models/%C3%BC"),  # non-ASCII: as the client encoded it
    ("/v1/models/a%0Ab/", "/v1/models/a%0Ab"),  # a newline: encoded, no header injection
])
def test_the_location_is_the_path_as_the_client_encoded_it(gateway, path, location):
    """The decoded path put raw UTF-8, or a newline, in the Location header: aiohttp refused
    the newline and the client got no answer at all."""
    r = httpx.get(gateway + path, timeout=30)
    assert r.status_code == 307 and r.headers["location"] == location, r.text


def test_an_encoded_trailing_slash_is_no_redirect_to_the_same_url(gateway):
    r = httpx.get(gateway + "/v1/models/a%2F", timeout=30)
    assert r.status_code == 404, (r.status_code, r.headers.get("location"))
