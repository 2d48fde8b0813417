"""The Responses API through the gateway, with real processes: two sim workers (tiny profile at
--time-scale 5, ~32 ms per token, so a 60-token answer streams for ~2 s), the scheduler and
the gateway. A streamed response reaches its client event by event, not in one piece at the
end, and its usage (input/output tokens) reaches the gateway's counters."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.router.procs import series_value, sim_stack


@pytest.fixture(scope="module")
def gateway():
    with sim_stack(2, "--time-scale", "5") as stack:
        yield stack.gateway


def _counters(gw: str) -> tuple[float, float, float]:
    return (series_value(gw, 'router_prompt_tokens_total{model="m"}', 0.0),
            series_value(gw, 'router_generation_tokens_total{model="m"}', 0.0),
            series_value(gw, 'router_time_to_first_token_seconds_count{model="m"}', 0.0))


def test_a_streamed_response_arrives_event_by_event_and_is_counted(gateway):
    before = _counters(gateway)
    body = {"model": "m", "input": "tell me a story", "max_output_tokens": 60, "stream": True,
            "ignore_eos": True}  # vLLM's sampling extras reach the engine as for chat
    arrivals: list[tuple[str, float]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", gateway + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = []
        for line in r.iter_lines():
            if line.startswith("event: "):
                arrivals.append((line[7:], time.monotonic() - t0))
            elif line.startswith("data: "):
                data.append(json.loads(line[6:]))
    kinds = [k for k, _ in arrivals]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    first_delta = next(t for k, t in arrivals if k == "response.output_text.delta")
    completed = arrivals[-1][1]
    # Streamed through: most of the request's time (~2 s of decoding) lies between its first
    # delta and its end; a buffered answer would arrive all at once, at the end.
    assert completed - first_delta > 0.5 * completed
    usage = data[-1]["response"]["usage"]
    assert usage["output_tokens"] == 60
    after = _counters(gateway)
    assert after[0] - before[0] == usage["input_tokens"]
    assert after[1] - before[1] == 60
    assert after[2] - before[2] == 1  # its first token was seen


def test_a_whole_response_through_the_gateway_is_counted(gateway):
    before = _counters(gateway)
    r = httpx.post(gateway + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 5},
                   timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = _counters(gateway)
    assert (after[0] - before[0], after[1] - before[1]) == (usage["input_tokens"], usage["output_tokens"])
