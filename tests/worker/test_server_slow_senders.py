"""A client that sends its request slowly or stops part way, on a real sim worker run with
--request-receive-timeout-ms 1500: a body that stops short (of its Content-Length, its last
chunk, or after `Expect: 100-continue`) gets a 408 in the OpenAI shape and the connection is
closed, on every route that reads a body; a head that stops short is dropped; an idle
kept-alive connection, a slow but steady body, a 10 MB body and a long stream are not cut.
aiohttp alone waited for the body as long as the connection stayed open, and for the head an
hour (its keep-alive timer)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.router.slow_senders import (
    BODY_WARNING,
    HEAD_WARNING,
    SLACK_S,
    STALLED_BODIES,
    STALLED_HEADS,
    TIMEOUT_MS,
    TIMEOUT_S,
    assert_dropped,
    assert_request_timeout,
    kept_alive_then_stalled,
    log_count,
    send_steadily,
    send_then_stall,
    short_content_length,
)
from tests.worker.conftest import SIM_AVAILABLE, SIM_SKIP_REASON, Worker, launch_worker

pytestmark = pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)

# --time-scale 2: ~12 ms per token, so a 300-token stream lasts longer than twice the timeout.
FLAGS = ("--backend", "sim", "--sim-profile", "tiny", "--time-scale", "2",
         "--request-receive-timeout-ms", str(TIMEOUT_MS))
CHAT = "/v1/chat/completions"
BODY_ROUTES = ["/v1/completions", CHAT, "/v1/responses", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def worker():
    with launch_worker(*FLAGS, model="m") as w:
        yield w


def _port(worker: Worker) -> int:
    return int(worker.base_url.rsplit(":", 1)[1])


def _completion_answers(worker: Worker) -> None:
    r = httpx.post(worker.api_url + "/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stall", STALLED_BODIES, ids=lambda f: f.__name__)
async def test_a_stalled_body_gets_a_408_and_the_worker_answers_after(worker: Worker, stall) -> None:
    before = log_count(worker.output(), BODY_WARNING)
    stalled = await send_then_stall(_port(worker), stall(CHAT), TIMEOUT_S + SLACK_S)
    assert_request_timeout(stalled)
    out = worker.output()
    assert log_count(out, BODY_WARNING) == before + 1
    assert "Traceback" not in out
    await asyncio.to_thread(_completion_answers, worker)


async def test_every_route_that_reads_a_body_times_it(worker: Worker) -> None:
    stalled = await asyncio.gather(*(send_then_stall(_port(worker), short_content_length(path),
                                                     TIMEOUT_S + SLACK_S) for path in BODY_ROUTES))
    for path, one in zip(BODY_ROUTES, stalled, strict=True):
        try:
            assert_request_timeout(one)
        except AssertionError as exc:
            raise AssertionError(f"{path}: {exc}") from None


@pytest.mark.parametrize("name", list(STALLED_HEADS))
async def test_a_stalled_head_is_dropped(worker: Worker, name: str) -> None:
    before = log_count(worker.output(), HEAD_WARNING)
    assert_dropped(await send_then_stall(_port(worker), STALLED_HEADS[name], TIMEOUT_S + SLACK_S))
    out = worker.output()
    assert log_count(out, HEAD_WARNING) == before + (1 if STALLED_HEADS[name] else 0)
    assert "Traceback" not in out
    await asyncio.to_thread(_completion_answers, worker)


async def test_a_kept_alive_connection_may_idle_but_its_next_head_is_timed(worker: Worker) -> None:
    stalled = await kept_alive_then_stalled(_port(worker), "/health", TIMEOUT_S * 1.5, TIMEOUT_S + SLACK_S)
    assert_dropped(stalled)


def _long_stream(worker: Worker) -> tuple[list[str], float]:
    body = {"model": "m", "prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", worker.api_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return events, time.monotonic() - start


def _ten_megabytes(worker: Worker) -> tuple[int, float]:
    """10 MB at loopback speed (a model the worker does not serve: a 404 once it is read)."""
    body = json.dumps({"model": "none-such", "messages": [{"role": "user", "content": "x" * 10_000_000}]})
    start = time.monotonic()
    r = httpx.post(worker.base_url + CHAT, content=body.encode(), timeout=30,
                   headers={"Content-Type": "application/json"})
    return r.status_code, time.monotonic() - start


async def test_a_steady_body_a_big_one_and_a_long_stream_pass_beside_a_stalled_body(worker: Worker) -> None:
    steady = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 600}],
                         "max_tokens": 2}).encode()
    stream, big, slow, stalled = await asyncio.gather(
        asyncio.to_thread(_long_stream, worker),
        asyncio.to_thread(_ten_megabytes, worker),
        # 6 pieces 0.1 s apart: ~0.5 s, within the 1.5 s
        send_steadily(_port(worker), CHAT, steady, pieces=6, gap_s=0.1),
        send_then_stall(_port(worker), short_content_length(CHAT), TIMEOUT_S + SLACK_S),
    )
    assert_request_timeout(stalled)
    status, answer, took = slow
    assert status == 200 and json.loads(answer)["choices"], answer
    assert took > 0.4
    big_status, big_s = big
    assert big_status == 404 and big_s < TIMEOUT_S, (big_status, big_s)  # read whole, and quickly
    events, stream_s = stream
    assert events[-1] == "[DONE]" and stream_s > TIMEOUT_S * 1.5, (events[-2:], stream_s)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]
    assert not [e for e in events if '"error"' in e]
