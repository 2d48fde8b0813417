"""The gateway's own OpenTelemetry traces (--otlp-traces-endpoint), with real processes on
127.0.0.1: echo workers, a scheduler, gateways with tracing on and off, and a real OTLP/HTTP
receiver in the test (an aiohttp server at /v1/traces that decodes each
ExportTraceServiceRequest with opentelemetry-proto's classes)."""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from router.trace_collect import parse_traceparent
from tests.router.procs import (
    REPO,
    free_port,
    start_echo_worker,
    start_gateway,
    start_scheduler,
)

SERVER, CLIENT, INTERNAL = 2, 3, 1  # the proto's SpanKind values
UNSET, ERROR = 0, 2
# A short batch delay: spans reach the receiver within a fraction of a second.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[str]
    status: int
    service: str = ""
    extra: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1, served from a thread of its own (the tests
    call the gateway with blocking clients)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self._lock = threading.Lock()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _traces(self, request: web.Request) -> web.Response:
        data = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(data)
        got = []
        for rs in msg.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), name=s.name, kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[e.name for e in s.events], status=s.status.code,
                        service=resource.get("service.name", "")))
        with self._lock:
            self.spans += got
            self.posts += 1
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_trace(self, trace_id: str, done: Callable[[list[Span]], bool],
                   timeout_s: float = 15) -> list[Span]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.of_trace(trace_id)
            if done(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"trace {trace_id}: {self.of_trace(trace_id)}")


def _has_server(spans: list[Span]) -> bool:
    return any(s.kind == SERVER for s in spans)


def _one(spans: list[Span], **match) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, spans)
    return found[0]


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id]


def _traceparent(trace_id: str, span_id: str = "00f067aa0ba902b7", flags: str = "01") -> dict:
    return {"traceparent": f"00-{trace_id}-{span_id}-{flags}", "tracestate": "vendor=opaque",
            "baggage": "tenant=acme"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def cluster(receiver) -> Iterator[dict]:
    """One slow echo worker (20 ms a token) that the scheduler gives one request at a time, a
    gateway with tracing on in front (and the same without tracing, with the OTel SDK's own
    endpoint variables pointing at the receiver: it must export nothing all the same)."""
    procs = []
    try:
        w, wu = start_echo_worker(token_delay_ms=20)
        procs.append(w)
        s, su = start_scheduler([wu], "--scrape-interval-ms", "100", "--policy-params",
                                '{"max_running": 1}')
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--otlp-traces-endpoint", receiver.url,
                              env=FAST_EXPORT)
        procs.append(g)
        off, offu = start_gateway("--scheduler", su, env={
            **FAST_EXPORT, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url.removesuffix("/v1/traces"),
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url})
        procs.append(off)
        yield {"gw": gu, "off": offu, "worker": wu, "gw_proc": g}
    finally:
        for p in procs:
            p.stop()


CHAT = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}


def _stream(url: str, body: dict, headers: dict) -> tuple[httpx.Response, list[dict]]:
    events = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return r, events


def _check_request_span(server: Span, *, trace_id: str, route: str, stream: bool,
                        request_id: str) -> None:
    a = server.attributes
    assert server.name == f"POST {route}" and server.kind == SERVER
    assert server.trace_id == trace_id and server.parent_id == "00f067aa0ba902b7"
    assert server.service == "llm-router-gateway"
    assert a["http.request.method"] == "POST" and a["http.route"] == route
    assert a["http.response.status_code"] == 200 and server.status == UNSET
    assert a["gen_ai.request.model"] == "m" and a["router.request.id"] == request_id
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 4
    assert a["router.worker.id"].startswith("127.0.0.1:") and a["router.stream"] is stream
    assert a["router.attempts"] == 1 and a["router.retries"] == 0
    assert a["router.queue_ms"] >= 0
    assert "error.type" not in a


