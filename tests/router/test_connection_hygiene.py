"""Idle kept-alive connections and the cap on connections, on a real gateway (over an echo
worker, all on 127.0.0.1) run with --keepalive-timeout-s 0.5 --max-connections 3: an idle
connection is closed 0.5 s after its last answer (aiohttp's default kept it an hour), one in
use is not; a 4th connection at once gets a 503 in the OpenAI error shape with Retry-After and
is closed, the streams on the first three go on, and once one closes a new one is served; the
metrics port is not under the cap and counts the refused."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.router.connection_checks import (
    FLAGS,
    MAX_CONNECTIONS,
    REFUSED_WARNING,
    assert_idle_closed,
    assert_refused,
    check_cap,
    get,
    long_request_then_idle,
    post,
    refused,
    sse_events,
    stream_on_own_connection,
)
from tests.router.procs import free_port, series_value, start_echo_worker, start_gateway
from tests.router.slow_senders import log_count

TOKEN_DELAY_MS = 20


@pytest.fixture(scope="module")
def gateway():
    worker, worker_url = start_echo_worker(token_delay_ms=TOKEN_DELAY_MS)
    metrics_port = free_port()
    try:
        proc, url = start_gateway("--workers", worker_url, "--metrics-port", str(metrics_port), *FLAGS)
    except BaseException:
        worker.stop()
        raise
    try:
        yield proc, url, f"http://127.0.0.1:{metrics_port}"
    finally:
        proc.stop()
        worker.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_an_idle_connection_is_closed_after_the_keepalive_and_a_busy_one_is_not(gateway) -> None:
    _, url, _ = gateway
    # 75 tokens at 20 ms: the answer takes 1.5 s, three times the keep-alive.
    kept = await long_request_then_idle(_port(url), post("/v1/completions", {
        "model": "m", "prompt": "go", "max_tokens": 75}))
    assert kept.status == 200 and json.loads(kept.body)["choices"], kept
    assert_idle_closed(kept)


async def test_past_the_cap_a_connection_gets_a_503_and_the_streams_go_on(gateway) -> None:
    proc, url, metrics_url = gateway
    port = _port(url)
    began: list[int] = []
    # 250 tokens at 20 ms: each stream lasts 5 s, time for the checks while they hold the cap.
    stream = post("/v1/completions", {"model": "m", "prompt": "go", "max_tokens": 250, "stream": True})
    warnings_before = log_count(proc.output(), REFUSED_WARNING)
    refused_before = series_value(metrics_url, "router_connections_refused_total")

    async def while_full() -> None:
        # The metrics port is not under the API port's cap.
        served = await asyncio.to_thread(series_value, metrics_url, "router_connections_open")
        assert served == MAX_CONNECTIONS
        # A flood of refusals is one WARNING line, not one a connection.
        for r in await asyncio.gather(*(refused(port, get("/v1/models")) for _ in range(10))):
            assert_refused(r)

    answers = await check_cap(port, lambda: stream_on_own_connection(port, stream, began),
                              lambda: len(began), while_full)
    for raw in answers:
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and not [e for e in events if '"error"' in e], events[-3:]
        assert len(events) > 200, len(events)
    refused_now = await asyncio.to_thread(series_value, metrics_url, "router_connections_refused_total")
    assert refused_now >= refused_before + 11
    assert log_count(proc.output(), REFUSED_WARNING) == warnings_before + 1
    assert "Traceback" not in proc.output()
