"""Rolling updates: a worker, or the gateway, gets SIGTERM while it streams answers.

Real processes: sim workers (tiny profile at --time-scale 5, ~32 ms per decode step, so a
200-token answer streams for ~6 s), the scheduler and the gateway. A stopping worker finishes
the streams it has while the requests sent meanwhile go to the others; a stopping gateway
finishes its streams too. No client sees an error."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx

from tests.router.procs import SimStack, series_value, sim_stack
from tests.router.stand_ins import open_leases, until

SLOW = ("--time-scale", "5")  # tiny profile: ~32 ms per decode step


def _stream(gw: str) -> dict:
    body = {"model": "m", "prompt": "a long answer", "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=60) as r:
        worker = r.headers["x-router-worker"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return {"worker": worker, "events": events}


def _busy_worker(scheduler: str) -> str:
    """The URL of a worker that holds a lease now."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for w in httpx.get(scheduler + "/v1/workers").json()["workers"]:
            if w["in_flight_leases"] > 0:
                return w["url"]
        time.sleep(0.02)
    raise AssertionError("no worker ever had a request in flight")


def test_a_worker_stopped_mid_stream_finishes_its_answers_and_new_requests_go_elsewhere():
    with sim_stack(3, *SLOW, gateway_flags=("--retry-count", "2")) as stack:
        gw, by_url = stack.gateway, stack.workers
        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(_stream, gw) for _ in range(6)]
            stopping = _busy_worker(stack.scheduler)
            time.sleep(0.3)  # its answers are under way
            by_url[stopping].p.send_signal(signal.SIGTERM)
            body = {"model": "m", "prompt": "meanwhile", "max_tokens": 8}
            meanwhile = []
            for _ in range(12):  # while the stopping worker drains (its streams last seconds)
                meanwhile.append(httpx.post(gw + "/v1/completions", json=body, timeout=30))
                time.sleep(0.1)
            results = [f.result(timeout=60) for f in streams]
        assert [r.status_code for r in meanwhile] == [200] * 12
        served_by = {r.headers["x-router-worker"] for r in meanwhile}
        assert stopping.removeprefix("http://") not in served_by
        drained = [r for r in results if r["worker"] == stopping.removeprefix("http://")]
        assert drained, "the stopped worker had streams in flight"
        for r in results:
            assert r["events"][-1] == "[DONE]"
            assert not any(e.startswith('{"error"') for e in r["events"]), r["events"][-3:]
            assert len(r["events"]) == 201  # every token, then [DONE]
        assert by_url[stopping].p.wait(20) == 0


async def _websocket_through_a_stopping_worker(stack: SimStack) -> list[dict]:
    """A socket whose worker gets SIGTERM while it answers a 150-token request; a second
    request follows at once (the stopping worker refuses it), a third after both answers."""
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.gateway + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "ws", "max_tokens": 150, "ignore_eos": True}))
        messages = [json.loads((await ws.receive(timeout=30)).data)]
        stack.workers[_busy_worker(stack.scheduler)].p.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)  # the worker is draining
        await ws.send_str(json.dumps({"model": "m", "prompt": "next", "max_tokens": 5, "ignore_eos": True}))
        for asked in (2, 3):
            while sum(m.get("type") == "done" for m in messages) < asked:
                messages.append(json.loads((await ws.receive(timeout=30)).data))
            if asked == 2:
                await ws.send_str(json.dumps({"model": "m", "prompt": "later", "max_tokens": 3,
                                              "ignore_eos": True}))
        assert not ws.closed
        # Every answer's lease ended (the refused request's on the stopping worker too), and the
        # socket, idle on its new worker, holds none.
        await until(lambda: open_leases(stack.scheduler) == 0)
        return messages