def _check_structure(spans: list[Span], server: Span, worker_parent: str) -> Span:
    """The scheduler's decision then the upstream attempt, under the server span; the worker
    got the attempt's span as its parent. Returns the attempt's span."""
    assert server.attributes["router.fallback"] is False
    assert server.attributes["router.policy"] == "llm_aware"
    decision = _one(spans, name="router.schedule")
    assert decision.parent_id == server.span_id and decision.kind == INTERNAL
    assert decision.attributes["router.scheduler.outcome"] == "placed"
    assert decision.attributes["router.scheduler.wait_ms"] == 0
    assert decision.attributes["router.worker.id"] == server.attributes["router.worker.id"]
    assert decision.attributes["router.policy"] == "llm_aware"
    upstream = _one(spans, kind=CLIENT)
    assert upstream.parent_id == server.span_id and upstream.name == server.name
    assert upstream.span_id == worker_parent, "the worker's parent span is the upstream attempt"
    assert upstream.attributes["url.full"].endswith(server.attributes["http.route"])
    assert upstream.attributes["server.address"] == "127.0.0.1"
    assert upstream.attributes["http.response.status_code"] == 200
    assert upstream.attributes["router.attempt"] == 1
    # Spans nest in time as they do in the tree.
    for child in (decision, upstream):
        assert server.start_ns <= child.start_ns <= child.end_ns <= server.end_ns
    assert decision.end_ns <= upstream.start_ns
    return upstream


def test_whole_and_streamed_requests_are_spans_in_the_clients_trace(cluster, receiver):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(cluster["gw"] + "/v1/chat/completions", json=CHAT,
                   headers=_traceparent(trace_id), timeout=30)
    assert r.status_code == 200
    saw = r.json()["saw_trace"]
    # The trace id stays the client's; the parent is now the gateway's; the rest as sent.
    worker_trace, worker_parent, flags = parse_traceparent(saw["traceparent"])
    assert f"{worker_trace:032x}" == trace_id and flags == 1
    assert saw["tracestate"] == "vendor=opaque" and saw["baggage"] == "tenant=acme"
    spans = receiver.wait_trace(trace_id, _has_server)
    server = _one(spans, kind=SERVER)
    _check_request_span(server, trace_id=trace_id, route="/v1/chat/completions", stream=False,
                        request_id=r.headers["x-request-id"])
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert "router.ttft_ms" not in server.attributes  # a whole answer has no first token apart
    _check_structure(spans, server, f"{worker_parent:016x}")

    trace_id = "0af7651916cd43dd8448eb211c80319c"
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r, events = _stream(cluster["gw"] + "/v1/chat/completions", body, _traceparent(trace_id))
    assert r.status_code == 200
    saw = events[-1]["saw_trace"]  # the echo worker's usage chunk says what it was sent
    worker_trace, worker_parent, _ = parse_traceparent(saw["traceparent"])
    assert f"{worker_trace:032x}" == trace_id
    spans = receiver.wait_trace(trace_id, _has_server)
    server = _one(spans, kind=SERVER)
    _check_request_span(server, trace_id=trace_id, route="/v1/chat/completions", stream=True,
                        request_id=r.headers["x-request-id"])
    assert server.attributes["router.ttft_ms"] > 0
    upstream = _check_structure(spans, server, f"{worker_parent:016x}")
    assert upstream.events == ["first_token"]
    # The access log names the client's trace, as without tracing (its lines go out in batches).
    deadline = time.monotonic() + 5
    while f"trace={trace_id}" not in cluster["gw_proc"].output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"trace={trace_id}" in cluster["gw_proc"].output()


def test_a_queued_request_shows_its_wait_in_the_queue(cluster, receiver):
    """The scheduler lets the worker run one request at a time: a second one queues, and its
    trace has the wait in the gateway's queue, with the held scheduler calls inside it."""
    slow = {**CHAT, "max_tokens": 40, "stream": True}  # 0.8 s on the worker
    first, second = "11111111111111111111111111111111", "22222222222222222222222222222222"
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_stream, cluster["gw"] + "/v1/chat/completions", slow, _traceparent(first))
        time.sleep(0.3)
        b = pool.submit(_stream, cluster["gw"] + "/v1/chat/completions", slow, _traceparent(second))
        assert a.result()[0].status_code == 200 and b.result()[0].status_code == 200
    spans = receiver.wait_trace(second, _has_server)
    server = _one(spans, kind=SERVER)
    queue = _one(spans, name="router.queue")
    assert queue.parent_id == server.span_id and queue.status == UNSET
    waited_ms = (queue.end_ns - queue.start_ns) / 1e6
    assert waited_ms > 200, waited_ms  # until the first request's 0.8 s ended
    assert server.attributes["router.queue_ms"] >= waited_ms * 0.9
    held = [s for s in spans if s.name == "router.schedule" and s.parent_id == queue.span_id]
    assert held and held[-1].attributes["router.scheduler.outcome"] == "placed"
    assert all(s.attributes["router.scheduler.wait_ms"] > 0 for s in held)
    assert queue.attributes["router.scheduler.calls"] == len(held)
    # Before it queued it asked once (the scheduler said wait), outside the queue.
    asked = _one(spans, name="router.schedule", parent_id=server.span_id)
    assert asked.attributes["router.scheduler.outcome"] == "wait" and asked.end_ns <= queue.start_ns


