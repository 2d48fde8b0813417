"""A worker told to stop (SIGTERM: a rolling update, a scale-down) finishes what it has taken.

Sim workers (tiny profile at --time-scale 5: ~32 ms per decode step), so a 200-token answer
streams for ~6 s, longer than aiohttp's own shutdown grace would have waited.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import pytest

from tests.worker.conftest import SIM_AVAILABLE, SIM_SKIP_REASON, Worker, launch_worker, wait_for

pytestmark = pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)

SLOW_SIM = ("--backend", "sim", "--sim-profile", "tiny", "--time-scale", "5")


def _stream(worker: Worker, max_tokens: int, started: threading.Event) -> list[str]:
    body = {"model": "m", "prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", worker.api_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


def _refuses_connections(worker: Worker) -> bool:
    try:
        httpx.get(worker.base_url + "/v1/models", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def _exit_code(worker: Worker, within_s: float) -> int:
    return worker.process.wait(within_s)


def test_sigterm_lets_streams_in_flight_finish_and_refuses_new_connections() -> None:
    with launch_worker(*SLOW_SIM, model="m") as worker, ThreadPoolExecutor(2) as pool:
        started = [threading.Event(), threading.Event()]
        streams = [pool.submit(_stream, worker, 200, ev) for ev in started]
        assert all(ev.wait(30) for ev in started)
        worker.process.send_signal(signal.SIGTERM)
        wait_for(lambda: _refuses_connections(worker), 5, what="the listener to close")
        for fut in streams:
            events = fut.result(timeout=60)
            assert events[-1] == "[DONE]"
            assert not any(e.startswith('{"error"') for e in events), events[-3:]
            assert len(events) == 201  # every token, then [DONE]
        assert _exit_code(worker, 20) == 0
        assert "every request in flight was answered" in worker.output()


def test_requests_left_at_the_drain_limit_end_with_a_shutting_down_error() -> None:
    flags = (*SLOW_SIM, "--shutdown-timeout", "1")
    with launch_worker(*flags, model="m") as worker, ThreadPoolExecutor(2) as pool:
        started = threading.Event()
        stream = pool.submit(_stream, worker, 400, started)
        body = {"model": "m", "prompt": "whole answer", "max_tokens": 400, "ignore_eos": True}
        whole = pool.submit(httpx.post, worker.api_url + "/completions", json=body, timeout=60)
        assert started.wait(30)
        time.sleep(0.3)  # the non-stream request is in the engine too
        worker.process.send_signal(signal.SIGTERM)
        events = stream.result(timeout=30)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down"
        assert 1 < len(events) - 2 < 400  # it had streamed, and did not finish
        answer = whole.result(timeout=30)
        assert answer.status_code == 503  # nothing was sent: a router retries it elsewhere
        assert answer.json()["error"]["code"] == "shutting_down"
        assert _exit_code(worker, 20) == 0
        assert "ended 2 requests still in flight" in worker.output()


def test_a_streamed_background_response_is_finished_and_an_unwatched_one_cancelled() -> None:
    """A client streaming a background response gets all of it, as on any stream; one that
    nobody streams cannot be retrieved from a stopped worker, so it is not waited for."""
    with launch_worker(*SLOW_SIM, model="m") as worker, ThreadPoolExecutor(1) as pool:
        url = worker.api_url + "/responses"
        base = {"model": "m", "input": "drain me", "max_output_tokens": 150, "ignore_eos": True,
                "background": True}
        unwatched = httpx.post(url, json={**base, "max_output_tokens": 450}, timeout=30)
        assert unwatched.status_code == 200 and unwatched.json()["status"] == "queued"
        started = threading.Event()

        def watch() -> list[dict]:
            with httpx.stream("POST", url, json={**base, "stream": True}, timeout=60) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        started.set()
                return events

        watched = pool.submit(watch)
        assert started.wait(30)
        worker.process.send_signal(signal.SIGTERM)
        events = watched.result(timeout=60)
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["usage"]["output_tokens"] == 150
        assert _exit_code(worker, 20) == 0
        assert "every request in flight was answered" in worker.output()
        assert "cancelling 1 background responses still running" in worker.output()


async def _draining(worker: Worker, within_s: float) -> None:
    """Until the worker says it drains (its log line right after it begins to)."""
    deadline = time.monotonic() + within_s
    while "shutting down:" not in worker.output():
        assert time.monotonic() < deadline, "the worker did not begin to drain"
        await asyncio.sleep(0.05)


async def _drain_websockets(worker: Worker) -> tuple[list[dict], int | None, int | None, float, float]:
    """Socket A has an answer streaming when SIGTERM comes and asks for another once the worker
    drains; socket B is idle. Returns A's messages, both close codes, and when each closed."""
    async with aiohttp.ClientSession() as session:
        a = await session.ws_connect(worker.base_url + "/v1/ws")
        b = await session.ws_connect(worker.base_url + "/v1/ws")
        await a.send_str(json.dumps({"model": "m", "prompt": "ws", "max_tokens": 150, "ignore_eos": True}))
        first = await a.receive(timeout=30)
        worker.process.send_signal(signal.SIGTERM)
        await _draining(worker, 10)
        await a.send_str(json.dumps({"model": "m", "prompt": "one more", "max_tokens": 5}))
        t0 = time.monotonic()
        closed_b = await b.receive(timeout=30)
        b_after = time.monotonic() - t0
        messages = [json.loads(first.data)]
        while True:
            closed_a = await a.receive(timeout=30)
            if closed_a.type != aiohttp.WSMsgType.TEXT:
                break
            messages.append(json.loads(closed_a.data))
        a_after = time.monotonic() - t0
        # The code the worker's close frame gives (the client's own close_code can read 1006
        # when the worker has dropped the connection before the client's reply).
        codes = [m.data if m.type == aiohttp.WSMsgType.CLOSE else m.type for m in (closed_a, closed_b)]
        return messages, codes[0], codes[1], a_after, b_after


