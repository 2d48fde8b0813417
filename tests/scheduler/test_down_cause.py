"""Why a worker is down (WorkerView.down_cause): the cause of its latest failure. A gateway
leaves the answers on a worker down "refused" to finish (a draining worker closed its port)
and gives up those on one down for anything else (it may be hung): router/down_watch.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from scheduler.app import build_app
from scheduler.config import SchedulerConfig
from scheduler.discovery.static import add_static_workers
from scheduler.health import DOWN, HALF_OPEN, UP, Health
from scheduler.policies import Request
from scheduler.protocol import CONNECTION_FAILED, DRAINING, FAILING, REFUSED, UNRESPONSIVE, WorkerView
from scheduler.service import SchedulerService, cause_of_report
from tests.scheduler.helpers import make_service, worker
from tests.scheduler.test_scrape_http import StandIn, _until, scraping


def _up() -> Health:
    h = Health()
    h.on_success(0.0, 1)
    return h


def test_a_worker_not_down_has_no_down_cause():
    h = _up()
    h.on_failure("ClientConnectorError", 3, True, REFUSED)  # one refusal: still up
    assert h.state == UP and h.down_cause is None


def test_the_failure_that_takes_a_worker_out_is_its_cause():
    h = _up()
    for _ in range(3):
        h.on_failure("ClientConnectorError", 3, True, REFUSED)
    assert h.state == DOWN and h.down_cause == REFUSED
    h = _up()
    assert h.force_down("gateway: connect", CONNECTION_FAILED) and h.down_cause == CONNECTION_FAILED


def test_the_latest_failure_while_down_replaces_the_cause():
    """A refused port that then times out (its host went away) may hang what it holds: the
    latest failure says what the worker is now."""
    h = _up()
    h.force_down("gateway: connect (refused)", REFUSED)
    h.on_failure("metrics and health timeout", 3, False, UNRESPONSIVE)
    assert h.down_cause == UNRESPONSIVE
    h.on_failure("ClientConnectorError", 3, True, REFUSED)
    assert h.down_cause == REFUSED


def test_an_error_answer_while_down_does_not_turn_a_refused_worker_into_a_hung_one():
    """A draining worker answers 503 to requests gateways send on kept-alive connections after
    its port closed: it answers, so it is no more hung than its refused port said."""
    svc = make_service(n=2, config={"failure_report_streak": 1})
    svc.report_failure("w1", "connect", refused=True)
    svc.report_failure("w1", "http_503")
    assert worker(svc, "w1").health.down_cause == REFUSED
    svc.report_failure("w1", "timeout")  # but a request it took and never answered: maybe hung
    assert worker(svc, "w1").health.down_cause == UNRESPONSIVE


def test_silence_is_unresponsive_unless_the_failures_since_the_last_success_say_otherwise():
    h = _up()
    assert h.check_silence(11.0, 10.0) and h.down_cause == UNRESPONSIVE
    h = _up()  # refusals under a fail streak too long to take it out first
    h.on_failure("ClientConnectorError", 100, True, REFUSED)
    assert h.check_silence(11.0, 10.0) and h.down_cause == REFUSED


def test_a_failed_trial_carries_its_cause_and_an_unknown_cause_is_none():
    h = _up()
    h.force_down("gateway: connect")  # no cause given: unknown (a gateway takes it for hung)
    assert h.state == DOWN and h.down_cause is None
    h.on_success(1.0, 1)
    assert h.state == HALF_OPEN and h.down_cause is None
    assert h.trial_result(False, UNRESPONSIVE) and h.down_cause == UNRESPONSIVE


@pytest.mark.parametrize(("kind", "refused", "cause"), [
    ("connect", True, REFUSED),
    ("connect", False, CONNECTION_FAILED),  # a connect error of another kind, or an older gateway
    ("connection", False, CONNECTION_FAILED),
    ("empty_stream", False, CONNECTION_FAILED),
])
def test_a_gateways_connection_failure_report_names_the_cause(kind, refused, cause):
    svc = make_service(n=2)
    assert svc.report_failure("w1", kind, refused)
    w1 = worker(svc, "w1")
    assert w1.health.state == DOWN and w1.health.down_cause == cause
    assert WorkerView(**w1.view(time.monotonic())).down_cause == cause
    assert worker(svc, "w0").view(time.monotonic())["down_cause"] is None


@pytest.mark.parametrize(("kind", "cause"), [("timeout", UNRESPONSIVE), ("http_500", FAILING)])
def test_a_streak_of_failed_requests_names_its_cause(kind, cause):
    svc = make_service(n=2, config={"failure_report_streak": 2})
    svc.report_failure("w1", kind)
    svc.report_failure("w1", kind)
    assert worker(svc, "w1").health.down_cause == cause


@pytest.mark.parametrize(("kind", "refused", "cause"), [
    ("draining", False, DRAINING),
    ("connect", True, REFUSED),
    ("connect", False, CONNECTION_FAILED),
    ("timeout", False, UNRESPONSIVE),
    ("worker_down", False, UNRESPONSIVE),
    ("http_503", False, FAILING),  # an older gateway's kind for a draining worker's 503 too
    ("http_500", False, FAILING),
    (None, False, FAILING),
])
def test_each_failure_kind_names_its_cause(kind, refused, cause):
    assert cause_of_report(kind, refused) == cause


def _placed(svc: SchedulerService, exclude: frozenset[str] | None = None) -> str:
    """The worker a request is placed on now (its lease is left open)."""
    out = svc.decide(Request("m", 10, 10, exclude=exclude), time.monotonic())
    assert isinstance(out, dict), out
    return out["worker_id"]


def test_one_draining_report_takes_the_worker_out_at_once_and_stays_its_cause():
    """A worker that answers 503 `shutting_down` takes no new request: the first such report
    takes it out (no streak), as draining, which no error answer then turns into failing."""
    svc = make_service("round_robin", n=2)  # failure_report_streak 3
    assert svc.report_failure("w1", "draining")
    h = worker(svc, "w1").health
    assert h.state == DOWN and h.down_cause == DRAINING
    assert {_placed(svc) for _ in range(6)} == {"w0"}
    for _ in range(3):  # more of the same, and an older gateway's reports of it
        svc.report_failure("w1", "draining")
        svc.report_failure("w1", "http_503")
    assert h.down_cause == DRAINING
    svc.report_failure("w1", "connect", refused=True)  # its port closed at the end of its drain
    assert h.down_cause == REFUSED


def test_three_shutting_down_reports_from_an_older_gateway_still_read_failing():
    """Today's behaviour for a gateway that does not know the kind: its three "http_503"
    reports make the worker failing."""
    svc = make_service(n=2)
    for _ in range(3):
        svc.report_failure("w1", "http_503")
    assert worker(svc, "w1").health.down_cause == FAILING


def test_a_half_open_workers_trial_that_finds_it_draining_puts_it_back_draining():
    """vLLM's drain keeps its port open and its /metrics answering: the worker comes back half
    open, and its trial request gets the 503 again. The lease's release says "draining" (and
    may come before the failure report): the worker goes down draining, never failing."""
    svc = make_service("round_robin", n=2)
    w1 = worker(svc, "w1")
    svc.report_failure("w1", "draining")
    assert w1.health.on_success(time.monotonic(), 1)
    svc.on_health_change(w1)
    assert w1.health.state == HALF_OPEN
    trial = svc.decide(Request("m", 10, 10, exclude=frozenset({"w0"})), time.monotonic())
    assert isinstance(trial, dict) and trial["worker_id"] == "w1"
    assert svc.release(trial["lease_id"], ok=False, error="draining")
    assert w1.health.state == DOWN and w1.health.down_cause == DRAINING


async def test_the_failure_endpoint_reads_refused_and_an_older_gateways_report_still_works():
    svc = make_service(n=2)
    async with TestClient(TestServer(build_app(svc))) as c:
        r = await c.post("/v1/workers/w0/failure", json={"error": "connect", "refused": True})
        assert r.status == 204
        r = await c.post("/v1/workers/w1/failure", json={"error": "connect"})  # no "refused"
        assert r.status == 204
        views = {v["worker_id"]: v for v in (await (await c.get("/v1/workers")).json())["workers"]}
    assert (views["w0"]["state"], views["w0"]["down_cause"]) == (DOWN, REFUSED)
    assert (views["w1"]["state"], views["w1"]["down_cause"]) == (DOWN, CONNECTION_FAILED)


async def test_the_failure_endpoint_and_the_worker_list_show_a_draining_worker():
    svc = make_service(n=2)
    async with TestClient(TestServer(build_app(svc))) as c:
        r = await c.post("/v1/workers/w1/failure", json={"error": "draining"})
        assert r.status == 204
        views = {v["worker_id"]: v for v in (await (await c.get("/v1/workers")).json())["workers"]}
    assert (views["w1"]["state"], views["w1"]["down_cause"]) == (DOWN, DRAINING)
    assert views["w1"]["last_error"] == "gateway: draining"
    assert (views["w0"]["state"], views["w0"]["down_cause"]) == (UP, None)


def test_a_list_without_down_cause_reads_as_none():
    """An older scheduler's view: the gateway treats its down workers as it always did."""
    view = WorkerView(worker_id="w", url="http://w", healthy=False, state=DOWN)
    assert view.down_cause is None


