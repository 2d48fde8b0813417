"""Idle kept-alive connections and the cap on connections, on a real sim worker run with
--keepalive-timeout-s 0.5 --max-connections 3: an idle connection is closed 0.5 s after its
last answer (aiohttp's default kept it an hour), one in use is not; a 4th connection at once
gets a 503 in the OpenAI error shape with Retry-After and is closed, the streams on the first
three go on, and once one closes a new one is served; /metrics counts the refused (worker_
names, beside vLLM's)."""

from __future__ import annotations

import json

import pytest

from tests.router.connection_checks import (
    FLAGS,
    REFUSED_WARNING,
    assert_idle_closed,
    check_cap,
    long_request_then_idle,
    post,
    sse_events,
    stream_on_own_connection,
)
from tests.router.slow_senders import log_count
from tests.worker.conftest import SIM_AVAILABLE, SIM_SKIP_REASON, Worker, launch_worker, parse_samples

pytestmark = pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)


@pytest.fixture(scope="module")
def worker():
    # --time-scale 3: ~18 ms per token.
    with launch_worker("--backend", "sim", "--sim-profile", "tiny", "--time-scale", "3", *FLAGS,
                       model="m") as w:
        yield w


def _port(worker: Worker) -> int:
    return int(worker.base_url.rsplit(":", 1)[1])


def _refused(worker: Worker) -> float:
    return parse_samples(worker.metrics_text())[("worker_connections_refused_total", ())]


async def test_an_idle_connection_is_closed_after_the_keepalive_and_a_busy_one_is_not(worker: Worker) -> None:
    # 100 tokens at ~18 ms: the answer takes ~1.8 s, more than three times the keep-alive.
    kept = await long_request_then_idle(_port(worker), post("/v1/completions", {
        "model": "m", "prompt": "go", "max_tokens": 100, "ignore_eos": True}))
    assert kept.status == 200 and json.loads(kept.body)["choices"], kept
    assert_idle_closed(kept)


async def test_past_the_cap_a_connection_gets_a_503_and_the_streams_go_on(worker: Worker) -> None:
    port = _port(worker)
    began: list[int] = []
    # 300 tokens at ~18 ms: each stream lasts ~5.4 s, time for the checks while they hold the cap.
    stream = post("/v1/completions", {"model": "m", "prompt": "go", "max_tokens": 300, "ignore_eos": True,
                                      "stream": True})
    warnings_before = log_count(worker.output(), REFUSED_WARNING)
    refused_before = _refused(worker)
    answers = await check_cap(port, lambda: stream_on_own_connection(port, stream, began), lambda: len(began))
    for raw in answers:
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and not [e for e in events if '"error"' in e], events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]
    assert _refused(worker) >= refused_before + 1
    assert log_count(worker.output(), REFUSED_WARNING) == warnings_before + 1
    assert "Traceback" not in worker.output()
