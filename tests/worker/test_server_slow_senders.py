"""A client that sends its request slowly or stops part way, on a real sim worker run with
--request-receive-timeout-ms 1500: a body that stops short (of its Content-Length, its last
chunk, or after `Expect: 100-continue`) gets a 408 in the OpenAI shape and the connection is
closed, on every route that reads a body; a head that stops short is dropped; an idle
kept-alive connection, a slow but steady body (even one that takes longer than the timeout to
come), a 10 MB body and a long stream are not cut; a body that stalls after some progress, or
comes under the rate floor, gets the 408. aiohttp alone waited for the body as long as the
connection stayed open, and for the head an hour (its keep-alive timer)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.router.slow_senders import (
    CHAT,
    SLACK_S,
    STALLED_BODIES,
    STALLED_HEADS,
    TIMEOUT_MS,
    TIMEOUT_S,
    assert_dropped,
    assert_request_timeout,
    check_answers_beside_a_stalled_body,
    check_body_under_the_rate_floor,
    check_stall_after_progress,
    check_stalled_body,
    check_stalled_head,
    check_steady_body_outlasting_the_timeout,
    kept_alive_then_stalled,
    send_then_stall,
    short_content_length,
)
from tests.worker.conftest import SIM_AVAILABLE, SIM_SKIP_REASON, Worker, launch_worker

pytestmark = pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)

# --time-scale 2: ~12 ms per token, so a 300-token stream lasts longer than twice the timeout.
FLAGS = ("--backend", "sim", "--sim-profile", "tiny", "--time-scale", "2",
         "--request-receive-timeout-ms", str(TIMEOUT_MS))
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
    await check_stalled_body(_port(worker), stall(CHAT), worker.output, lambda: _completion_answers(worker))


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
    await check_stalled_head(_port(worker), name, worker.output, lambda: _completion_answers(worker))


async def test_a_kept_alive_connection_may_idle_but_its_next_head_is_timed(worker: Worker) -> None:
    stalled = await kept_alive_then_stalled(_port(worker), "/health", TIMEOUT_S * 1.5, TIMEOUT_S + SLACK_S)
    assert_dropped(stalled)


async def test_a_steady_body_a_big_one_and_a_long_stream_pass_beside_a_stalled_body(worker: Worker) -> None:
    await check_answers_beside_a_stalled_body(worker.base_url, _port(worker))


def _completion_answered(status: int, answer: bytes) -> None:
    assert status == 200 and json.loads(answer)["choices"], (status, answer)


async def test_a_steady_body_may_take_longer_than_the_timeout(worker: Worker) -> None:
    doc = {"model": "m", "prompt": "hi", "max_tokens": 2}
    await check_steady_body_outlasting_the_timeout(_port(worker), "/v1/completions", doc,
                                                   _completion_answered)


async def test_a_body_that_stalls_after_progress_gets_a_408(worker: Worker) -> None:
    await check_stall_after_progress(_port(worker), CHAT, worker.output)


async def test_a_body_under_the_rate_floor_gets_a_408(worker: Worker) -> None:
    await check_body_under_the_rate_floor(_port(worker), CHAT, worker.output, chunked=False)