def test_websockets_finish_their_request_then_close_going_away() -> None:
    """The request sent during the drain is refused in its turn: after the answer streaming
    ends with its done, then the 1001. Refused at once, its error came inside that answer, and
    a client pairing each answer's end with its requests in order took it for that answer's end."""
    with launch_worker(*SLOW_SIM, model="m") as worker:
        messages, a_code, b_code, a_after, b_after = asyncio.run(_drain_websockets(worker))
        assert b_code == 1001 and a_code == 1001
        assert b_after < a_after  # the idle socket did not wait for the other's answer
        chunks = [m for m in messages if "choices" in m]
        errors = [m["error"] for m in messages if "error" in m]
        assert len(chunks) == 150  # the answer under way, whole
        assert [e["code"] for e in errors] == ["shutting_down"]  # the request sent after SIGTERM
        assert messages[-2].get("type") == "done", f"the refusal came inside the answer: {messages[-3:]}"
        assert messages[-1]["error"]["code"] == "shutting_down"  # in its turn, then the 1001
        assert _exit_code(worker, 20) == 0


async def _many_sent_while_draining(worker: Worker, n: int) -> tuple[int, list[dict], object]:
    """An answer streams when SIGTERM comes; once the worker drains the client sends n requests
    and a ping. Returns how many messages came before the pong (the worker answers pings as
    it reads the socket, in order), every message, and the close code."""
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(worker.base_url + "/v1/ws", autoping=False)
        await ws.send_str(json.dumps({"model": "m", "prompt": "ws", "max_tokens": 150, "ignore_eos": True}))
        messages = [json.loads((await ws.receive(timeout=30)).data)]
        worker.process.send_signal(signal.SIGTERM)
        await _draining(worker, 10)
        for _ in range(n):
            await ws.send_str(json.dumps({"model": "m", "prompt": "one more", "max_tokens": 5}))
        await ws.ping(b"read")
        pong = None
        while (msg := await ws.receive(timeout=30)).type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.PONG):
            if msg.type == aiohttp.WSMsgType.PONG:
                pong = len(messages)
            else:
                messages.append(json.loads(msg.data))
            assert len(messages) < 400
        assert pong is not None
        return pong, messages, msg.data


def test_refusals_waiting_their_turn_in_a_drain_are_bounded() -> None:
    """A client that sends many requests while the worker drains and an answer streams does not
    make the worker keep a refusal for each: 64 wait their turn (its queue), the rest are
    refused at once, out of their turn, as a request past 64 queued gets its 429 at once."""
    with launch_worker(*SLOW_SIM, model="m") as worker:
        pong, messages, code = asyncio.run(_many_sent_while_draining(worker, 100))
        done = next(i for i, m in enumerate(messages) if m.get("type") == "done")
        at_once = [m["error"]["code"] for m in messages[:done] if "error" in m]
        assert at_once == ["shutting_down"] * 36
        assert all("error" not in m for m in messages[pong:done])  # all of them before the pong
        assert len([m for m in messages[:done] if "choices" in m]) == 150  # the answer, whole
        assert [m["error"]["code"] for m in messages[done + 1:]] == ["shutting_down"] * 64
        assert code == 1001
        assert _exit_code(worker, 20) == 0