def test_a_websocket_on_a_stopping_worker_is_moved_with_what_it_still_owes():
    """The stopping worker finishes the answer it has begun; the request it refuses is sent
    to the other worker, and the socket goes on there: the client sees no error and no close."""
    with sim_stack(2, *SLOW) as stack:
        messages = asyncio.run(_websocket_through_a_stopping_worker(stack))
    assert not [m for m in messages if "error" in m]
    chunks_per_answer = [0]
    for m in messages:
        if m.get("type") == "done":
            chunks_per_answer.append(0)
        elif "choices" in m:
            chunks_per_answer[-1] += 1
    assert chunks_per_answer == [150, 5, 3, 0]  # each answer whole, in the order asked


def test_a_stopped_gateway_finishes_its_streams_and_takes_no_new_connections():
    with sim_stack(2, *SLOW) as stack:
        gw = stack.gateway
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(_stream, gw) for _ in range(4)]
            _busy_worker(stack.scheduler)
            time.sleep(0.5)
            stack.gateway_proc.p.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:
                httpx.get(gw + "/health", timeout=5)
                refused = False
            except httpx.ConnectError:
                refused = True
            results = [f.result(timeout=60) for f in streams]
        assert refused  # a load balancer's next connection goes to another replica
        for r in results:
            assert r["events"][-1] == "[DONE]" and len(r["events"]) == 201
        assert stack.gateway_proc.p.wait(20) == 0


async def _two_sockets_through_a_stopping_gateway(stack: SimStack) -> dict:
    """An idle socket and a busy one (a 150-token answer, ~5 s) when the gateway gets SIGTERM;
    the busy one sends another request after the signal."""
    long_request = {"model": "m", "prompt": "ws", "max_tokens": 150, "ignore_eos": True}
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(stack.gateway + "/v1/ws") as idle, \
            session.ws_connect(stack.gateway + "/v1/ws") as busy:
        await idle.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}))
        while json.loads((await idle.receive(timeout=30)).data).get("type") != "done":
            pass
        await busy.send_str(json.dumps(long_request))
        messages = [json.loads((await busy.receive(timeout=30)).data)]
        t0 = time.monotonic()
        stack.gateway_proc.p.send_signal(signal.SIGTERM)
        idle_closed = await idle.receive(timeout=30)
        idle_closed_after = time.monotonic() - t0
        await busy.send_str(json.dumps(long_request))
        while True:
            msg = await busy.receive(timeout=30)
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            messages.append(json.loads(msg.data))
        exit_code = await asyncio.to_thread(stack.gateway_proc.p.wait, 20)
        return {"idle": idle_closed, "idle_after": idle_closed_after, "busy": msg,
                "messages": messages, "exit_code": exit_code}


def test_a_stopped_gateway_sends_its_websockets_away_once_their_answers_are_out():
    with sim_stack(1, *SLOW) as stack:
        out = asyncio.run(_two_sockets_through_a_stopping_gateway(stack))
    # The idle socket goes at once (it held the gateway's exit for 45 s before), with 1001:
    # the client reconnects to another replica.
    assert out["idle"].type == aiohttp.WSMsgType.CLOSE and out["idle"].data == 1001
    assert out["idle_after"] < 3.0
    # The busy one gets its whole answer; the request sent after the signal is refused, in
    # its turn: after that answer's done (tests/router/test_ws_refusals_in_turn.py).
    messages = out["messages"]
    assert len([m for m in messages if "choices" in m]) == 150
    assert messages[-2]["type"] == "done"
    assert [m["error"]["code"] for m in messages if "error" in m] == ["shutting_down"]
    assert messages[-1]["error"]["code"] == "shutting_down"
    assert out["busy"].type == aiohttp.WSMsgType.CLOSE and out["busy"].data == 1001
    assert out["exit_code"] == 0


def _answers(messages: list[dict]) -> list[tuple[int, bool]]:
    """(chunks, cancelled) of each answer, in order."""
    answers, chunks = [], 0
    for m in messages:
        if "choices" in m:
            chunks += 1
        elif m.get("type") == "done":
            answers.append((chunks, bool(m.get("cancelled"))))
            chunks = 0
    return answers


