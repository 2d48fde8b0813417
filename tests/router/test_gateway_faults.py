"""Failures with real processes: workers SIGKILLed under load (retries before the first byte,
a clean SSE error after it) and the scheduler killed and restarted (round-robin fallback and
the return to scheduled routing)."""

from __future__ import annotations

import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router.procs import free_port, start_gateway, start_scheduler, start_sim_workers


@pytest.fixture
def three_workers():
    procs, urls = [], []
    try:
        for p, u in start_sim_workers(3):
            procs.append(p)
            urls.append(u)
        s, su = start_scheduler(urls, "--scrape-interval-ms", "100")
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--retry-count", "2")
        procs.append(g)
        yield {
            "gw": gu,
            "scheduler": su,
            "workers": dict(zip(urls, procs[:3], strict=True)),
            "gw_proc": g,
        }
    finally:
        for p in procs:
            p.stop()


def _kill_a_busy_worker(stack) -> str:
    """SIGKILL a worker that holds leases right now; returns its URL."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for w in httpx.get(stack["scheduler"] + "/v1/workers").json()["workers"]:
            if w["in_flight_leases"] > 0:
                stack["workers"][w["url"]].kill()
                return w["url"]
        time.sleep(0.02)
    raise AssertionError("no worker ever had a request in flight")


def _retries(gw: str) -> float:
    text = httpx.get(gw + "/metrics").text
    return sum(float(v) for v in re.findall(r"^router_retries_total\{[^}]*\} (\S+)$", text, re.M))


def test_worker_killed_under_non_stream_load_every_request_still_succeeds(three_workers):
    gw = three_workers["gw"]
    body = {"model": "m", "prompt": "retry me", "max_tokens": 120}
    with ThreadPoolExecutor(12) as ex:
        futs = [ex.submit(httpx.post, gw + "/v1/completions", json=body, timeout=60) for _ in range(12)]
        time.sleep(0.25)
        killed = _kill_a_busy_worker(three_workers)
        rs = [f.result() for f in futs]
    assert [r.status_code for r in rs] == [200] * 12
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in rs)
    assert killed not in {r.headers["x-router-worker"] for r in rs}
    assert _retries(gw) >= 1  # the killed worker had requests: they were retried elsewhere


def _read_stream(gw: str) -> dict:
    events, t0 = [], time.monotonic()
    body = {"model": "m", "prompt": "stream me", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=30) as r:
        worker = r.headers["x-router-worker"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return {"worker": worker, "events": events, "secs": time.monotonic() - t0}


def test_worker_killed_mid_stream_clients_get_an_error_event_and_the_end(three_workers):
    gw = three_workers["gw"]
    with ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(_read_stream, gw) for _ in range(6)]
        time.sleep(0.4)
        _kill_a_busy_worker(three_workers)
        results = [f.result(timeout=60) for f in futs]  # nobody hangs
    broken = [r for r in results if any(e.startswith('{"error"') for e in r["events"])]
    assert broken, "the killed worker was streaming: its clients must see an error event"
    for r in results:
        assert r["events"][-1] == "[DONE]"  # every stream ends cleanly
    for r in broken:
        err = json.loads(r["events"][-2])["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert len(r["events"]) > 2  # it had started: not replayed, not retried
    ok = [r for r in results if r not in broken]
    assert all(len(r["events"]) == 201 for r in ok)  # 200 tokens + [DONE]


def test_scheduler_killed_then_restarted_fallback_and_back(capsys):
    procs = []
    try:
        (w1, u1), (w2, u2) = start_sim_workers(2)
        procs += [w1, w2]
        sport = free_port()
        s, su = start_scheduler([u1, u2], "--scrape-interval-ms", "100", port=sport)
        procs.append(s)
        g, gu = start_gateway(
            "--scheduler",
            su,
            "--debug-headers",
            "--wait-schedule-timeout-ms",
            "1000",
            "--wait-schedule-try-period-ms",
            "200",
            "--workers-refresh-ms",
            "300",
        )
        procs.append(g)
        body = {"model": "m", "prompt": "x", "max_tokens": 2}

        def call() -> httpx.Response:
            r = httpx.post(gu + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r

        assert call().headers["x-router-policy"] == "llm_aware"
        time.sleep(0.5)  # the gateway's cached worker list is refreshed meanwhile
        s.kill()
        t_kill = time.monotonic()
        policies, workers = [], set()
        while time.monotonic() - t_kill < 15:
            r = call()  # every request succeeds, also while the gateway is still retrying the scheduler
            policies.append(r.headers["x-router-policy"])
            if policies[-1] == "fallback_round_robin":
                workers.add(r.headers["x-router-worker"])
                if len(workers) == 2:
                    break
        t_fallback = time.monotonic() - t_kill
        assert len(workers) == 2, policies  # round robin over both last-known workers

        s2, _ = start_scheduler([u1, u2], "--scrape-interval-ms", "100", port=sport)
        procs.append(s2)
        t_back0 = time.monotonic()
        while time.monotonic() - t_back0 < 15:
            if call().headers["x-router-policy"] == "llm_aware":
                break
            time.sleep(0.01)
        t_back = time.monotonic() - t_back0
        assert call().headers["x-router-policy"] == "llm_aware"
        state = httpx.get(gu + "/admin/state").json()
        assert state["mode"] == "scheduled"
        with capsys.disabled():
            print(
                f"\n[fallback] kill -> both workers served by round robin: {t_fallback * 1000:.0f} ms; "
                f"gateway's switch: {state['last_switch_s']}; scheduler ready -> scheduled: "
                f"{t_back * 1000:.0f} ms"
            )
    finally:
        for p in procs:
            p.stop()


def test_every_worker_down_answers_503_at_once_not_after_the_queue_timeout():
    procs = []
    try:
        [(w, wu)] = start_sim_workers(1)
        procs.append(w)
        s, su = start_scheduler([wu], "--scrape-interval-ms", "100")
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--queue-timeout-ms", "60000")
        procs.append(g)
        w.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not any(x["healthy"] for x in httpx.get(su + "/v1/workers").json()["workers"]):
                break
            time.sleep(0.05)
        r = httpx.post(gu + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=20)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        for p in procs:
            p.stop()


async def test_websocket_worker_killed_mid_answer_client_gets_an_error():
    import aiohttp

    [(w, wu)] = start_sim_workers(1)
    g, gu = start_gateway("--workers", wu)
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(gu + "/v1/ws") as ws:
            await ws.send_str(json.dumps({"model": "m", "prompt": "long", "max_tokens": 400}))
            for _ in range(3):
                assert "choices" in json.loads((await ws.receive(timeout=30)).data)
            w.kill()
            last = None
            while True:
                msg = await ws.receive(timeout=30)  # nobody hangs
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                last = json.loads(msg.data)
            assert last is not None and last["error"]["code"] == "upstream_closed"
    finally:
        g.stop()
        w.stop()


def _raw_exchange(port: int, raw: bytes) -> tuple[bytes, bytes]:
    """Send bytes as they are (no client library would send these) and read the answer to its
    end: the gateway closes after a request it could not parse."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


