"""Stored responses behind the gateway, with real processes: three sim workers that store
Responses API answers, a round-robin scheduler (so that only the pin keeps a conversation on
one worker) and the gateway. A request that continues a response (`previous_response_id`), and
GET or cancel on one, reach the worker that stores it; another gateway finds that worker by
asking; with the scheduler away (static --workers) the pin still holds; a background response
is polled, resumed and cancelled on its worker; an owner that is down is an error, not an
answer from a worker that lacks the conversation."""

from __future__ import annotations

import json
import time

import aiohttp
import httpx
import pytest
from openai.types.responses import ResponseErrorEvent

from router.stored_responses import ResponseOwners
from scheduler.tls import PeerContext
from tests.router.procs import series_value, sim_stack, start_gateway

INSTRUCTIONS = "be brief"


@pytest.fixture(scope="module")
def stack():
    with sim_stack(3, scheduler_flags=("--policy", "round_robin"), gateway_flags=("--debug-headers",)) as s:
        yield s


def _respond(gw: str, text: str, previous: str | None = None, stream: bool = False) -> tuple[dict, str]:
    """(the response object, the worker that answered)."""
    body = {"model": "m", "input": text, "instructions": INSTRUCTIONS, "max_output_tokens": 4,
            "stream": stream}
    if previous is not None:
        body["previous_response_id"] = previous
    if not stream:
        r = httpx.post(gw + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json(), r.headers["x-router-worker"]
    with httpx.stream("POST", gw + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        return events[-1]["response"], r.headers["x-router-worker"]


def test_a_conversation_stays_on_the_worker_that_stores_it(stack):
    first, home = _respond(stack.gateway, "hello")
    # Round robin spreads whatever is not pinned.
    assert len({_respond(stack.gateway, "hi")[1] for _ in range(3)}) == 3
    last = first
    for turn in range(4):
        answer, where = _respond(stack.gateway, f"and then {turn}?", last["id"], stream=turn % 2 == 1)
        assert where == home
        assert answer["previous_response_id"] == last["id"]
        # The worker answered the whole conversation: its prompt grew by the last turn.
        assert answer["usage"]["input_tokens"] > last["usage"]["input_tokens"]
        last = answer


@pytest.mark.parametrize("stream", [False, True])
def test_a_follow_up_tells_the_scheduler_the_conversation_so_far(stack, stream):
    """The first turn's input and output tokens (from its body, or its stream's usage) are KV
    the follow-up takes on its worker: the scheduler is told (its reason shows them)."""
    first, _ = _respond(stack.gateway, "hello", stream=stream)
    body = {"model": "m", "input": "more", "max_output_tokens": 2, "previous_response_id": first["id"]}
    r = httpx.post(stack.gateway + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200
    reason = json.loads(r.headers["x-router-reason"])
    assert reason["cached_tokens"] == first["usage"]["input_tokens"] + first["usage"]["output_tokens"]


def test_get_and_cancel_reach_the_owner_and_unknown_ids_are_404(stack):
    first, home = _respond(stack.gateway, "hello", stream=True)
    for _ in range(3):  # from any gateway call, never from a worker that does not hold it
        r = httpx.get(f"{stack.gateway}/v1/responses/{first['id']}", timeout=10)
        assert r.status_code == 200 and r.headers["x-router-worker"] == home
        assert r.json()["id"] == first["id"] and r.json()["output"] == first["output"]
    r = httpx.post(f"{stack.gateway}/v1/responses/{first['id']}/cancel", timeout=10)
    assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]
    r = httpx.get(f"{stack.gateway}/v1/responses/resp_nobody", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "Response with id 'resp_nobody' not found.",
                                 "type": "invalid_request_error", "param": "response_id", "code": 404}
    r = httpx.post(stack.gateway + "/v1/responses", timeout=10,
                   json={"model": "m", "input": "more", "previous_response_id": "resp_nobody"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_a_response_deleted_through_the_gateway_is_forgotten_there(stack):
    """DELETE reaches the worker that stores the response; the gateway then forgets where it
    was, so a follow-up is a 404 at once instead of one queued for that worker."""
    first, home = _respond(stack.gateway, "hello")
    r = httpx.delete(f"{stack.gateway}/v1/responses/{first['id']}", timeout=10)
    assert r.status_code == 200 and r.headers["x-router-worker"] == home
    assert r.json() == {"id": first["id"], "object": "response", "deleted": True}
    remembered = series_value(stack.gateway, LOOKUPS % "remembered", 0.0)
    missing = series_value(stack.gateway, LOOKUPS % "missing", 0.0)
    r = httpx.post(stack.gateway + "/v1/responses", timeout=10,
                   json={"model": "m", "input": "more", "previous_response_id": first["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert series_value(stack.gateway, LOOKUPS % "remembered", 0.0) == remembered
    assert series_value(stack.gateway, LOOKUPS % "missing") == missing + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_follow_up_its_worker_answers_404_marks_the_response_lost(stack, stream):
    """The worker no longer holds the response (restarted, evicted, deleted behind the
    gateway's back): the pinned follow-up gets a 404 that says it was lost with that worker,
    and the gateway remembers it so, so the next follow-up is not pinned (and queued) to that
    worker again, nor looked for on every worker, and gets the same answer
    (tests/router/test_lost_responses.py has the worker restarted for real)."""
    first, home = _respond(stack.gateway, "hello")
    r = httpx.delete(f"http://{home}/v1/responses/{first['id']}", timeout=10)  # not through the gateway
    assert r.status_code == 200
    body = {"model": "m", "input": "more", "previous_response_id": first["id"], "stream": stream}
    remembered = series_value(stack.gateway, LOOKUPS % "remembered", 0.0)
    r = httpx.post(stack.gateway + "/v1/responses", timeout=10, json=body)
    assert r.status_code == 404 and r.headers["x-router-worker"] == home
    error = r.json()["error"]
    assert error["code"] == "response_lost" and error["param"] == "previous_response_id"
    assert f"lost with worker '{home}'" in error["message"]
    assert series_value(stack.gateway, LOOKUPS % "remembered") == remembered + 1
    missing = series_value(stack.gateway, LOOKUPS % "missing", 0.0)
    lost = series_value(stack.gateway, LOOKUPS % "lost", 0.0)
    r = httpx.post(stack.gateway + "/v1/responses", timeout=10, json=body)
    assert r.status_code == 404 and r.json()["error"] == error
    assert series_value(stack.gateway, LOOKUPS % "remembered") == remembered + 1
    assert series_value(stack.gateway, LOOKUPS % "missing", 0.0) == missing
    assert series_value(stack.gateway, LOOKUPS % "lost") == lost + 1


def test_another_gateway_finds_the_owner_by_asking_the_workers(stack):
    first, home = _respond(stack.gateway, "hello")
    proc, other = start_gateway("--scheduler", stack.scheduler)
    try:
        r = httpx.get(f"{other}/v1/responses/{first['id']}", timeout=10)
        assert r.status_code == 200 and r.headers["x-router-worker"] == home
        for _ in range(3):
            assert _respond(other, "more", first["id"])[1] == home
        # Asked once, remembered since.
        lookups = 'router_stored_response_lookups_total{result="%s"}'
        assert series_value(other, lookups % "found") == 1
        assert series_value(other, lookups % "remembered") == 3
        assert series_value(other, lookups % "missing", 0.0) == 0
    finally:
        proc.stop()


def test_without_the_scheduler_the_pin_holds(stack):
    proc, static = start_gateway("--workers", ",".join(stack.workers))
    try:
        first, home = _respond(static, "hello")
        answers = [_respond(static, "more", first["id"]) for _ in range(3)]
        assert {where for _, where in answers} == {home}
        assert all(a["previous_response_id"] == first["id"] for a, _ in answers)
    finally:
        proc.stop()


async def test_asking_the_workers_finds_the_owner_and_the_conversations_length(stack):
    """What a gateway that never saw the response learns from the workers: which one stores
    it, and its input plus output tokens (KV the next turn takes there again)."""
    first, home = _respond(stack.gateway, "hello")
    owners = ResponseOwners()
    workers = [(url.removeprefix("http://"), url) for url in stack.workers]
    async with aiohttp.ClientSession() as session:
        owner = await owners.locate(first["id"], workers, session, PeerContext(), {})
        assert owner is not None and owner.worker_id == home
        assert owner.tokens == first["usage"]["input_tokens"] + first["usage"]["output_tokens"] > 0
        assert owners.get(first["id"]) == owner
        assert await owners.locate("resp_nobody", workers, session, PeerContext(), {}) is None


LOOKUPS = 'router_stored_response_lookups_total{result="%s"}'


def _poll_until_done(gw: str, response_id: str, home: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.get(f"{gw}/v1/responses/{response_id}", timeout=10)
        assert r.status_code == 200 and r.headers["x-router-worker"] == home
        if r.json()["status"] not in ("queued", "in_progress"):
            return r.json()
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still running after 30 s")


def test_a_background_response_is_polled_on_its_worker_and_continued_there(stack):
    body = {"model": "m", "input": "hello", "max_output_tokens": 100, "ignore_eos": True, "background": True}
    r = httpx.post(stack.gateway + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["usage"] is None
    home = r.headers["x-router-worker"]
    done = _poll_until_done(stack.gateway, r.json()["id"], home)
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 100  # ran to its max
    follow = {"model": "m", "input": "more", "max_output_tokens": 2, "previous_response_id": done["id"]}
    r = httpx.post(stack.gateway + "/v1/responses", json=follow, timeout=30)
    assert r.status_code == 200 and r.headers["x-router-worker"] == home
    # The conversation's length was learnt from the finished response that GET brought back.
    reason = json.loads(r.headers["x-router-reason"])
    assert reason["cached_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]


def _events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_a_background_stream_is_resumed_through_the_gateway_after_its_client_left(stack):
    body = {"model": "m", "input": "hello", "max_output_tokens": 300, "ignore_eos": True,
            "background": True, "stream": True}
    found = series_value(stack.gateway, LOOKUPS % "found", 0.0)
    seen: list[dict] = []
    with httpx.stream("POST", stack.gateway + "/v1/responses", json=body, timeout=30) as r:
        home = r.headers["x-router-worker"]
        lines = r.iter_lines()
        while len(seen) < 6:
            line = next(lines)
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
    response_id = seen[0]["response"]["id"]
    after = seen[-1]["sequence_number"]
    with httpx.stream("GET", f"{stack.gateway}/v1/responses/{response_id}", timeout=30,
                      params={"stream": "true", "starting_after": after}) as r:
        assert r.status_code == 200 and r.headers["x-router-worker"] == home
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        rest = _events([next(lines)])
        # Relayed as it comes: the first event is here while the answer is still being made.
        status = httpx.get(f"{stack.gateway}/v1/responses/{response_id}", timeout=10).json()["status"]
        assert status == "in_progress"
        rest += _events(lines)
    events = seen + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["usage"]["output_tokens"] == 300
    # The gateway knew the worker from the stream its client had left, without asking around.
    assert series_value(stack.gateway, LOOKUPS % "found", 0.0) == found


def test_a_replay_whose_worker_dies_ends_with_openais_error_event():
    """The replay's worker killed mid-way: the stream ends with a Responses `error` event that
    the SDK reads (numbered after the last event), not a chat-style error and `[DONE]`. Its
    message names the worker and says what failed in words, not as the HTTP library's
    exception (real vLLM 0.32 cuts a replay of a response that is not a background one so)."""
    with sim_stack(1, "--time-scale", "5") as own:
        body = {"model": "m", "input": "hello", "max_output_tokens": 450, "ignore_eos": True,
                "background": True}
        r = httpx.post(own.gateway + "/v1/responses", json=body, timeout=30)
        response_id, worker_id = r.json()["id"], r.headers["x-router-worker"]
        events: list[tuple[str, dict]] = []
        name = ""
        with httpx.stream("GET", f"{own.gateway}/v1/responses/{response_id}", params={"stream": "true"},
                          timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
                    if len(events) == 8:
                        next(iter(own.workers.values())).kill()
    name, last = events[-1]
    assert name == "error"
    error = ResponseErrorEvent.model_validate(last)
    assert error.code == "upstream_error"
    assert error.message.startswith(f"worker {worker_id!r} ") and "mid-stream" in error.message
    assert "Error(" not in error.message, error.message  # no exception repr
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))


def test_a_background_response_is_cancelled_on_its_worker(stack):
    body = {"model": "m", "input": "hello", "max_output_tokens": 450, "ignore_eos": True, "background": True}
    r = httpx.post(stack.gateway + "/v1/responses", json=body, timeout=30)
    response_id, home = r.json()["id"], r.headers["x-router-worker"]
    r = httpx.post(f"{stack.gateway}/v1/responses/{response_id}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert r.headers["x-router-worker"] == home
    assert _poll_until_done(stack.gateway, response_id, home)["status"] == "cancelled"


def test_a_follow_up_whose_worker_is_down_fails_instead_of_going_elsewhere(stack):
    first, home = _respond(stack.gateway, "hello")
    stack.workers[f"http://{home}"].kill()  # worker ids are host:port here
    r = httpx.post(stack.gateway + "/v1/responses", timeout=30,
                   json={"model": "m", "input": "more", "previous_response_id": first["id"]})
    # Retryable, whether the scheduler saw it down or the gateway's own try failed first: the
    # worker is still in the pool, and may come back with it (tests/router/test_lost_responses.py).
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
    assert home in r.json()["error"]["message"]

