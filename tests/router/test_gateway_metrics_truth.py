"""The gateway's numbers against what a client really got: real sim workers, scheduler and
gateway on 127.0.0.1, requests whose token counts come from the answers' usage or from the
chunks the client counted, and times the client measured itself. Only ratios of times
measured in the same run are compared, never absolute times."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.procs import SimStack, series_value, sim_stack

_TPOT = 'router_time_per_output_token_seconds_{}{{model="m"}}'


@pytest.fixture(scope="module")
def stack() -> Iterator[SimStack]:
    with sim_stack(1) as st:
        yield st


def _stream(gw: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one request; returns its usage and the client's own time per output token per
    answer: first to last content chunk over the answer's tokens after its first."""
    first = last = None
    usage: dict[str, Any] | None = None
    with httpx.stream("POST", gw + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
                last = time.perf_counter()
                first = first or last
    assert usage is not None and first is not None and last is not None
    return {"usage": usage, "span": last - first}


@pytest.mark.parametrize(
    ("path", "body", "answers"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 1),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
        ("/v1/completions", {"prompt": ["one prompt", "another prompt"], "n": 2}, 4),
    ],
    ids=["chat", "chat-n3", "completions-batch2-n2"],
)
def test_time_per_output_token_is_per_answer_for_n_and_batches(
    stack: SimStack, path: str, body: dict[str, Any], answers: int
) -> None:
    """n answers (or a batch's) are generated side by side: dividing the stream's time by all
    their tokens together read n times too fast (a chat with n=3 showed a third of its real
    time per token, on the dashboard's TPOT panels and in their percentiles)."""
    gw = stack.gateway
    tokens = 30
    full = {"model": "m", "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    count0, sum0 = (series_value(gw, _TPOT.format(s), 0.0) for s in ("count", "sum"))
    seen = _stream(gw, path, full)
    assert seen["usage"]["completion_tokens"] == tokens * answers  # the tiny sim runs to max_tokens
    # The series is written when the request is done, just after the stream's end.
    deadline = time.monotonic() + 5
    while series_value(gw, _TPOT.format("count"), 0.0) == count0:
        assert time.monotonic() < deadline, "the request never reached the TPOT histogram"
        time.sleep(0.02)
    gateway_tpot = series_value(gw, _TPOT.format("sum")) - sum0
    client_tpot = seen["span"] / (tokens - 1)
    # Both time the same answer's tokens; they differ by delivery jitter, not by a factor n.
    assert 0.6 < gateway_tpot / client_tpot < 1.6, (gateway_tpot, client_tpot)
