"""The scheduler's batch forms of schedule/release: `POST /v1/batch` and the WebSocket channel
`GET /v1/channel`, against a real scheduler process with stand-in echo workers, spoken to
with ordinary clients (httpx, aiohttp's WebSocket client), not the gateway's own."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import httpx
import pytest
from pydantic_core import from_json, to_json

from tests.router.procs import scheduler_over_two_echo_workers, start_echo_worker, start_scheduler


@pytest.fixture(scope="module")
def scheduler():
    yield from scheduler_over_two_echo_workers()


def _leases(base: str) -> int:
    return sum(w["in_flight_leases"] for w in httpx.get(base + "/v1/workers").json()["workers"])


def _worker_ids(base: str) -> list[str]:
    return [w["worker_id"] for w in httpx.get(base + "/v1/workers").json()["workers"]]


def test_batch_answers_every_operation_in_order(scheduler):
    base = _leases(scheduler)
    ops = [
        {"op": "schedule", "model": "m", "prompt_tokens": 5},
        {"op": "schedule", "model": "m", "prompt_tokens": 5, "max_tokens": 8},
        {"op": "schedule", "model": "no-such-model"},
        {"op": "schedule", "model": "m", "wait_ms": 100},  # held calls are not batchable
        {"op": "schedule", "model": "m", "prompt_tokens": -1},
        {"op": "frobnicate"},
        "not an object",
        {"op": ["release"]},  # not a name at all
    ]
    r = httpx.post(scheduler + "/v1/batch", json=ops)
    assert r.status_code == 200
    answers = r.json()
    assert [a[0] for a in answers] == [200, 200, 404, 400, 400, 400, 400, 400]
    d1, d2 = answers[0][1], answers[1][1]
    assert d1["lease_id"] != d2["lease_id"] and d1["url"].startswith("http://127.0.0.1:")
    assert answers[2][1]["error"]["code"] == "model_not_found"
    assert answers[3][1]["error"]["param"] == "wait_ms"
    assert answers[4][1]["error"]["param"] == "prompt_tokens"
    assert _leases(scheduler) == base + 2

    rel = [
        {"op": "release", "lease_id": d1["lease_id"], "ok": True, "output_tokens": 3},
        {"op": "release", "lease_id": d2["lease_id"], "ok": True},
        {"op": "release", "lease_id": d2["lease_id"], "ok": True},  # twice: unknown now
        {"op": "release", "ok": True},
    ]
    answers = httpx.post(scheduler + "/v1/batch", json=rel).json()
    assert [a[0] for a in answers] == [204, 204, 404, 400]
    assert answers[0][1] is None
    assert _leases(scheduler) == base


def test_batch_wait_answer_when_no_worker_is_eligible(scheduler):
    ops = [{"op": "schedule", "model": "m", "exclude": _worker_ids(scheduler)}]
    r = httpx.post(scheduler + "/v1/batch", json=ops)
    (status, payload), = r.json()
    assert status == 503 and payload["wait"] is True and payload["reason"] == "no_routable_worker"


@pytest.mark.parametrize("body", [b"{not json", b'{"op": "schedule", "model": "m"}', b"[1"])
def test_batch_rejects_a_body_that_is_not_an_array(scheduler, body):
    r = httpx.post(scheduler + "/v1/batch", content=body)
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_channel_answers_batches_with_a_schedule_and_not_release_only_ones(scheduler):
    base = _leases(scheduler)
    async with aiohttp.ClientSession() as s, s.ws_connect(scheduler + "/v1/channel") as ws:
        await ws.send_bytes(
            b'[{"op":"schedule","model":"m","prompt_tokens":3},{"op":"schedule","model":"nope"}]'
        )
        answers = (await asyncio.wait_for(ws.receive(), 5)).json()
        assert [a[0] for a in answers] == [200, 404]
        lease = answers[0][1]["lease_id"]
        assert _leases(scheduler) == base + 1
        # Releases only: no answer message. The next message answered is the next batch's.
        await ws.send_str(f'[{{"op":"release","lease_id":"{lease}","ok":true}}]')
        await ws.send_bytes(
            f'[{{"op":"release","lease_id":"{lease}","ok":true}},{{"op":"schedule","model":"m"}}]'.encode()
        )
        answers = (await asyncio.wait_for(ws.receive(), 5)).json()
        assert [a[0] for a in answers] == [404, 200]  # the lease was already given back
        await ws.send_str(f'[{{"op":"release","lease_id":"{answers[1][1]["lease_id"]}","ok":true}}]')
        await ws.send_str('[{"op":"schedule","model":"nope"}]')  # a barrier: answered after the release
        await asyncio.wait_for(ws.receive(), 5)
    assert _leases(scheduler) == base


async def test_channel_closes_on_a_message_that_is_not_an_array(scheduler):
    async with aiohttp.ClientSession() as s, s.ws_connect(scheduler + "/v1/channel") as ws:
        await ws.send_str('{"op":"schedule","model":"m"}')
        msg = await asyncio.wait_for(ws.receive(), 5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1007
    # The scheduler is fine afterwards.
    async with httpx.AsyncClient() as c:
        assert (await c.get(scheduler + "/health")).status_code == 200


async def test_channel_answers_of_every_frame_length_form_read_by_a_standard_client(scheduler):
    base = _leases(scheduler)
    wait = {"op": "schedule", "model": "m", "exclude": _worker_ids(scheduler)}  # a short answer
    cases = [([wait], 0, 126), ([{"op": "schedule", "model": "m"}] * 2, 126, 65536),
             ([{"op": "schedule", "model": "m"}] * 400, 65536, 1 << 30)]
    async with aiohttp.ClientSession() as s, s.ws_connect(scheduler + "/v1/channel") as ws:
        for ops, low, high in cases:
            await ws.send_bytes(to_json(ops))
            msg = await asyncio.wait_for(ws.receive(), 10)
            assert msg.type == aiohttp.WSMsgType.BINARY and low <= len(msg.data) < high
            answers = from_json(msg.data)
            assert len(answers) == len(ops)
            leases = [a[1]["lease_id"] for a in answers if a[0] == 200]
            assert len(leases) == (0 if ops[0] is wait else len(ops))
            await ws.send_bytes(to_json([{"op": "release", "lease_id": lid, "ok": True} for lid in leases]))
        await ws.send_bytes(b'[{"op":"schedule","model":"nope"}]')  # answered after the releases
        await asyncio.wait_for(ws.receive(), 5)
    assert _leases(scheduler) == base


async def test_scheduler_with_an_open_channel_stops_on_sigterm():
    # aiohttp waits for running handlers on shutdown (60 s by default); the scheduler closes
    # its channels (1001 going away) so that it exits now. The bound below is a timeout, far
    # above the expected time and below aiohttp's wait.
    w, u = start_echo_worker()
    s, su = start_scheduler([u], "--scrape-interval-ms", "100")
    try:
        async with aiohttp.ClientSession() as session, session.ws_connect(su + "/v1/channel") as ws:
            await ws.send_bytes(b'[{"op":"schedule","model":"m"}]')
            assert (await asyncio.wait_for(ws.receive(), 5)).json()[0][0] == 200
            s.p.send_signal(signal.SIGTERM)
            msg = await asyncio.wait_for(ws.receive(), 20)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.GOING_AWAY
        assert await asyncio.to_thread(s.p.wait, 30) == 0
    finally:
        s.stop()
        w.stop()


def test_prefilled_reports_in_a_batch_and_over_http(scheduler):
    ops = [{"op": "schedule", "model": "m", "prompt_tokens": 40} for _ in range(2)]
    (_, d1), (_, d2) = httpx.post(scheduler + "/v1/batch", json=ops).json()
    reports = [
        {"op": "prefilled", "lease_id": d1["lease_id"]},
        {"op": "prefilled", "lease_id": d1["lease_id"]},  # reported already
        {"op": "prefilled", "lease_id": "no-such-lease"},
        {"op": "prefilled"},
    ]
    answers = httpx.post(scheduler + "/v1/batch", json=reports).json()
    assert [a[0] for a in answers] == [204, 404, 404, 400]
    assert answers[3][1]["error"]["param"] == "lease_id"
    r = httpx.post(scheduler + "/v1/prefilled", json={"lease_id": d2["lease_id"]})
    assert r.status_code == 204
    r = httpx.post(scheduler + "/v1/prefilled", json={"lease_id": d2["lease_id"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lease_not_found"
    r = httpx.post(scheduler + "/v1/prefilled", content=b"{")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    metrics = httpx.get(scheduler + "/metrics").text
    assert 'scheduler_prefilled_reports_total{outcome="ok"} 2.0' in metrics
    rel = [{"op": "release", "lease_id": d["lease_id"], "ok": True} for d in (d1, d2)]
    assert [a[0] for a in httpx.post(scheduler + "/v1/batch", json=rel).json()] == [204, 204]


# Past float's range: the scheduler's arithmetic raised OverflowError on these (JSON ints have
# no size limit, and a gateway passes on a client's max_tokens and a worker's usage as they are).
HUGE = 10**400


def test_batch_takes_token_counts_of_any_size(scheduler):
    base = _leases(scheduler)
    ops = [{"op": "schedule", "model": "m", "prompt_tokens": HUGE},
           {"op": "schedule", "model": "m", "max_tokens": HUGE, "cached_tokens": HUGE},
           {"op": "schedule", "model": "m", "prompt_tokens": 5}]
    r = httpx.post(scheduler + "/v1/batch", content=to_json(ops))
    assert r.status_code == 200 and [a[0] for a in r.json()] == [200, 200, 200]
    rel = [{"op": "release", "lease_id": a[1]["lease_id"], "ok": True, "prompt_tokens": HUGE,
            "output_tokens": HUGE} for a in r.json()]
    r = httpx.post(scheduler + "/v1/batch", content=to_json(rel))
    assert r.status_code == 200 and [a[0] for a in r.json()] == [204, 204, 204]
    assert _leases(scheduler) == base


async def test_channel_answers_the_good_operations_of_a_batch_with_huge_counts_and_stays_open(scheduler):
    base = _leases(scheduler)
    async with aiohttp.ClientSession() as s, s.ws_connect(scheduler + "/v1/channel") as ws:
        ops = [{"op": "schedule", "model": "m", "prompt_tokens": 3},
               {"op": "schedule", "model": "m", "prompt_tokens": HUGE, "max_tokens": HUGE},
               {"op": "schedule", "model": "m", "prompt_tokens": -1}]
        await ws.send_bytes(to_json(ops))
        answers = (await asyncio.wait_for(ws.receive(), 5)).json()
        assert [a[0] for a in answers] == [200, 200, 400]
        leases = [a[1]["lease_id"] for a in answers[:2]]
        await ws.send_bytes(to_json([{"op": "release", "lease_id": lid, "ok": True, "output_tokens": HUGE}
                                     for lid in leases] + [{"op": "schedule", "model": "m"}]))
        answers = (await asyncio.wait_for(ws.receive(), 5)).json()
        assert [a[0] for a in answers] == [204, 204, 200]  # the channel is still open
        await ws.send_str(f'[{{"op":"release","lease_id":"{answers[2][1]["lease_id"]}","ok":true}}]')
        await ws.send_str('[{"op":"schedule","model":"nope"}]')  # a barrier: answered after the release
        await asyncio.wait_for(ws.receive(), 5)
    assert _leases(scheduler) == base


def test_channel_path_without_an_upgrade_is_an_openai_error(scheduler):
    r = httpx.get(scheduler + "/v1/channel")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_body_over_the_size_limit_is_an_openai_error(scheduler):
    r = httpx.post(scheduler + "/v1/batch", content=b"[" + b" " * (2 << 20) + b"]")
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_a_schedule_call_with_an_overlong_prefix_list_is_a_400(scheduler):
    """The gateway sends at most 64 fingerprints; a list past 4,096 is refused before it costs
    a decision (and the prefix index) anything."""
    r = httpx.post(scheduler + "/v1/schedule", json={"model": "m", "prefix_hashes": list(range(5000))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prefix_hashes"
    r = httpx.post(scheduler + "/v1/schedule", json={"model": "m", "prefix_hashes": list(range(64))})
    assert r.status_code in (200, 503), r.text
    if r.status_code == 200:
        httpx.post(scheduler + "/v1/release", json={"lease_id": r.json()["lease_id"], "ok": True})