async def _cancel_while_the_socket_moves(stack: SimStack) -> list[dict]:
    """The socket's worker stops while it answers a 150-token request and refuses the next;
    the other worker is busy (one running request at most) with a 200-token stream, so the
    socket waits in the gateway's queue to move. The client cancels the held request then,
    and sends another."""
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.gateway + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "ws", "max_tokens": 150, "ignore_eos": True}))
        messages = [json.loads((await ws.receive(timeout=30)).data)]
        stopping = _busy_worker(stack.scheduler)
        other = asyncio.ensure_future(asyncio.to_thread(_stream, stack.gateway))  # the other worker
        await asyncio.sleep(0.3)
        stack.workers[stopping].p.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        await ws.send_str(json.dumps({"model": "m", "prompt": "held", "max_tokens": 5, "ignore_eos": True}))
        while messages[-1].get("type") != "done":  # the first answer ends; the socket is moving
            messages.append(json.loads((await ws.receive(timeout=30)).data))
        await ws.send_str(json.dumps({"type": "cancel"}))
        messages.append(json.loads((await ws.receive(timeout=30)).data))
        assert not other.done()  # the cancel was answered while the socket still waited
        await ws.send_str(json.dumps({"model": "m", "prompt": "later", "max_tokens": 3, "ignore_eos": True}))
        while messages[-1].get("type") != "done" or len(_answers(messages)) < 3:
            messages.append(json.loads((await ws.receive(timeout=30)).data))
        assert (await other)["events"][-1] == "[DONE]"
        # The lease asked for the cancelled request, while the socket waited to move, went back.
        await until(lambda: open_leases(stack.scheduler) == 0)
        return messages


def test_a_request_held_while_its_socket_moves_can_be_cancelled():
    """No worker has the held request: the gateway answers the cancel itself, at once, and the
    socket goes on (it had been dropped, and the held request answered in full)."""
    with sim_stack(2, *SLOW, "--max-num-seqs", "1",
                   scheduler_flags=("--worker-max-running", '{"*": 1}')) as stack:
        messages = asyncio.run(_cancel_while_the_socket_moves(stack))
    assert not [m for m in messages if "error" in m]
    assert _answers(messages) == [(150, False), (0, True), (3, False)]


async def _off_spec_cancel_then_a_stopping_gateway(stack: SimStack) -> list[dict]:
    """A short answer, a message that looks like a cancel but is not one to the worker (a field
    more: a request it answers with an error), then a long answer, during which the gateway
    gets SIGTERM."""
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.gateway + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "a", "max_tokens": 5, "ignore_eos": True}))
        await ws.send_str(json.dumps({"type": "cancel", "why": "not a cancel to the worker"}))
        await ws.send_str(json.dumps({"model": "m", "prompt": "b", "max_tokens": 150, "ignore_eos": True}))
        messages: list[dict] = []
        while len([m for m in messages if "choices" in m]) < 10:  # well into the long answer
            messages.append(json.loads((await ws.receive(timeout=30)).data))
        stack.gateway_proc.p.send_signal(signal.SIGTERM)
        while True:
            msg = await ws.receive(timeout=30)
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            messages.append(json.loads(msg.data))
        return messages


def test_a_message_the_worker_takes_as_a_request_is_one_to_the_gateway_too():
    """The gateway counted `{"type": "cancel", ...}` with more fields as a cancel, the worker as
    a request (answered with an error): that error ended the long answer in the gateway's list
    of what the socket is owed, and the stopping gateway sent the socket away in mid-answer."""
    with sim_stack(1, *SLOW) as stack:
        messages = asyncio.run(_off_spec_cancel_then_a_stopping_gateway(stack))
    ends = [m.get("type") or m["error"]["param"] for m in messages if "choices" not in m]
    assert ends == ["done", "prompt", "done"]
    assert len([m for m in messages if "choices" in m]) == 5 + 150


