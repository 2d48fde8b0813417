"""A draining worker's 503 is recognised (router/draining.py) and reported "draining": ours
(`shutting_down`, whole or cut to the 200 bytes a retried attempt keeps), vLLM's drain, and
no other 503."""

from __future__ import annotations

import json

import pytest

from inference_worker.server.errors import (
    EngineShutdownError,
    exception_to_api_error,
    json_error,
    shutting_down,
)
from router.draining import says_draining
from router.errors import error_body
from router.streaming import RetryElsewhere
from scheduler.protocol import DRAINING

OURS = json_error(shutting_down()).body.decode()
# What a request the worker had taken gets past its --shutdown-timeout: it drains too.
CUT_AT_THE_LIMIT = json_error(exception_to_api_error(EngineShutdownError("cut"))).body.decode()
# vLLM --shutdown-mode drain (its ServiceUnavailableMiddleware, a Starlette JSONResponse).
VLLM = '{"error":"Server is unavailable. Please try again later."}'
# A gateway in front that stops (router/proxy.py).
GATEWAY = error_body("the gateway is shutting down", "server_error", "shutting_down").decode()


@pytest.mark.parametrize("body", [OURS, OURS[:-2], CUT_AT_THE_LIMIT, VLLM, GATEWAY,
                                  json.dumps({"error": {"message": "m", "type": "shutting_down"}})])
def test_a_draining_workers_503_says_so(body):
    assert says_draining(503, body)
    assert RetryElsewhere.answered(503, body).reason == DRAINING


def test_a_body_cut_short_is_read_as_far_as_it_goes():
    """A retried attempt keeps the first 200 bytes of the answer: ours fits, with a long
    message it is cut (not JSON), and its code may be cut off with the rest."""
    assert says_draining(503, OURS[:-2])
    assert not says_draining(503, OURS[:120])


@pytest.mark.parametrize(("status", "body"), [
    (500, OURS),  # only a 503 says it
    (502, VLLM),
    (503, json.dumps({"error": {"message": "The engine is not running", "type": "server_error",
                                "code": "engine_dead"}})),  # dead, not draining
    (503, '{"error":"Service Unavailable"}'),
    (503, "Service Unavailable"),  # a proxy's
    (503, ""),
    (503, "[1, 2]"),
    # A message that quotes the words (an echoed prompt) is no code.
    (503, json.dumps({"error": {"message": '"code": "shutting_down"', "type": "server_error"}})),
    (503, json.dumps({"error": {"message": '"code": "shutting_down"', "type": "server_error"}})[:60]),
])
def test_no_other_answer_says_it(status, body):
    assert not says_draining(status, body)


def test_other_failure_kinds_are_kept():
    assert RetryElsewhere.answered(500, OURS).reason == "http_500"
    full = RetryElsewhere.answered(429, OURS)  # full, whatever it says: not a failure at all
    assert (full.reason, full.overloaded) == ("http_429", True)
    assert RetryElsewhere.answered(503, "Service Unavailable").reason == "http_503"
