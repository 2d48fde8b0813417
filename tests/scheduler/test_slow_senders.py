"""A client that sends its request slowly or stops part way, on a real scheduler run with
--request-receive-timeout-ms 1500: a body that stops short (of its Content-Length, its last
chunk, or after `Expect: 100-continue`) gets a 408 in the OpenAI shape and the connection is
closed; a head that stops short is dropped; an idle kept-alive connection, a slow but steady
body (even one that takes longer than the timeout to come), a body at the 1 MiB limit, a held
/v1/schedule call and an idle channel are not cut; a body that stalls after some progress, or
comes under the rate floor, gets the 408. aiohttp alone waited for the body as long as the
connection stayed open, and for the head an hour (its keep-alive timer)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import httpx
import pytest

from tests.router.procs import Proc, start_scheduler
from tests.router.slow_senders import (
    SLACK_S,
    STALLED_BODIES,
    STALLED_HEADS,
    TIMEOUT_MS,
    TIMEOUT_S,
    assert_dropped,
    assert_request_timeout,
    check_body_under_the_rate_floor,
    check_stall_after_progress,
    check_stalled_body,
    check_stalled_head,
    check_steady_body_outlasting_the_timeout,
    kept_alive_then_stalled,
    send_steadily,
    send_then_stall,
    short_content_length,
)

SCHEDULE = "/v1/schedule"


@pytest.fixture(scope="module")
def scheduler():
    # One static worker that never answers, and a long start-up grace: a model no worker serves
    # is answered 'wait' meanwhile, so a /v1/schedule call with wait_ms is held that long.
    proc, url = start_scheduler(["http://127.0.0.1:9"], "--request-receive-timeout-ms", str(TIMEOUT_MS),
                                "--startup-grace-s", "600")
    try:
        yield proc, url
    finally:
        proc.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _release_answers(url: str) -> None:
    r = httpx.post(url + "/v1/release", json={"lease_id": "none-such", "ok": True}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "lease_not_found", r.text


@pytest.mark.parametrize("stall", STALLED_BODIES, ids=lambda f: f.__name__)
async def test_a_stalled_body_gets_a_408_and_the_scheduler_answers_after(
    scheduler: tuple[Proc, str], stall
) -> None:
    proc, url = scheduler
    await check_stalled_body(_port(url), stall(SCHEDULE), proc.output, lambda: _release_answers(url))


@pytest.mark.parametrize("name", list(STALLED_HEADS))
async def test_a_stalled_head_is_dropped(scheduler: tuple[Proc, str], name: str) -> None:
    proc, url = scheduler
    await check_stalled_head(_port(url), name, proc.output, lambda: _release_answers(url))


async def test_a_kept_alive_connection_may_idle_but_its_next_head_is_timed(
    scheduler: tuple[Proc, str]
) -> None:
    _, url = scheduler
    assert_dropped(await kept_alive_then_stalled(_port(url), "/health", TIMEOUT_S * 1.5, TIMEOUT_S + SLACK_S))


def _held_call(url: str) -> tuple[int, dict, float]:
    start = time.monotonic()
    r = httpx.post(url + SCHEDULE, json={"model": "m", "wait_ms": 3500}, timeout=30)
    return r.status_code, r.json(), time.monotonic() - start


def _a_mebibyte(url: str) -> tuple[int, float]:
    """A body just under the scheduler's 1 MiB limit, at loopback speed."""
    body = json.dumps({"model": "none-such", "lora": "x" * 1_000_000}).encode()
    start = time.monotonic()
    r = httpx.post(url + SCHEDULE, content=body, timeout=30, headers={"Content-Type": "application/json"})
    return r.status_code, time.monotonic() - start


async def _idle_channel(url: str) -> list:
    """The gateways' WebSocket channel, idle longer than twice the timeout, then used."""
    channel = url.replace("http", "ws") + "/v1/channel"
    async with aiohttp.ClientSession() as session, session.ws_connect(channel) as ws:
        await asyncio.sleep(TIMEOUT_S * 2)
        await ws.send_str(json.dumps([{"op": "schedule", "model": "m"}]))
        return json.loads((await ws.receive(timeout=10)).data)


async def test_a_steady_body_a_big_one_a_held_call_and_a_channel_pass_beside_a_stalled_body(
    scheduler: tuple[Proc, str]
) -> None:
    _, url = scheduler
    steady = json.dumps({"model": "m", "prompt_tokens": 5, "lora": "y" * 600}).encode()
    held, big, slow, channel, stalled = await asyncio.gather(
        asyncio.to_thread(_held_call, url),
        asyncio.to_thread(_a_mebibyte, url),
        # 6 pieces 0.1 s apart: ~0.5 s, within the 1.5 s
        send_steadily(_port(url), SCHEDULE, steady, pieces=6, gap_s=0.1),
        _idle_channel(url),
        send_then_stall(_port(url), short_content_length(SCHEDULE), TIMEOUT_S + SLACK_S),
    )
    assert_request_timeout(stalled)
    status, answer, took = slow
    assert status == 503 and json.loads(answer)["wait"] is True, answer  # read whole: answered
    assert took > 0.4
    big_status, big_s = big
    assert big_status == 503 and big_s < TIMEOUT_S, (big_status, big_s)
    held_status, held_body, held_s = held
    assert held_status == 503 and held_body["wait"] is True and held_s > TIMEOUT_S * 2, (held_body, held_s)
    assert channel[0][0] == 503, channel


def _wait_answered(status: int, answer: bytes) -> None:
    assert status == 503 and json.loads(answer)["wait"] is True, (status, answer)  # read whole: answered


async def test_a_steady_body_may_take_longer_than_the_timeout(scheduler: tuple[Proc, str]) -> None:
    _, url = scheduler
    doc = {"model": "m", "prompt_tokens": 5}
    await check_steady_body_outlasting_the_timeout(_port(url), SCHEDULE, doc, _wait_answered)


async def test_a_body_that_stalls_after_progress_gets_a_408(scheduler: tuple[Proc, str]) -> None:
    proc, url = scheduler
    await check_stall_after_progress(_port(url), SCHEDULE, proc.output)


async def test_a_body_under_the_rate_floor_gets_a_408(scheduler: tuple[Proc, str]) -> None:
    proc, url = scheduler
    await check_body_under_the_rate_floor(_port(url), SCHEDULE, proc.output, chunked=True)