def test_a_malformed_http_request_is_one_warning_line_not_a_traceback():
    """What scanners send (a control byte in a header, a Content-Length that is no number) is
    refused with a 400 by aiohttp's parser before any handler runs: the client gets it in the
    OpenAI error shape, like every other 4xx, and the gateway logs it as one WARNING line, not
    an ERROR with a traceback per request."""
    proc, url = start_gateway("--workers", "http://127.0.0.1:9")
    port = int(url.rsplit(":", 1)[1])
    try:
        for raw, reason in (
            (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n", "Invalid header value char"),
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
             "Invalid character in Content-Length"),
        ):
            head, body = _raw_exchange(port, raw)
            assert head.startswith(b"HTTP/1.0 400"), head
            assert b"content-type: application/json" in head.lower(), head
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == 400, error
            assert error["message"] == f"malformed HTTP request: {reason}", error
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        time.sleep(0.2)
        log = proc.output()
    finally:
        proc.stop()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert log.count("WARNING router.http: malformed HTTP request from 127.0.0.1") == 2, log
    assert "Invalid character in Content-Length" in log


def test_a_lying_content_encoding_on_a_route_that_reads_no_body_is_one_warning_line():
    """A body sent as gzip (or zstd) that is not, to a route that never reads a body: the
    answer was right, but aiohttp drained the body after it, met the decoding error and logged
    an ERROR "Unhandled exception" with three chained tracebacks, one per request."""
    proc, url = start_gateway("--workers", "http://127.0.0.1:9")
    try:
        for method, path, status in (("GET", "/health", 200), ("GET", "/v1/models", 200),
                                     ("POST", "/nowhere", 404), ("DELETE", "/health", 405)):
            for encoding in ("gzip", "zstd"):
                r = httpx.request(method, url + path, content=b"not compressed", timeout=10,
                                  headers={"Content-Encoding": encoding})
                assert r.status_code == status, (method, path, r.text)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        time.sleep(0.2)  # logged after the answer
        log = proc.output()
    finally:
        proc.stop()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert log.count("WARNING router.http: unreadable request body from 127.0.0.1: Can not decode") == 8, log


def test_headers_up_to_32_kib_pass_and_a_longer_one_is_a_400_in_the_openai_shape():
    """Identity tokens with many claims run past aiohttp's default 8 KiB per header; the gateway
    takes 32 KiB, as vLLM behind uvicorn does, and answers a longer one with an OpenAI error."""
    proc, url = start_gateway("--workers", "http://127.0.0.1:9")
    port = int(url.rsplit(":", 1)[1])
    try:
        def models_with_header(size: int) -> tuple[bytes, bytes]:
            return _raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Claims: "
                                 + b"a" * size + b"\r\nConnection: close\r\n\r\n")

        head, body = models_with_header(20 * 1024)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert json.loads(body)["object"] == "list"
        head, body = models_with_header(40 * 1024)
        assert head.startswith(b"HTTP/1.0 400"), head
        error = json.loads(body)["error"]
        assert error["message"].startswith("malformed HTTP request: Got more than 32768 bytes"), error
    finally:
        proc.stop()
