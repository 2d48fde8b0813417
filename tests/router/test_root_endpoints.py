"""vLLM's endpoints outside /v1 through the gateway, with real processes on 127.0.0.1.

/tokenize and /detokenize generate nothing: they go to a worker of the body's model without a
lease, so they are answered at once while every worker is saturated and requests queue. The
pooling endpoints (/pooling, /classify, /score, /rerank, /v2/rerank) run the model: they are
routed as /v1/embeddings is, leased and queued.

Two gateways share the workers: one scheduled (a scheduler that admits one running request
per worker, so a single slow request saturates the pool), one in fallback mode (round robin
over --workers, the first of which is dead, under a base path)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router.procs import (
    Proc,
    free_port,
    series_value,
    start_echo_worker,
    start_gateway,
    start_scheduler,
    start_sim_worker,
)

BASE = "/api/llm"
POOLING = ("/pooling", "/classify", "/score", "/rerank", "/v2/rerank")
# ~400 decode steps of ~6 ms on the tiny sim profile: the one running request holds the pool.
SLOW = {"model": "m", "prompt": "hold the pool", "max_tokens": 400}


@pytest.fixture(scope="module")
def stack():
    procs: list[Proc] = []
    try:
        sim, sim_url = start_sim_worker("m")
        procs.append(sim)
        echo, echo_url = start_echo_worker("pool")
        procs.append(echo)
        s, su = start_scheduler([sim_url], "--scrape-interval-ms", "100",
                                "--policy-params", '{"max_running": 1}')
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--max-queue-size", "4")
        procs.append(g)
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
        fb, fbu = start_gateway("--workers", f"{dead},{sim_url},{echo_url}", "--base-path", BASE)
        procs.append(fb)
        deadline = time.monotonic() + 30
        # Until both gateways know the models, a made-up one is not yet unknown to them.
        while {m["id"] for m in httpx.get(fbu + "/v1/models").json()["data"]} != {"m", "pool"} or \
                [m["id"] for m in httpx.get(gu + "/v1/models").json()["data"]] != ["m"]:
            assert time.monotonic() < deadline, "the gateways never listed the models"
            time.sleep(0.1)
        yield {"gw": gu, "fallback": fbu + BASE, "scheduler": su, "sim": sim_url, "echo": echo_url,
               "gw_proc": g}
    finally:
        for p in procs:
            p.stop()


def _leases(scheduler: str) -> int:
    return sum(w["in_flight_leases"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"])


def _decisions(scheduler: str) -> float:
    text = httpx.get(scheduler + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("scheduler_decisions_total{"))


def _wait(cond, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("gateway", ["gw", "fallback"])
def test_tokenize_and_detokenize_give_the_workers_answer(stack, gateway):
    gw = stack[gateway]
    decisions = _decisions(stack["scheduler"])
    for body in ({"model": "m", "prompt": "Hello, world"},
                 {"model": "m", "messages": [{"role": "user", "content": "hi there"}]}):
        own = httpx.post(stack["sim"] + "/tokenize", json=body).json()
        # Several times: the fallback gateway's round robin meets its dead worker on the way.
        for _ in range(3):
            r = httpx.post(gw + "/tokenize", json=body)
            assert r.status_code == 200, r.text
            assert r.json() == own and own["count"] == len(own["tokens"]) > 0
            assert r.headers["x-router-worker"] and r.headers["x-request-id"]
        back = httpx.post(gw + "/detokenize", json={"model": "m", "tokens": own["tokens"]})
        assert back.status_code == 200
        assert back.json() == httpx.post(stack["sim"] + "/detokenize",
                                         json={"model": "m", "tokens": own["tokens"]}).json()
    # No schedule call was made for them: the scheduler decided nothing.
    assert _decisions(stack["scheduler"]) == decisions


def test_counted_in_the_request_metrics_and_access_log(stack):
    gw = stack["gw"]
    r = httpx.post(gw + "/tokenize", json={"model": "m", "prompt": "count me"},
                   headers={"X-Request-Id": "tok-count-1"})
    assert r.status_code == 200
    series = f'router_requests_total{{model="m",status="200",worker="{r.headers["x-router-worker"]}"}}'
    e2e = 'router_e2e_request_latency_seconds_count{model="m"}'
    before, e2e_before = series_value(gw, series), series_value(gw, e2e, 0.0)
    assert httpx.post(gw + "/detokenize", json={"model": "m", "tokens": [1, 2]}).status_code == 200
    assert series_value(gw, series) == before + 1
    # No latency figures: they would read as generation requests of a few microseconds.
    assert series_value(gw, e2e, 0.0) == e2e_before
    deadline = time.monotonic() + 5
    line = ""
    while not line and time.monotonic() < deadline:
        line = next((x for x in stack["gw_proc"].output().splitlines()
                     if "router.access: id=tok-count-1 " in x), "")
        time.sleep(0.05)
    assert "POST /tokenize model=m" in line and "status=200" in line, line


def test_answered_at_once_while_the_pool_is_saturated_and_requests_queue(stack):
    gw, scheduler = stack["gw"], stack["scheduler"]
    _wait(lambda: _leases(scheduler) == 0, "the pool idle")
    with ThreadPoolExecutor(3) as ex:
        running = ex.submit(httpx.post, gw + "/v1/completions", json=SLOW, timeout=60)
        _wait(lambda: _leases(scheduler) == 1, "the slow request leased")
        queued = ex.submit(httpx.post, gw + "/v1/completions", json=SLOW, timeout=60)
        _wait(lambda: httpx.get(gw + "/admin/state").json()["queued"] == 1, "a request queued")
        for _ in range(5):
            t0 = time.monotonic()
            r = httpx.post(gw + "/tokenize", json={"model": "m", "prompt": "no wait"}, timeout=10)
            assert r.status_code == 200 and r.json()["count"] > 0
            d = httpx.post(gw + "/detokenize", json={"model": "m", "tokens": r.json()["tokens"]})
            assert d.status_code == 200
            assert time.monotonic() - t0 < 1.0  # the slow request holds the pool for seconds
        # They took no lease and never stood in the queue.
        assert _leases(scheduler) == 1
        assert httpx.get(gw + "/admin/state").json()["queued"] == 1
        assert not running.done() and not queued.done()
        # A pooling root path runs the model: it waits in the queue like the completion.
        pooled = ex.submit(httpx.post, gw + "/score", json={"model": "m", "text_1": "a", "text_2": "b"},
                           timeout=60)
        _wait(lambda: httpx.get(gw + "/admin/state").json()["queued"] == 2, "the /score request queued")
        assert [f.result().status_code for f in (running, queued)] == [200, 200]
        # The sim worker serves no /score: its 404 comes back, from the worker it was placed on.
        answer = pooled.result()
        assert answer.headers.get("x-router-worker"), answer.text
        assert "error" in answer.json()


@pytest.mark.parametrize("gateway", ["gw", "fallback"])
@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_unknown_model_is_404_model_not_found(stack, gateway, path):
    r = httpx.post(stack[gateway] + path, json={"model": "no-such-model", "prompt": "x", "tokens": [1]})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"model": true, "prompt": "x"}', "model"),
        (b'{"model": 5, "prompt": "x"}', "model"),
        (b'{"model": "m"}', "prompt"),  # the worker's own 400: neither prompt nor messages
    ],
)
def test_bad_body_is_400_in_the_openai_shape(stack, content, param):
    r = httpx.post(stack["gw"] + "/tokenize", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/pooling", "/v2/rerank"])
def test_only_post(stack, path):
    r = httpx.get(stack["gw"] + path)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", POOLING)
def test_pooling_root_paths_reach_a_worker(stack, path):
    for _ in range(2):  # past the dead worker
        r = httpx.post(stack["fallback"] + path, json={"model": "pool", "input": "x"})
        assert r.status_code == 200, r.text
        assert r.json()["path"] == path and r.headers["x-router-worker"] == stack["echo"]


class _Sched:
    """What TokenizerCalls reads of Scheduling, in scheduled mode with a worker list."""

    def __init__(self, views: list[dict]) -> None:
        self.leasing = True
        self.worker_views = views
        self.worker_views_at = time.monotonic()
        self.refreshed = 0

    async def models(self, _max_age_s: float) -> list[str]:
        self.refreshed += 1
        return []


def _view(worker_id: str, state: str = "up", **extra) -> dict:
    return {"worker_id": worker_id, "url": f"http://127.0.0.1:{free_port()}", "models": ["m"],
            "healthy": state in ("up", "half_open"), "state": state, **extra}


async def test_scheduled_pick_is_round_robin_over_the_healthy_and_uncordoned():
    from router.fallback import NoWorkerError
    from router.tokenizer_calls import TokenizerCalls

    sched = _Sched([_view("a"), _view("trial", "half_open"), _view("b"), _view("off", cordoned=True),
                    _view("gone", "down"), {**_view("other"), "models": ["x"]}])
    calls = TokenizerCalls(sched, None, None, None, lambda *_: None)  # type: ignore[arg-type]
    firsts = [(await calls._pick("m", [])).worker_id for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]
    # Another after a failure, the one on trial last, then none: the model is served, so a 503.
    assert (await calls._pick("m", ["a"])).worker_id == "b"
    assert (await calls._pick("m", ["a", "b"])).worker_id == "trial"
    with pytest.raises(NoWorkerError) as exc:
        await calls._pick("m", ["a", "b", "trial"])
    assert not exc.value.unknown_model
    # A model no worker lists is unknown, after one more look at the scheduler's list.
    with pytest.raises(NoWorkerError) as exc:
        await calls._pick("nope", [])
    assert exc.value.unknown_model and sched.refreshed == 1


async def test_unreachable_workers_are_reported_and_tried_up_to_three_then_502():
    import aiohttp
    from aiohttp.test_utils import make_mocked_request

    from router.access_log import RequestRecord
    from router.tokenizer_calls import TokenizerCalls
    from scheduler.tls import PeerContext

    sched = _Sched([_view(w) for w in ("a", "b", "c", "d")])  # nothing listens at their ports
    reported: list[tuple[str, str, bool]] = []
    async with aiohttp.ClientSession() as session:
        calls = TokenizerCalls(sched, session, PeerContext(), aiohttp.ClientTimeout(total=5),
                               lambda route, reason, refused: reported.append(
                                   (route.worker_id, reason, refused)))
        rec = RequestRecord("id1", "POST", "/tokenize")
        rec.model = "m"
        answer = await calls.relay(make_mocked_request("POST", "/tokenize"), rec, "/tokenize",
                                   b'{"model": "m", "prompt": "x"}', {})
    assert answer.status == 502 and b"upstream_failed" in answer.body
    # Refused, and reported so: nothing listens there (the scheduler's down cause, not hung).
    assert [(reason, refused) for _, reason, refused in reported] == [("connect", True)] * 3
    assert len({worker for worker, _, _ in reported}) == 3 and rec.worker == reported[-1][0]