def test_a_refused_request_has_a_span_with_its_error(cluster, receiver):
    trace_id = "33333333333333333333333333333333"
    r = httpx.post(cluster["gw"] + "/v1/chat/completions", json={**CHAT, "model": "nope"},
                   headers=_traceparent(trace_id), timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    spans = receiver.wait_trace(trace_id, _has_server)
    server = _one(spans, kind=SERVER)
    assert server.attributes["http.response.status_code"] == 404
    assert server.attributes["error.type"] == "model_not_found"
    assert server.attributes["gen_ai.request.model"] == "nope"
    assert server.status == UNSET  # a client's error: the HTTP conventions leave it unset
    decision = _one(spans, name="router.schedule")
    assert decision.status == ERROR and decision.attributes["error.type"] == "UnknownModelError"
    assert not [s for s in spans if s.kind == CLIENT]  # no worker was tried


def test_with_tracing_off_nothing_is_exported_and_the_trace_context_passes_unchanged(cluster, receiver):
    trace_id = "44444444444444444444444444444444"
    headers = _traceparent(trace_id)
    r = httpx.post(cluster["off"] + "/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
    assert r.status_code == 200 and r.json()["saw_trace"] == headers
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r, events = _stream(cluster["off"] + "/v1/chat/completions", body, headers)
    assert events[-1]["saw_trace"] == headers
    # The gateway with tracing on exports within 50 ms: a second is plenty to see none here.
    time.sleep(1.0)
    assert receiver.of_trace(trace_id) == []


def test_a_request_without_trace_context_starts_a_trace(cluster, receiver):
    r = httpx.post(cluster["gw"] + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                   timeout=30)
    trace_id, parent, flags = parse_traceparent(r.json()["saw_trace"]["traceparent"])
    assert flags == 1 and r.json()["saw_trace"]["tracestate"] is None
    spans = receiver.wait_trace(f"{trace_id:032x}", _has_server)
    server = _one(spans, kind=SERVER)
    assert server.parent_id == "" and server.name == "POST /v1/completions"
    assert _one(spans, kind=CLIENT).span_id == f"{parent:016x}"


async def test_a_websocket_has_a_span_and_one_per_answer(cluster, receiver):
    trace_id = "55555555555555555555555555555555"
    req = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2})
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(cluster["gw"] + "/v1/ws", headers=_traceparent(trace_id)) as ws:
            for _ in range(2):
                await ws.send_str(req)
                while '"done"' not in (await ws.receive(timeout=10)).data:
                    pass
    spans = await asyncio.to_thread(receiver.wait_trace, trace_id, _has_server)
    server = _one(spans, kind=SERVER)
    assert server.name == "GET /v1/ws" and server.attributes["http.response.status_code"] == 101
    answers = [s for s in spans if s.name == "router.ws.answer"]
    assert len(answers) == 2 and all(a.parent_id == server.span_id for a in answers)
    assert all(a.attributes["http.response.status_code"] == 200 for a in answers)
    assert all(a.attributes["gen_ai.usage.output_tokens"] == 2 for a in answers)
    assert _one(spans, kind=CLIENT).attributes["url.full"].endswith("/v1/ws")


