"""A request that names no model, sent to an endpoint's path with a trailing slash, is for that
endpoint: vLLM answers `POST /v1/responses/` with a 307 to `/v1/responses` and serves it there
(benchmarks/vllm_diff_fuzz.py found the gateway answering 404 "no such endpoint" instead)."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import make_mocked_request

from router.request_checks import ModelRequest, model_request


@pytest.mark.parametrize("path", ["/v1/responses/", "/v1/completions/", "/v1/chat/completions/",
                                  "/v1/embeddings/", "/tokenize/"])
def test_a_trailing_slash_names_the_same_model_endpoint(path):
    raw = json.dumps({"input": "hi"}).encode()
    request = make_mocked_request("POST", path, headers={"Content-Type": "application/json"})
    req = model_request(request, path, raw)
    assert isinstance(req, ModelRequest) and req.model is None  # the pool's one model serves it


def test_another_path_without_a_model_is_still_no_endpoint():
    raw = json.dumps({"input": "hi"}).encode()
    request = make_mocked_request("POST", "/v1/nothing/", headers={"Content-Type": "application/json"})
    assert model_request(request, "/v1/nothing/", raw) is None  # the caller answers 404
