"""Cordoned workers (scheduler/cordons.py): an operator's maintenance mark. The real decision core
in process with synthetic scrapes (tests/scheduler/helpers.py), and the HTTP API in process for
its answers and auth (the same with real processes and a gateway: tests/router/test_cordon.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from scheduler.app import build_app
from scheduler.config import SchedulerConfig
from scheduler.cordons import MAX_REASON_CHARS, Cordons, clean_reason
from scheduler.health import HALF_OPEN
from scheduler.policies import Request
from scheduler.registry import WorkerState
from scheduler.service import SchedulerService, Wait
from tests.scheduler.helpers import feed, make_service, worker

TOKEN = "admin-7c1e"


def decide(svc: SchedulerService, **kw):
    return svc.decide(Request(kw.pop("model", "m"), kw.pop("prompt_tokens", 100), 16, **kw),
                      time.monotonic())


def placements(svc: SchedulerService, n: int, **kw) -> set[str]:
    """Where n requests go, each released before the next (so load does not decide)."""
    seen = set()
    for _ in range(n):
        out = decide(svc, **kw)
        assert isinstance(out, dict), out
        seen.add(out["worker_id"])
        assert svc.release(out["lease_id"], ok=True)
    return seen


def test_a_cordoned_worker_gets_no_new_request_and_uncordon_restores_it():
    svc = make_service(n=2)
    feed(svc, worker(svc, "w1"), running=5)  # the policy's favourite is w0: idle
    assert placements(svc, 4) == {"w0"}
    assert svc.cordon("w0", "driver upgrade") is not None
    assert placements(svc, 6) == {"w1"}
    assert svc.uncordon("w0") is not None
    assert placements(svc, 4) == {"w0"}


def test_requests_pinned_to_a_cordoned_worker_still_go_there():
    """A Responses API follow-up whose stored state lives only there, or a WebSocket's next
    request: no other worker can serve it."""
    svc = make_service(n=2)
    svc.cordon("w0")
    assert placements(svc, 3, pin="w0") == {"w0"}
    out = decide(svc, pin="w0", attach=True)  # a WebSocket's next request
    assert out["worker_id"] == "w0" and out["reason"]["attached"] is True
    # Pinned, yet not past the rules a pin keeps when uncordoned: excluded (it failed this
    # request), down, or not serving the model.
    assert isinstance(decide(svc, pin="w0", exclude=frozenset({"w0"})), Wait)
    worker(svc, "w0").health.force_down("connect")
    svc.on_health_change(worker(svc, "w0"))
    assert decide(svc, pin="w0").reason == "pinned_worker_unavailable"
    assert svc.decide(Request("other", 1, 1, pin="w0"), time.monotonic()) == "unknown_model"
    # Unpinned requests still avoid it, and the pinned ones did not put it back in the cache.
    assert placements(svc, 3) == {"w1"}


def test_every_worker_of_a_model_cordoned_is_no_routable_worker_not_an_unknown_model():
    """The gateway answers that with a 503 no_worker and Retry-After (retried by clients), as
    when every worker is down; a 404 model_not_found would tell clients to give up."""
    svc = make_service(n=2)
    svc.cordon("w0")
    svc.cordon("w1")
    out = decide(svc)
    assert isinstance(out, Wait) and out.reason == "no_routable_worker"
    svc.uncordon("w1")
    assert decide(svc)["worker_id"] == "w1"


def test_cordon_and_uncordon_are_idempotent_and_keep_the_first_cordon():
    svc = make_service(n=2)
    first = svc.cordon("w0", "first")
    assert first is not None and svc.cordon("w0", "second") is None
    assert svc.cordons.get("w0") == first  # its time and reason: how long it has been out
    assert svc.uncordon("w0") == first and svc.uncordon("w0") is None
    assert "w0" not in svc.cordons


def test_a_cordon_is_kept_by_id_across_the_worker_leaving_and_coming_back():
    """A worker that re-registers, or that discovery lists again, is a new WorkerState under the
    same id: it must stay cordoned."""
    svc = make_service(n=2)
    svc.cordon("w0")
    assert svc.remove_worker("w0")
    assert "w0" in svc.cordons and svc.cordons.views()["w0"]["since"]
    back = svc.add_worker(WorkerState("http://127.0.0.1:9000", worker_id="w0", models=["m"]))
    back.health.on_success(time.monotonic(), 1)
    feed(svc, back)
    assert placements(svc, 4) == {"w1"}
    assert placements(svc, 2, pin="w0") == {"w0"}
    svc.uncordon("w0")
    feed(svc, worker(svc, "w1"), running=5)
    assert placements(svc, 2) == {"w0"}


def test_requests_in_flight_on_a_cordoned_worker_finish_and_release_there():
    svc = make_service(n=2)
    feed(svc, worker(svc, "w1"), running=5)
    out = decide(svc)
    assert out["worker_id"] == "w0"
    svc.cordon("w0")
    assert worker(svc, "w0").in_flight == 1  # nothing is taken from it
    assert svc.release(out["lease_id"], ok=True)
    assert worker(svc, "w0").in_flight == 0


def test_a_cordoned_half_open_worker_gets_no_trial_until_uncordoned():
    svc = make_service(n=2, config={"recover_streak": 1})
    w0 = worker(svc, "w0")
    w0.health.force_down("connect")
    svc.on_health_change(w0)
    svc.cordon("w0")
    assert w0.health.on_success(time.monotonic(), 1)  # answering again: half open
    svc.on_health_change(w0)
    assert w0.health.state == HALF_OPEN
    assert placements(svc, 3) == {"w1"}  # no trial: the operator took it out
    svc.uncordon("w0")
    out = decide(svc)
    assert out["worker_id"] == "w0" and out["reason"]["trial"] is True


async def test_uncordon_wakes_a_call_held_while_every_worker_was_cordoned():
    svc = make_service(n=2)
    svc.cordon("w0")
    svc.cordon("w1")
    held = asyncio.ensure_future(svc.schedule(Request("m", 100, 16), wait_ms=5000))
    await asyncio.sleep(0.05)
    assert not held.done()
    svc.uncordon("w1")
    out = await asyncio.wait_for(held, 1.0)
    assert out["worker_id"] == "w1"


async def test_a_cordon_drops_the_follow_up_holds_there_and_makes_no_new_ones():
    cfg = SchedulerConfig(policy="llm_aware", followup_hold_ms=5000, visibility_lag_ms=0)
    svc = SchedulerService(cfg)
    for i in range(2):
        w = svc.add_worker(WorkerState(f"http://127.0.0.1:{9000 + i}", worker_id=f"w{i}", models=["m"]))
        w.health.on_success(time.monotonic(), 1)
        feed(svc, w, kv=0.5)
    first = svc.decide(Request("m", 800, 100, prefix_hashes=[1, 2]), time.monotonic())
    home = worker(svc, first["worker_id"])
    second = svc.decide(Request("m", 800, 100, prefix_hashes=[7, 8], pin=home.worker_id), time.monotonic())
    # A scrape taken after both were sent: their KV is in its usage, so it may be held on release.
    feed(svc, home, running=2, kv=0.5, taken_at=time.monotonic() + 0.01)
    assert svc.release(first["lease_id"], True, used_tokens=900)
    assert home.reserved_tokens == 900
    svc.cordon(home.worker_id)
    assert home.reserved_tokens == 0 and not svc.reservations.by_key
    assert svc.release(second["lease_id"], True, used_tokens=900)  # ends on the cordoned worker
    assert home.reserved_tokens == 0 and not svc.reservations.by_key


def test_the_workers_view_and_the_metric_show_the_cordon():
    svc = make_service(n=2)
    svc.cordon("w0", "suspected bad GPU")
    views = {v["worker_id"]: v for v in svc.workers_view()}
    assert views["w0"]["cordoned"] is True and views["w0"]["cordon_reason"] == "suspected bad GPU"
    assert views["w0"]["cordoned_since"].endswith("Z")
    assert views["w1"] | {"cordoned": False, "cordoned_since": None, "cordon_reason": None} == views["w1"]
    svc.remove_worker("w0")  # the cordon of an id no worker has now: still shown
    page = generate_latest(svc.metrics.registry).decode()
    assert 'scheduler_worker_cordoned{worker="w0"} 1.0' in page
    assert 'scheduler_worker_cordoned{worker="w1"} 0.0' in page
    svc.uncordon("w0")
    assert 'worker="w0"' not in generate_latest(svc.metrics.registry).decode()


def test_the_log_says_each_change(caplog):
    svc = make_service(n=2)
    with caplog.at_level("INFO", logger="scheduler.service"):
        svc.cordon("w0", "driver upgrade", by="10.0.0.9")
        svc.cordon("w0")  # no change, no line
        svc.uncordon("w0", by="10.0.0.9")
    lines = [r.getMessage() for r in caplog.records if "cordon" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "w0 cordoned by 10.0.0.9 (driver upgrade)" in lines[0] and "pinned" in lines[0]
    assert "w0 uncordoned by 10.0.0.9" in lines[1]


def test_reasons_are_bounded_and_cannot_forge_log_lines():
    assert clean_reason("a\nworker w1 is down") == "a\\nworker w1 is down"
    assert len(clean_reason("x" * 1000)) == MAX_REASON_CHARS
    assert clean_reason("") is None and clean_reason(None) is None
    assert not Cordons()


# ---- the HTTP API, in process --------------------------------------------------------------


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def client():
    svc = make_service(n=2, config={"admin_token": TOKEN + "\n"})  # as a Secret from a file gives it
    async with TestClient(TestServer(build_app(svc))) as c:
        c.svc = svc
        yield c


async def test_the_api_cordons_and_uncordons_idempotently(client):
    r = await client.post("/v1/workers/w0/cordon", json={"reason": "driver upgrade"}, headers=_auth(TOKEN))
    assert r.status == 200
    body = await r.json()
    assert body["cordoned"] is True and body["changed"] is True and body["known"] is True
    assert body["cordon_reason"] == "driver upgrade" and body["in_flight_leases"] == 0
    again = await (await client.post("/v1/workers/w0/cordon", headers=_auth(TOKEN))).json()
    assert again["changed"] is False and again["cordoned_since"] == body["cordoned_since"]
    listed = await (await client.get("/v1/workers")).json()
    assert [w["cordoned"] for w in listed["workers"]] == [True, False]
    assert list(listed["cordons"]) == ["w0"]
    for changed in (True, False):
        r = await client.post("/v1/workers/w0/uncordon", headers=_auth(TOKEN))
        body = await r.json()
        assert r.status == 200 and body | {"cordoned": False, "changed": changed} == body


async def test_the_api_refuses_unknown_workers_and_bad_bodies(client):
    r = await client.post("/v1/workers/nope/cordon", headers=_auth(TOKEN))
    assert r.status == 404 and (await r.json())["error"]["code"] == "worker_not_found"
    r = await client.post("/v1/workers/nope/uncordon", headers=_auth(TOKEN))
    assert r.status == 404
    r = await client.post("/v1/workers/w0/cordon", data=b"{", headers=_auth(TOKEN))
    assert r.status == 400 and "error" in await r.json()
    r = await client.post("/v1/workers/w0/cordon", json={"reason": 5}, headers=_auth(TOKEN))
    assert r.status == 400 and (await r.json())["error"]["param"] == "reason"
    assert not client.svc.cordons
    # A cordon of a worker that left can still be lifted (or it waits for the id to return).
    await client.post("/v1/workers/w0/cordon", headers=_auth(TOKEN))
    client.svc.remove_worker("w0")
    r = await client.post("/v1/workers/w0/uncordon", headers=_auth(TOKEN))
    assert r.status == 200 and (await r.json())["known"] is False


@pytest.mark.parametrize("headers", [{}, _auth("wrong"), {"Authorization": TOKEN}],
                         ids=["none", "wrong", "no-scheme"])
async def test_the_api_wants_the_admin_token(client, headers):
    for path in ("/v1/workers/w0/cordon", "/v1/workers/w0/uncordon", "/v1/workers/nope/cordon"):
        r = await client.post(path, headers=headers)
        assert r.status == 401, path
        err = (await r.json())["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_admin_token"
    assert not client.svc.cordons


async def test_the_api_is_refused_without_an_admin_token_configured():
    """Fail closed: 403 to everyone, whatever they send (the gateway token included)."""
    svc = make_service(n=2, config={"gateway_token": "gw"})
    async with TestClient(TestServer(build_app(svc))) as c:
        for headers in ({}, _auth("gw"), _auth("")):
            r = await c.post("/v1/workers/w0/cordon", headers=headers)
            assert r.status == 403
            assert (await r.json())["error"]["code"] == "admin_disabled"
    assert not svc.cordons


async def test_the_gateway_token_does_not_open_the_admin_api():
    svc = make_service(n=2, config={"gateway_token": "gw", "admin_token": TOKEN})
    async with TestClient(TestServer(build_app(svc))) as c:
        assert (await c.post("/v1/workers/w0/cordon", headers=_auth("gw"))).status == 401
        assert (await c.post("/v1/workers/w0/cordon", headers=_auth(TOKEN))).status == 200