def test_retries_are_attempts_and_round_robin_placings(receiver):
    """Round robin over a dead worker and a live one (no scheduler): a request that met the
    dead one first has two attempts, the first failed with its reason."""
    w, wu = start_echo_worker()
    dead = f"http://127.0.0.1:{free_port()}"
    # OTEL_SERVICE_NAME names the service, as for any service the SDK sets up.
    g, gu = start_gateway("--workers", f"{dead},{wu}", "--otlp-traces-endpoint", receiver.url,
                          env={**FAST_EXPORT, "OTEL_SERVICE_NAME": "gateway-b"})
    try:
        retried = None
        for i in range(6):
            trace_id = f"{i + 0x66:032x}"
            r = httpx.post(gu + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1},
                           headers=_traceparent(trace_id), timeout=30)
            assert r.status_code == 200
            spans = receiver.wait_trace(trace_id, _has_server)
            if _one(spans, kind=SERVER).attributes["router.retries"] == 1:
                retried = spans
                break
        assert retried is not None, "no request met the dead worker"
        server = _one(retried, kind=SERVER)
        assert server.attributes["router.attempts"] == 2 and server.service == "gateway-b"
        first, second = sorted((s for s in retried if s.kind == CLIENT),
                               key=lambda s: s.attributes["router.attempt"])
        assert first.attributes["error.type"] == "connect" and first.status == ERROR
        assert first.attributes["url.full"].startswith(dead)
        assert second.attributes["http.response.status_code"] == 200 and second.status == UNSET
        assert server.attributes["router.fallback"] is True
        assert server.attributes["router.policy"] == "fallback_round_robin"
        assert not [s for s in retried if s.name == "router.schedule"]  # no scheduler here
    finally:
        g.stop()
        w.stop()


def test_sampling_keeps_the_clients_decision_and_samples_new_traces_by_ratio(receiver):
    w, wu = start_echo_worker()
    g, gu = start_gateway("--workers", wu, "--otlp-traces-endpoint", receiver.url,
                          "--otlp-traces-sample-ratio", "0", env=FAST_EXPORT)
    try:
        body = {"model": "m", "prompt": "p", "max_tokens": 1}
        r = httpx.post(gu + "/v1/completions", json=body, timeout=30)
        new_trace, _, flags = parse_traceparent(r.json()["saw_trace"]["traceparent"])
        assert flags == 0  # not sampled here: the engine is told so, and keeps none either
        kept = "77777777777777777777777777777777"
        r = httpx.post(gu + "/v1/completions", json=body, headers=_traceparent(kept), timeout=30)
        assert receiver.wait_trace(kept, _has_server)
        dropped = "88888888888888888888888888888888"
        r = httpx.post(gu + "/v1/completions", json=body, headers=_traceparent(dropped, flags="00"),
                       timeout=30)
        assert parse_traceparent(r.json()["saw_trace"]["traceparent"])[2] == 0
        time.sleep(1.0)
        assert receiver.of_trace(f"{new_trace:032x}") == [] and receiver.of_trace(dropped) == []
    finally:
        g.stop()
        w.stop()


def test_a_stopping_gateway_exports_its_last_spans(receiver):
    """With a batch delay of a minute, the spans still queued when the gateway stops are
    exported during its stop."""
    w, wu = start_echo_worker()
    g, gu = start_gateway("--workers", wu, "--otlp-traces-endpoint", receiver.url,
                          env={"OTEL_BSP_SCHEDULE_DELAY": "60000"})
    try:
        trace_id = "99999999999999999999999999999999"
        r = httpx.post(gu + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1},
                       headers=_traceparent(trace_id), timeout=30)
        assert r.status_code == 200
        time.sleep(0.3)
        assert receiver.of_trace(trace_id) == []
        t0 = time.monotonic()
        g.kill(15)  # SIGTERM
        assert time.monotonic() - t0 < 10
        assert _has_server(receiver.of_trace(trace_id)), g.output()[-2000:]
    finally:
        g.stop()
        w.stop()


def test_tracing_off_imports_no_opentelemetry():
    code = (
        "import sys\n"
        "from router.app import Gateway, build_app\n"
        "from router.config import load_router_config\n"
        "import router.ws_relay, router.ws_proxy, router.__main__\n"
        "build_app(Gateway(load_router_config(['--workers', 'http://127.0.0.1:9'])))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'router.trac'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_tracing_without_its_packages_stops_start_up_saying_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if the tracing extra were not installed\n"
        "from router.__main__ import main\n"
        "main(['--workers', 'http://127.0.0.1:9', '--port', '0',\n"
        "      '--otlp-traces-endpoint', 'http://127.0.0.1:4318'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and lines and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("error: --otlp-traces-endpoint") and "pip install '.[tracing]'" in lines[-1]


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
         (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, 1)),
        (" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00 ",
         (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, 0)),
        # A later version may carry more fields: read as version 00.
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
         (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, 1)),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None),
        ("garbage", None),
        (None, None),
    ],
)
def test_traceparent_parsing(header, parsed):
    assert parse_traceparent(header) == parsed
