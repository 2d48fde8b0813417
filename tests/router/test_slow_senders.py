"""A client that sends its request slowly or stops part way, on a real gateway (over a real
scheduler and sim worker, all on 127.0.0.1) run with --request-receive-timeout-ms 1500: a body
that stops short (of its Content-Length, its last chunk, or after `Expect: 100-continue`) gets
a 408 in the OpenAI shape and the connection is closed; a head that stops short is dropped; an
idle kept-alive connection, a slow but steady body (even one that takes longer than the timeout
to come), a 10 MB body and a long stream are not cut; a body that stalls after some progress, or
comes under the rate floor, gets the 408. aiohttp alone waited for the body as long as the
connection stayed open, and for the head an hour (its keep-alive timer)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.router.procs import SimStack, sim_stack
from tests.router.slow_senders import (
    CHAT,
    SLACK_S,
    STALLED_BODIES,
    STALLED_HEADS,
    TIMEOUT_MS,
    TIMEOUT_S,
    assert_dropped,
    check_answers_beside_a_stalled_body,
    check_body_under_the_rate_floor,
    check_stall_after_progress,
    check_stalled_body,
    check_stalled_head,
    check_steady_body_outlasting_the_timeout,
    kept_alive_then_stalled,
)

RECEIVE = ("--request-receive-timeout-ms", str(TIMEOUT_MS))


@pytest.fixture(scope="module")
def stack():
    # --time-scale 2: ~12 ms per token, so a 300-token stream lasts longer than twice the timeout.
    with sim_stack(1, "--time-scale", "2", *RECEIVE, scheduler_flags=RECEIVE,
                   gateway_flags=(*RECEIVE, "--max-body-bytes", str(16 << 20))) as s:
        yield s


def _port(stack: SimStack) -> int:
    return int(stack.gateway.rsplit(":", 1)[1])


def _chat_answers(stack: SimStack) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(stack.gateway + CHAT, json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stall", STALLED_BODIES, ids=lambda f: f.__name__)
async def test_a_stalled_body_gets_a_408_and_the_gateway_answers_after(stack: SimStack, stall) -> None:
    await check_stalled_body(_port(stack), stall(CHAT), stack.gateway_proc.output,
                             lambda: _chat_answers(stack))


@pytest.mark.parametrize("name", list(STALLED_HEADS))
async def test_a_stalled_head_is_dropped(stack: SimStack, name: str) -> None:
    await check_stalled_head(_port(stack), name, stack.gateway_proc.output, lambda: _chat_answers(stack))


async def test_a_kept_alive_connection_may_idle_but_its_next_head_is_timed(stack: SimStack) -> None:
    stalled = await kept_alive_then_stalled(_port(stack), "/health", TIMEOUT_S * 1.5, TIMEOUT_S + SLACK_S)
    assert_dropped(stalled)


async def test_a_steady_body_a_big_one_and_a_long_stream_pass_beside_a_stalled_body(stack: SimStack) -> None:
    await check_answers_beside_a_stalled_body(stack.gateway, _port(stack))


def _chat_answered(status: int, answer: bytes) -> None:
    assert status == 200 and json.loads(answer)["choices"], (status, answer)


async def test_a_steady_body_may_take_longer_than_the_timeout(stack: SimStack) -> None:
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    await check_steady_body_outlasting_the_timeout(_port(stack), CHAT, doc, _chat_answered)


async def test_a_body_that_stalls_after_progress_gets_a_408(stack: SimStack) -> None:
    await check_stall_after_progress(_port(stack), CHAT, stack.gateway_proc.output)


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
async def test_a_body_under_the_rate_floor_gets_a_408(stack: SimStack, chunked: bool) -> None:
    await check_body_under_the_rate_floor(_port(stack), CHAT, stack.gateway_proc.output, chunked=chunked)
