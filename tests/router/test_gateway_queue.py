"""The admission queue with real parts: a scheduler that admits one running request per sim
worker (policy param max_running=1), two workers, and a gateway with a queue of 3."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import pytest

from tests.router.procs import series_value, start_gateway, start_scheduler, start_sim_workers

QUEUE = 3
SLOW = {"model": "m", "prompt": "a slow request", "max_tokens": 150}  # ~1 s on the tiny sim profile
_PROMPT_TOKENS = 4  # the sim worker's usage for SLOW's prompt (its tokenizer: ~4 characters a token)


@pytest.fixture(scope="module")
def cluster():
    procs = []
    try:
        (w1, u1), (w2, u2) = start_sim_workers(2)
        procs += [w1, w2]
        s, su = start_scheduler([u1, u2], "--policy-params", '{"max_running": 1}')
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--max-queue-size", str(QUEUE), "--debug-headers")
        procs.append(g)
        yield gu
    finally:
        for p in procs:
            p.stop()


def _served(gw: str) -> list[float]:
    """[end-to-end latencies observed, prompt tokens counted] for model m."""
    return [series_value(gw, 'router_e2e_request_latency_seconds_count{model="m"}', 0.0),
            series_value(gw, 'router_prompt_tokens_total{model="m"}', 0.0) / _PROMPT_TOKENS]


class QueueSampler:
    """Samples the gateway's queue length in a thread while a burst runs: its admin state and
    its router_requests_queued gauge (what the queue-depth alert and the dashboards read)."""

    def __init__(self, gw: str) -> None:
        self.gw = gw
        self.seen: list[int] = []
        self.gauge: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                self.seen.append(c.get(self.gw + "/admin/state").json()["queued"])
                self.gauge.append(series_value(self.gw, "router_requests_queued"))
                time.sleep(0.02)

    def __enter__(self) -> QueueSampler:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(10)


def _post(gw: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(gw + "/v1/completions", json=body, timeout=timeout)


def _wait_queue_empty(gw: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = httpx.get(gw + "/admin/state").json()
        if st["queued"] == 0 and st["in_flight"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"gateway still busy: {st}")


def _wait_leases(scheduler: str, n: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(scheduler + "/v1/workers").json()["workers"]
        if sum(w["in_flight_leases"] for w in workers) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"never saw {n} leases in flight")


def test_requests_beyond_capacity_wait_then_finish(cluster):
    _wait_queue_empty(cluster)
    with QueueSampler(cluster) as qs, ThreadPoolExecutor(5) as ex:
        rs = list(ex.map(lambda _: _post(cluster, SLOW), range(2 + QUEUE)))
    assert [r.status_code for r in rs] == [200] * (2 + QUEUE)
    assert max(qs.seen) == QUEUE  # three waited in the queue...
    # ...and the gauge counted all three, not only the head that was asking the scheduler.
    assert max(qs.gauge) == QUEUE and qs.gauge[-1] == 0
    waited = sorted(float(r.headers["x-router-queue-ms"]) for r in rs)
    # ...and were dispatched as capacity freed: the queued ones waited about one service time or more
    e2e_first = min(r.elapsed.total_seconds() for r in rs) * 1000
    assert sum(w > 0.5 * e2e_first for w in waited) >= QUEUE - 1


def test_overflow_gets_429_with_retry_after(cluster):
    _wait_queue_empty(cluster)
    served_before = _served(cluster)
    with ThreadPoolExecutor(8) as ex:
        futs = []
        for _ in range(2 + QUEUE + 3):
            futs.append(ex.submit(_post, cluster, SLOW))
            time.sleep(0.02)
        rs = [f.result() for f in futs]
    codes = sorted(r.status_code for r in rs)
    assert codes.count(429) == 3 and codes.count(200) == 2 + QUEUE, codes
    for r in rs:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
    # The refused requests are in router_requests_total only: their prompts are not input the
    # workers took, and their instant answers not latencies (they would pull the histograms
    # down exactly when the cluster is overloaded).
    assert _served(cluster) == [n + 2 + QUEUE for n in served_before]


def test_disconnect_while_queued_frees_the_place(cluster):
    _wait_queue_empty(cluster)
    waits_before = series_value(cluster, "router_queue_wait_seconds_count")
    waited_before = series_value(cluster, "router_queue_wait_seconds_sum")
    with ThreadPoolExecutor(8) as ex:
        running = [ex.submit(_post, cluster, SLOW) for _ in range(2)]
        _wait_leases(httpx.get(cluster + "/admin/state").json()["scheduler"], 2)
        # Three clients queue and give up after 0.3 s (their connections close).
        quitters = [ex.submit(_post, cluster, SLOW, 0.3) for _ in range(QUEUE)]
        for q in quitters:
            with pytest.raises(httpx.TimeoutException):
                q.result()
        deadline = time.monotonic() + 5
        while httpx.get(cluster + "/admin/state").json()["queued"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(cluster + "/admin/state").json()["queued"] == 0
        # Their waits are in the queue-wait histogram (the longest waits end this way; a
        # histogram of the placed alone would hide them). The two running were placed at once.
        assert series_value(cluster, "router_queue_wait_seconds_count") - waits_before == 2 + QUEUE
        assert series_value(cluster, "router_queue_wait_seconds_sum") - waited_before >= QUEUE * 0.25
        # The queue has room again: three more wait (no 429) and finish.
        later = [ex.submit(_post, cluster, {**SLOW, "max_tokens": 20}) for _ in range(QUEUE)]
        assert [f.result().status_code for f in running + later] == [200] * (2 + QUEUE)
    # No lease is left behind by the clients that left (a held schedule call they started
    # finishes in the background and its lease is given back).
    scheduler = httpx.get(cluster + "/admin/state").json()["scheduler"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if (
            sum(w["in_flight_leases"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"])
            == 0
        ):
            break
        time.sleep(0.05)
    assert (
        sum(w["in_flight_leases"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"]) == 0
    )


def test_queue_timeout_gets_429(cluster):
    """A second gateway on the same scheduler whose queue timeout is short."""
    _wait_queue_empty(cluster)
    scheduler = httpx.get(cluster + "/admin/state").json()["scheduler"]
    g, gu = start_gateway("--scheduler", scheduler, "--queue-timeout-ms", "300")
    try:
        with ThreadPoolExecutor(4) as ex:
            running = [ex.submit(_post, cluster, SLOW) for _ in range(2)]
            _wait_leases(scheduler, 2)  # both workers are busy now
            r = _post(gu, SLOW)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
            assert int(r.headers["Retry-After"]) >= 1
            # The wait that ended in the timeout is measured too.
            assert series_value(gu, "router_queue_wait_seconds_count") == 1
            assert series_value(gu, "router_queue_wait_seconds_sum") >= 0.3
            assert [f.result().status_code for f in running] == [200, 200]
    finally:
        g.stop()


def _timed_poster(gw: str, finished: dict[str, float]) -> Callable[[str, dict], int]:
    """post(name, body) to `gw`: its status, and when its answer came noted in `finished`."""
    def post(name: str, body: dict) -> int:
        status = _post(gw, body).status_code
        finished[name] = time.monotonic()
        return status
    return post


def _wait_queued(gw: str, n: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(gw + "/admin/state").json()["queued"] < n:
        assert time.monotonic() < deadline, f"never saw {n} queued"
        time.sleep(0.01)


def test_a_request_of_a_better_priority_overtakes_those_waiting(cluster):
    """vLLM's `priority` (lower first) orders the gateway's queue: an engine's priority
    scheduling would otherwise only see requests in the order the queue let them through."""
    _wait_queue_empty(cluster)
    scheduler = httpx.get(cluster + "/admin/state").json()["scheduler"]
    finished: dict[str, float] = {}

    def post(name: str, priority: int) -> int:
        status = _post(cluster, {**SLOW, "priority": priority}).status_code
        finished[name] = time.monotonic()
        return status

    with ThreadPoolExecutor(5) as ex:
        running = [ex.submit(post, f"running{i}", 0) for i in range(2)]
        _wait_leases(scheduler, 2)
        queued = [ex.submit(post, "head", 0)]  # asks the scheduler first, whatever comes later
        _wait_queued(cluster, 1)
        queued.append(ex.submit(post, "batch", 5))
        _wait_queued(cluster, 2)
        queued.append(ex.submit(post, "urgent", -1))
        assert [f.result() for f in running + queued] == [200] * 5
    assert finished["urgent"] < finished["batch"]
    # A WebSocket is placed once, by its first request's priority.
    finished.clear()

    def over_ws(name: str, priority: int) -> None:
        async def one() -> None:
            async with aiohttp.ClientSession() as session, session.ws_connect(cluster + "/v1/ws") as ws:
                await ws.send_str(json.dumps({**SLOW, "priority": priority}))
                while json.loads((await ws.receive(timeout=60)).data).get("type") != "done":
                    pass
        asyncio.run(one())
        finished[name] = time.monotonic()

    with ThreadPoolExecutor(5) as ex:
        running = [ex.submit(post, f"running{i}", 0) for i in range(2)]
        _wait_leases(scheduler, 2)
        queued = [ex.submit(post, "head", 0)]
        _wait_queued(cluster, 1)
        queued.append(ex.submit(post, "plain", 0))  # the default: a socket without priority ties
        _wait_queued(cluster, 2)
        queued.append(ex.submit(over_ws, "urgent", -1))
        for f in running + queued:
            f.result()
    assert finished["urgent"] < finished["plain"]
    r = _post(cluster, {**SLOW, "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_among_several_askers_freed_room_goes_to_the_better_priority(cluster):
    """With --queue-askers 2, two batch requests (priority 5) ask the scheduler; an urgent one
    (priority -1) asks once the first of them is placed. The scheduler holds both calls side by
    side: the next room must go to the urgent one, though the batch call was held first (the
    gateway sends the priority with its call)."""
    _wait_queue_empty(cluster)
    scheduler = httpx.get(cluster + "/admin/state").json()["scheduler"]
    # Long polls that outlast the test: a call that re-asks goes behind those held (arrival
    # order), which would hide the order under test.
    g, gu = start_gateway("--scheduler", scheduler, "--queue-askers", "2", "--schedule-wait-ms", "20000")
    finished: dict[str, float] = {}
    post = _timed_poster(gu, finished)

    try:
        with ThreadPoolExecutor(5) as ex:
            # The workers free up a second apart: one place at a time.
            running = [ex.submit(post, "short", SLOW), ex.submit(post, "long", {**SLOW, "max_tokens": 450})]
            _wait_leases(scheduler, 2)
            queued = [ex.submit(post, "batch1", {**SLOW, "priority": 5})]
            _wait_queued(gu, 1)
            queued.append(ex.submit(post, "batch2", {**SLOW, "priority": 5}))
            _wait_queued(gu, 2)
            queued.append(ex.submit(post, "urgent", {**SLOW, "priority": -1}))
            _wait_queued(gu, 3)
            assert [f.result() for f in running + queued] == [200] * 5
        # batch1 takes the first place (urgent was not asking yet); the next is urgent's.
        assert finished["batch1"] < finished["urgent"] < finished["batch2"]
    finally:
        g.stop()


def test_a_request_that_asks_again_keeps_its_place_among_the_held_calls(cluster):
    """Two gateway replicas, each with one request queued: "early" on a replica whose long
    polls run out every 300 ms (asked again each time), "late" on one whose poll outlasts the
    test. The freed room must go to "early", which arrived first, not to the call held longest
    (the gateway sends how long its request has waited)."""
    _wait_queue_empty(cluster)
    scheduler = httpx.get(cluster + "/admin/state").json()["scheduler"]
    ga, gau = start_gateway("--scheduler", scheduler, "--schedule-wait-ms", "300")
    gb, gbu = start_gateway("--scheduler", scheduler, "--schedule-wait-ms", "20000")
    finished: dict[str, float] = {}
    post, post_a, post_b = (_timed_poster(gw, finished) for gw in (cluster, gau, gbu))

    try:
        with ThreadPoolExecutor(4) as ex:
            running = [ex.submit(post, "short", SLOW), ex.submit(post, "long", {**SLOW, "max_tokens": 450})]
            _wait_leases(scheduler, 2)
            queued = [ex.submit(post_a, "early", SLOW)]
            _wait_queued(gau, 1)
            time.sleep(0.15)
            queued.append(ex.submit(post_b, "late", SLOW))
            _wait_queued(gbu, 1)
            assert [f.result() for f in running + queued] == [200] * 4
        assert finished["early"] < finished["late"]
    finally:
        ga.stop()
        gb.stop()


def test_a_request_waiting_behind_others_gets_its_timeout_on_time(cluster):
    """The queue timeout holds for a request that waits behind the one asking the scheduler:
    a batch request (priority 5) passed by a later urgent one (priority 0) got its 429 only when
    its turn came, after the later one had left, not when its own time was up."""
    _wait_queue_empty(cluster)
    scheduler = httpx.get(cluster + "/admin/state").json()["scheduler"]
    g, gu = start_gateway("--scheduler", scheduler, "--queue-timeout-ms", "1500")
    long_running = {**SLOW, "max_tokens": 450}  # outlasts every wait below
    finished: dict[str, tuple[float, httpx.Response]] = {}

    def post(name: str, gw: str, body: dict) -> None:
        r = _post(gw, body)
        finished[name] = (time.monotonic(), r)

    try:
        with ThreadPoolExecutor(5) as ex:
            running = [ex.submit(post, f"running{i}", cluster, long_running) for i in range(2)]
            _wait_leases(scheduler, 2)  # both workers are full
            queued = [ex.submit(post, "head", gu, SLOW)]  # asks the scheduler until its timeout
            _wait_queued(gu, 1)
            queued.append(ex.submit(post, "batch", gu, {**SLOW, "priority": 5}))
            _wait_queued(gu, 2)
            time.sleep(0.4)
            # Later, and of a better priority: it asks when the head leaves, ahead of "batch".
            queued.append(ex.submit(post, "urgent", gu, {**SLOW, "priority": 0}))
            _wait_queued(gu, 3)
            for f in running + queued:
                f.result()
        for name in ("head", "batch", "urgent"):
            r = finished[name][1]
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout", name
        # "batch" is refused when its own time is up, before "urgent", which came later (and
        # waited out its own timeout asking), is.
        assert finished["batch"][0] < finished["urgent"][0]
        assert series_value(gu, "router_requests_queued") == 0
        assert [finished[f"running{i}"][1].status_code for i in range(2)] == [200, 200]
    finally:
        g.stop()