async def test_a_worker_whose_port_closes_is_scraped_down_refused():
    """A draining worker closes its listener (as one whose process is gone): the scrapes'
    connections are refused."""
    stand_in = StandIn("vllm-0.32-cpu-idle.txt", "m")
    runner = await stand_in.start()
    svc = SchedulerService(SchedulerConfig(scrape_interval_ms=50, scrape_timeout_ms=500))
    add_static_workers(svc, [stand_in.url])
    [w] = svc.registry.workers.values()
    async with scraping([svc], []):
        await _until(lambda: w.health.state == UP)
        await runner.cleanup()  # nothing listens; the kept-alive connection closes too
        await _until(lambda: w.health.state == DOWN)
        # Refused from the first new connection on (the kept-alive one may end as a reset).
        await _until(lambda: w.health.down_cause == REFUSED)
        assert w.health.last_error == "ClientConnectorError"


async def test_a_worker_that_takes_connections_and_answers_nothing_is_down_unresponsive():
    """A hung worker (its process stopped, a stuck GPU): metrics and health probes time out,
    and it goes down for its silence."""
    stand_in = StandIn("vllm-0.32-cpu-idle.txt", "m")
    hung = False

    async def health(request: web.Request) -> web.Response:
        if hung:
            await asyncio.sleep(10)
        return web.Response(text="ok")

    stand_in.health = health  # type: ignore[method-assign]
    runner = await stand_in.start()
    svc = SchedulerService(SchedulerConfig(scrape_interval_ms=50, scrape_timeout_ms=200, dead_after_ms=600))
    add_static_workers(svc, [stand_in.url])
    [w] = svc.registry.workers.values()
    async with scraping([svc], [runner]):
        await _until(lambda: w.health.state == UP)
        hung, stand_in.stall_s = True, 10.0
        await _until(lambda: w.health.state == DOWN)
        assert w.health.down_cause == UNRESPONSIVE, w.health.last_error