async def _a_socket_a_stream_and_a_queued_call_past_the_shutdown_timeout(stack: SimStack) -> dict:
    """A WebSocket and an SSE stream each owed ~10 s of answer, and a call queued in the gateway
    behind them (the worker runs two at most), when the gateway gets SIGTERM."""
    body = {"model": "m", "prompt": "long", "max_tokens": 300, "ignore_eos": True}
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.gateway + "/v1/ws") as ws:
        await ws.send_str(json.dumps(body))
        await ws.receive(timeout=30)
        stream = asyncio.ensure_future(asyncio.to_thread(_stream_until_cut, stack.gateway, body))
        await until(lambda: open_leases(stack.scheduler) == 2)
        queued = asyncio.ensure_future(session.post(stack.gateway + "/v1/completions",
                                                    json={"model": "m", "prompt": "q", "max_tokens": 3}))
        await asyncio.sleep(0.5)
        assert not queued.done()
        t0 = time.monotonic()
        stack.gateway_proc.p.send_signal(signal.SIGTERM)
        exit_code = await asyncio.to_thread(stack.gateway_proc.p.wait, 30)
        exited_after = time.monotonic() - t0
        queued_answer = await queued
        return {"exit_code": exit_code, "exited_after": exited_after, "stream_events": await stream,
                "queued": (queued_answer.status, await queued_answer.json()),
                "log": stack.gateway_proc.output()}


def _stream_until_cut(gw: str, body: dict) -> list[str]:
    events = []
    with httpx.stream("POST", gw + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_the_shutdown_timeout_is_one_deadline_and_what_it_cuts_is_told_shutting_down():
    """A busy WebSocket, a long stream and a queued call when the gateway stops: all get
    --shutdown-timeout (3 s) together, and the gateway is gone soon after, before an
    orchestrator's grace period runs out (waiting for the sockets first and then as long again
    for the streams took 60 + 2 x 60 s by default against Kubernetes' 60). What the deadline
    cuts is told so, in a form the client can retry on: the stream's last event is a
    `shutting_down` error, the queued call a 503 `shutting_down`."""
    with sim_stack(1, *SLOW, "--max-num-seqs", "2", gateway_flags=("--shutdown-timeout", "3"),
                   scheduler_flags=("--worker-max-running", '{"*": 2}')) as stack:
        out = asyncio.run(_a_socket_a_stream_and_a_queued_call_past_the_shutdown_timeout(stack))
    assert out["exit_code"] == 0
    assert 2.5 < out["exited_after"] < 5.5, out  # one 3 s deadline, not 3 s each
    events = out["stream_events"]
    assert 1 < len(events) < 301 and events[-1] == "[DONE]", events[-3:]  # cut, not finished
    assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
    status, body = out["queued"]
    assert status == 503 and body["error"]["code"] == "shutting_down", out["queued"]
    # Said when the stop begins, not only at the deadline: what it waits for (the queued call
    # counts, its handler is in flight too).
    assert "shutting down: 2 request(s) and 1 WebSocket(s) in flight, waiting up to 3 s" in out["log"]


def _state_of(scheduler: str, url: str) -> tuple[str | None, str | None]:
    """The worker's state and down cause, as the scheduler lists them."""
    view = next(w for w in httpx.get(scheduler + "/v1/workers").json()["workers"] if w["url"] == url)
    return view["state"], view.get("down_cause")


def test_a_whole_answer_on_a_stopping_static_worker_is_finished_there_not_regenerated():
    """A static worker (--workers) that gets SIGTERM stays listed: its refused port soon has the
    scheduler report it down. It is draining, not hung (router/down_watch.py): the whole answer
    it generates is still answered by it, not given up and generated again elsewhere."""
    with sim_stack(2, *SLOW, gateway_flags=("--workers-refresh-ms", "200")) as stack:
        body = {"model": "m", "prompt": "a long answer", "max_tokens": 100, "ignore_eos": True}  # ~3 s
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, stack.gateway + "/v1/completions", json=body, timeout=60)
            stopping = _busy_worker(stack.scheduler)
            time.sleep(0.3)  # its answer is under way
            stack.workers[stopping].p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (state := _state_of(stack.scheduler, stopping))[0] != "down":  # in well under 1 s
                assert time.monotonic() < deadline, "the stopping worker was never reported down"
                time.sleep(0.05)
            assert state == ("down", "refused")
            assert not answer.done()  # the gateway learns of it while the answer is generated
            r = answer.result(timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 100
        assert r.headers["x-router-worker"] == stopping.removeprefix("http://")
        assert series_value(stack.gateway, 'router_retries_total{reason="worker_down"}', 0) == 0
        assert stack.workers[stopping].p.wait(20) == 0


def _watch_causes(scheduler: str, url: str, stop: threading.Event) -> list[tuple[str | None, str | None]]:
    """Every (state, down cause) the scheduler lists for the worker at `url` until `stop`,
    polled every 20 ms (at most 60 s)."""
    seen: list[tuple[str | None, str | None]] = []
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        state = _state_of(scheduler, url)
        if not seen or seen[-1] != state:
            seen.append(state)
        time.sleep(0.02)
    return seen


def test_a_draining_workers_shutting_down_answers_are_retried_and_do_not_make_it_failing():
    """A worker SIGTERMed while it generates a long whole answer answers what reaches it on the
    gateway's kept-alive connections 503 `shutting_down` (its port is closed; the scheduler's
    next scrapes, 3 s apart here, would find that out in seconds). Each such request is retried
    on the other worker at once; the gateway reports the refusal as "draining", so the scheduler
    takes the worker out at once with that cause, which the gateway's down-watch leaves alone:
    the long answer is finished by the draining worker, not generated again elsewhere. Reported
    as "http_503" (before), three of them made the worker "failing", and the gateway, at its
    next worker-list refresh, gave up the long answer and had it regenerated on the other."""
    with sim_stack(2, *SLOW, gateway_flags=("--workers-refresh-ms", "200"),
                   scheduler_flags=("--policy", "round_robin", "--scrape-interval-ms", "3000",
                                    "--stale-after-ms", "60000")) as stack:
        gw = stack.gateway
        short = {"model": "m", "prompt": "warm", "max_tokens": 20, "ignore_eos": True}
        with ThreadPoolExecutor(12) as pool:
            # Kept-alive connections to both workers (round robin: six requests each at once).
            warm = [pool.submit(httpx.post, gw + "/v1/completions", json=short, timeout=30)
                    for _ in range(12)]
            assert [f.result(timeout=30).status_code for f in warm] == [200] * 12
            body = {"model": "m", "prompt": "a long answer", "max_tokens": 100, "ignore_eos": True}  # ~3 s
            answer = pool.submit(httpx.post, gw + "/v1/completions", json=body, timeout=60)
            stopping = _busy_worker(stack.scheduler)
            time.sleep(0.3)  # its answer is under way
            stop_watching = threading.Event()
            causes = pool.submit(_watch_causes, stack.scheduler, stopping, stop_watching)
            stack.workers[stopping].p.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # it drains: its port is closed
            meanwhile = []
            for _ in range(8):  # round robin sends about half of them to the draining worker first
                meanwhile.append(httpx.post(gw + "/v1/completions", json={**short, "max_tokens": 4},
                                            timeout=30))
                time.sleep(0.05)
            r = answer.result(timeout=60)
            stop_watching.set()
            seen = causes.result(timeout=10)
        stopped = stopping.removeprefix("http://")
        assert [m.status_code for m in meanwhile] == [200] * 8, [m.text for m in meanwhile]
        assert stopped not in {m.headers["x-router-worker"] for m in meanwhile}
        assert series_value(gw, 'router_retries_total{reason="draining"}', 0) >= 1
        assert ("down", "draining") in seen, seen
        assert ("down", "failing") not in seen, seen
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 100
        assert r.headers["x-router-worker"] == stopped  # finished there, not regenerated
        assert series_value(gw, 'router_retries_total{reason="worker_down"}', 0) == 0
        assert stack.workers[stopping].p.wait(20) == 0
