"""The gateway in front of stand-in workers (benchmarks/echo_worker.py: "any OpenAI-compatible
worker"), without a scheduler: round robin over --workers. Covers the HTTP surface that does
not depend on the scheduler: the openai client, base path, auth, body limits, bad input,
retries on a dead worker, metrics and the WebSocket proxy."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import re
import statistics
import time

import httpx
import openai
import pytest

from tests.router.procs import free_port, series_value, start_echo_worker, start_gateway, start_sim_worker

BASE = "/api/predict/grp.svc_llm_gateway"


@pytest.fixture(scope="module")
def stack():
    w1, u1 = start_echo_worker()
    w2, u2 = start_echo_worker()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here: connection refused
    g, gu = start_gateway(
        "--workers",
        f"{dead},{u1},{u2}",
        "--base-path",
        BASE,
        "--max-body-bytes",
        "4096",
        "--retry-count",
        "2",
        "--debug-headers",
    )
    ga, gau = start_gateway("--workers", u1, "--api-keys", "sekret", "--admin-token", "adm")
    yield {"gw": gu, "gw_auth": gau, "workers": [u1, u2], "procs": [g, ga, w1, w2]}
    for p in (g, ga, w1, w2):
        p.stop()


def test_openai_client_chat_and_completions_stream_and_not(stack):
    c = openai.OpenAI(base_url=stack["gw"] + "/v1", api_key="unused", max_retries=0)
    r = c.completions.create(model="m", prompt="hello", max_tokens=5)
    assert r.choices[0].text == " tok" * 5 and r.usage.completion_tokens == 5
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].message.content == " tok" * 4
    chunks = list(
        c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " tok" * 6
    assert all(ch.usage is None for ch in chunks)  # the usage the gateway asked for is not shown
    chunks = list(
        c.completions.create(
            model="m", prompt="x", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []


def test_base_path_and_worker_header(stack):
    r = httpx.post(
        stack["gw"] + BASE + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1}
    )
    assert r.status_code == 200
    assert r.headers["x-router-worker"] in stack["workers"]
    assert r.headers["x-router-policy"] == "fallback_round_robin"


def test_dead_worker_is_retried_before_first_byte(stack):
    for _ in range(6):  # the dead worker is first in the rotation: every request must still succeed
        r = httpx.post(
            stack["gw"] + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1}
        )
        assert r.status_code == 200
    m = httpx.get(stack["gw"] + "/metrics").text
    assert 'router_retries_total{reason="connect"}' in m


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"model": ["m"], "prompt": "x"}', 400),
        (b'{"model": 5, "prompt": "x"}', 400),
        (b'{"model": "m", "prompt": "x", "stream": "maybe"}', 400),
        (b'{"model": "m", "prompt": "x", "stream": 2}', 400),
        (b'{"model": "m", "prompt": "x", "priority": 1.5}', 400),
        (b'{"model": "m", "prompt": "x", "stream": true, "stream_options": 3}', 400),
        (b'{"model": "m", "prompt": "' + b"x" * 5000 + b'"}', 413),
        (b"\xff\xfe", 400),
    ],
)
def test_bad_input_gets_openai_shaped_4xx(stack, content, status):
    r = httpx.post(
        stack["gw"] + "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("spelling", [b'"true"', b'"yes"', b"1", b"1.0"])
def test_a_stream_spelt_as_vllm_takes_it_is_relayed_as_a_stream(stack, spelling):
    """vLLM's pydantic models (lax mode) take these for true, and so stream: the gateway answered
    400 "'stream' must be a boolean" to requests that worked without it."""
    content = b'{"model": "m", "prompt": "x", "max_tokens": 3, "priority": "2", "stream": %b}' % spelling
    with httpx.stream("POST", stack["gw"] + "/v1/completions", content=content, timeout=30,
                      headers={"Content-Type": "application/json"}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " tok" * 3
    assert all(c.get("usage") is None for c in chunks)  # the usage the gateway asked for is hidden


def test_usage_asked_for_as_vllm_takes_it_is_shown(stack):
    """`"include_usage": "true"` is vLLM's true: the client asked for the usage chunk. Read as
    not asked, the gateway would hide the chunk it gets."""
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": "true"}}
    with httpx.stream("POST", stack["gw"] + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 3


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_generation_endpoints_take_only_post(stack, method):
    r = httpx.request(method, stack["gw"] + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/nonexistent"), ("POST", "/v1/chat/completion"), ("GET", "/v1/"), ("GET", "/v2/models")],
)
def test_unknown_path_is_404_not_a_missing_model(stack, method, path):
    r = httpx.request(method, stack["gw"] + path)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "not_found" and path in err["message"]


@pytest.mark.parametrize("path", ["/x%0a", "/v1/responses/resp_a%0d%0aX:%20y", "/%0a/v1/completions"])
def test_a_path_with_an_escaped_newline_is_a_404_in_the_openai_shape(stack, path):
    """The catch-all route's `.*` stopped at a newline: such a path matched no route and got
    aiohttp's plain-text 404."""
    r = httpx.get(stack["gw"] + path)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "not_found" and set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("method", "path", "allow"), [("POST", "/v1/models", "GET, HEAD"), ("PUT", "/health", "GET, HEAD")]
)
def test_wrong_method_on_a_gateway_route_is_405_in_the_openai_shape(stack, method, path, allow):
    r = httpx.request(method, stack["gw"] + path)
    assert r.status_code == 405 and r.headers["allow"] == allow
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_model_endpoint_without_model_goes_to_the_pools_model_and_a_bad_one_names_the_field(stack):
    """No model on a model endpoint is no wrong path (a 404): vLLM serves its model, and so does
    the pool's one model here (router/default_model.py); a model that is no name is a 400."""
    r = httpx.post(stack["gw"] + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 200, r.text
    r = httpx.post(stack["gw"] + "/v1/embeddings", json={"model": 5, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_compressed_body_is_forwarded_decoded(stack):
    # The gateway reads (decodes) the body and forwards those bytes: a Content-Encoding header
    # sent on with them would make the worker decode them a second time.
    body = json.dumps({"model": "m", "input": ["hello", "four"]}).encode()
    r = httpx.post(
        stack["gw"] + "/v1/embeddings", content=gzip.compress(body),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 200, r.text
    assert [d["embedding"] for d in r.json()["data"]] == [[5.0], [4.0]]


def test_unknown_model_is_4xx_from_worker(stack):
    r = httpx.post(stack["gw"] + "/v1/completions", json={"model": "nope", "prompt": "p"})
    assert r.status_code == 404 and "error" in r.json()
    # A model name a client invented opens no label set of token counters or latency
    # histograms (only router_requests_total counts it, under model="unknown").
    m = httpx.get(stack["gw"] + "/metrics").text
    assert 'model="nope"' not in m
    assert 'router_requests_total{model="unknown",status="404",worker="-"}' in m


def test_auth_on(stack):
    url = stack["gw_auth"]
    body = {"model": "m", "prompt": "p", "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    assert (
        httpx.post(
            url + "/v1/completions", json=body, headers={"Authorization": "Bearer bad"}
        ).status_code
        == 401
    )
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 401
    m = httpx.get(url + "/metrics", headers={"Authorization": "Bearer adm"})
    assert m.status_code == 200 and "router_requests_total" in m.text
    assert httpx.get(url + "/v1/models").status_code == 401


def test_metrics_names(stack):
    httpx.post(
        stack["gw"] + "/v1/completions",
        json={"model": "m", "prompt": "p", "max_tokens": 2, "stream": True},
    )
    m = httpx.get(stack["gw"] + "/metrics").text
    for name in (
        "router_requests_total",
        "router_requests_in_flight",
        "router_requests_queued",
        "router_prompt_tokens_total",
        "router_generation_tokens_total",
        "router_time_to_first_token_seconds_bucket",
        "router_time_per_output_token_seconds_bucket",
        "router_e2e_request_latency_seconds_bucket",
        "router_queue_wait_seconds_bucket",
        "router_fallback_mode",
        "router_fallback_requests_total",
    ):
        assert name in m, name
    assert "router_fallback_mode 1.0" in m  # no scheduler configured: round robin


async def test_websocket_round_trip(stack):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.ws_connect(stack["gw"] + "/v1/ws") as ws:
        for _ in range(2):  # two requests on one socket
            await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}))
            msgs = []
            while True:
                msg = json.loads((await ws.receive(timeout=10)).data)
                msgs.append(msg)
                if msg.get("type") in ("done", "end") or "error" in msg:
                    break
            assert len(msgs) == 4 and msgs[-1]["type"] in ("done", "end")
    # A binary first frame is answered with an error, not a silent close.
    async with aiohttp.ClientSession() as s, s.ws_connect(stack["gw"] + "/v1/ws") as ws:
        await ws.send_bytes(b'{"model": "m"}')
        err = json.loads((await ws.receive(timeout=10)).data)["error"]
        assert err["code"] == 400 and "text message" in err["message"]


def test_models_of_static_workers_are_discovered(stack):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ids = [m["id"] for m in httpx.get(stack["gw"] + "/v1/models").json()["data"]]
        if ids:
            break
        time.sleep(0.2)
    assert ids == ["m"]


def _chunk_gaps(url: str) -> list[float]:
    body = {"model": "m", "prompt": "p", "max_tokens": 12, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times[:-1])]  # [DONE] follows the last chunk at once


def test_chunks_are_forwarded_as_they_come_no_nagle_delay():
    """A worker that spaces its chunks 5 ms apart: through the gateway the spacing stays about
    the same (Nagle + delayed ACK would make it ~40 ms; buffering would bunch them up)."""
    w, wu = start_echo_worker(token_delay_ms=5)
    g, gu = start_gateway("--workers", wu)
    try:
        direct = statistics.median(_chunk_gaps(wu) + _chunk_gaps(wu))
        through = statistics.median(_chunk_gaps(gu) + _chunk_gaps(gu))
        assert through < 3 * direct, (direct, through)
        assert through > 0.3 * direct  # not bunched up
    finally:
        g.stop()
        w.stop()


def _access_line(stack, rid: str) -> str:
    """The gateway's access log line of request `rid` (written in batches: waited for)."""
    deadline = time.monotonic() + 5
    line = ""
    while time.monotonic() < deadline and not line:
        line = next((x for x in stack["procs"][0].output().splitlines()
                     if f"router.access: id={rid} " in x), "")  # not a retry line of the same id
        time.sleep(0.05)
    return line


def test_access_log_line_per_request(stack):
    r = httpx.post(
        stack["gw"] + "/v1/completions",
        json={"model": "m", "prompt": "log me", "max_tokens": 3, "stream": True},
    )
    line = _access_line(stack, r.headers["x-request-id"])
    for field in (
        "model=m",
        "worker=http://",
        "status=200",
        "queue_ms=",
        "ttft_ms=",
        "tokens_in=",
        "tokens_out=3",
    ):
        assert field in line, (field, line)


@pytest.mark.parametrize("refused", [{"priority": "high"}, {"stream_options": 3},
                                     {"stream_options": {"include_usage": "maybe"}}],
                         ids=["priority", "stream_options", "include_usage"])
def test_a_stream_refused_for_a_later_field_is_logged_as_a_stream(stack, refused):
    """A stream request answered 400 for its priority or stream_options: its access line (and
    span) says stream=1, as before router/request_checks.py, which checks those after the
    stream flag is known."""
    rid = f"refused-stream-{next(iter(refused))}-{len(str(refused))}"
    r = httpx.post(stack["gw"] + "/v1/completions", headers={"X-Request-Id": rid},
                   json={"model": "m", "prompt": "x", "stream": True, **refused})
    assert r.status_code == 400, r.text
    line = _access_line(stack, rid)
    assert "status=400" in line and "stream=1" in line, line


async def _ws_answers_then_a_bad_message(gw: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        for max_tokens in (3, 5):
            await ws.send_str(json.dumps({"model": "m", "prompt": "ws log", "max_tokens": max_tokens}))
            while json.loads((await ws.receive(timeout=10)).data).get("type") != "done":
                pass
        await ws.send_str("[1, 2]")  # no request: the worker answers it with a 400
        assert "error" in json.loads((await ws.receive(timeout=10)).data)


def test_access_log_line_per_websocket_request(stack):
    """DESIGN.md: one access-log line per request. A WebSocket had one for its whole life (at
    its close, status 101); each answer now has its own, with its worker, status, TTFT and
    tokens, under the socket's id and its number on the socket."""
    asyncio.run(_ws_answers_then_a_bad_message(stack["gw"]))
    deadline = time.monotonic() + 10
    while True:
        lines = [x for x in stack["procs"][0].output().splitlines() if " WS /v1/ws " in x]
        sockets = [x for x in lines if "status=101" in x]
        if sockets:
            socket_id = re.search(r"id=(\S+) ", sockets[-1]).group(1)
            answers = [x for x in lines if f"id={socket_id}." in x]
            if len(answers) == 3:
                break
        assert time.monotonic() < deadline, lines[-6:]
        time.sleep(0.05)
    first, second, bad = sorted(answers, key=lambda x: re.search(r"id=\S+\.(\d+) ", x).group(1))
    for line, tokens in ((first, 3), (second, 5)):
        for field in ("status=200", "worker=http://", f"tokens_out={tokens}", "model=m", "stream=1"):
            assert field in line, (field, line)
        assert re.search(r"ttft_ms=\d", line), line
    assert "status=400" in bad and "tokens_out=0" in bad, bad


def _tokens_counted(gw: str, kind: str = "generation") -> float:
    return series_value(gw, f'router_{kind}_tokens_total{{model="m"}}', 0.0)


async def _two_websocket_requests(gw: str, max_tokens: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        for _ in range(2):  # 40 characters: a 10-token prompt by the gateway's estimate
            await ws.send_str(json.dumps({"model": "m", "prompt": "a" * 40, "max_tokens": max_tokens}))
            while json.loads((await ws.receive(timeout=10)).data).get("type") != "done":
                pass


def test_tokens_of_abandoned_streams_and_websockets_are_counted():
    """Tokens a worker generated count in the gateway's token counter and access log even
    when no usage closes the stream: an SSE client that leaves mid-answer, and WebSocket
    traffic (whose usage chunks belong to the client)."""
    w, wu = start_echo_worker(token_delay_ms=20)
    g, gu = start_gateway("--workers", wu)
    try:
        body = {"model": "m", "prompt": "p", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", gu + "/v1/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen == 10:
                    break  # leave after 10 tokens of 200
        deadline = time.monotonic() + 5
        line = ""
        while time.monotonic() < deadline and not line:
            line = next((x for x in g.output().splitlines() if f"router.access: id={rid} " in x), "")
            time.sleep(0.05)
        assert "status=499" in line and "error=client_disconnected" in line, line
        tokens_out = int(line.split("tokens_out=")[1].split()[0])
        assert 10 <= tokens_out < 200, line
        assert _tokens_counted(gu) == tokens_out

        prompt_before = _tokens_counted(gu, "prompt")
        asyncio.run(_two_websocket_requests(gu, 3))
        deadline = time.monotonic() + 5  # the socket's record is logged once it has closed
        while time.monotonic() < deadline and _tokens_counted(gu) < tokens_out + 6:
            time.sleep(0.05)
        assert _tokens_counted(gu) == tokens_out + 6
        assert _tokens_counted(gu, "prompt") == prompt_before + 2 * 10  # both requests' prompts
    finally:
        g.stop()
        w.stop()


def test_a_client_id_reused_while_in_flight_is_made_unique():
    """Older vLLM releases fail a second request under the id of one they are running, so two
    requests with one X-Request-Id at once leave the gateway with different ids; the first
    keeps the client's, and once it has ended the id is free again."""
    w, wu = start_echo_worker(token_delay_ms=20)
    g, gu = start_gateway("--workers", wu)
    try:
        body = {"model": "m", "prompt": "p", "max_tokens": 10}
        same = {"X-Request-Id": "client-7"}
        # The first is a stream whose head has come: in flight (for 1 s more) when the second
        # is sent, however slow the machine (a thread and a 50 ms sleep were not, under load).
        streamed = {**body, "max_tokens": 50, "stream": True}
        with httpx.stream("POST", gu + "/v1/completions", json=streamed, headers=same, timeout=30) as first:
            second = httpx.post(gu + "/v1/completions", json=body, headers=same, timeout=30)
            ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
            first.read()
        assert ids[0] == "client-7" and ids[1] != "client-7" and ids[1].startswith("client-7-")
        again = httpx.post(gu + "/v1/completions", json=body, headers=same, timeout=30)
        assert again.headers["x-request-id"] == "client-7"
    finally:
        g.stop()
        w.stop()


def test_metrics_on_their_own_port_or_off():
    w, wu = start_echo_worker()
    mport = free_port()
    g1, gu1 = start_gateway("--workers", wu, "--metrics-port", str(mport))
    g2, gu2 = start_gateway("--workers", wu, "--no-allow-metrics")
    try:
        httpx.post(gu1 + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 1})
        assert httpx.get(gu1 + "/metrics").status_code == 404
        m = httpx.get(f"http://127.0.0.1:{mport}/metrics")
        assert m.status_code == 200 and 'router_requests_total{model="m",status="200"' in m.text
        assert httpx.get(gu2 + "/metrics").status_code == 404
    finally:
        for p in (g1, g2, w):
            p.stop()


def test_client_api_key_is_not_forwarded_unless_configured(stack):
    w1 = stack["workers"][0]
    body = {"model": "m", "prompt": "p", "max_tokens": 1}
    r = httpx.post(
        stack["gw_auth"] + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}
    )
    assert r.status_code == 200 and r.json()["saw_authorization"] is False
    g, gu = start_gateway("--workers", w1, "--api-keys", "sekret", "--forward-api-key")
    try:
        r = httpx.post(gu + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["saw_authorization"] is True
    finally:
        g.stop()


TRACE = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
         "tracestate": "vendor=opaque", "baggage": "tenant=acme"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_trace_context_and_flow_reach_the_worker_and_the_access_log(stack, path):
    """An engine that traces (vLLM with --otlp-traces-endpoint) must see the client's trace
    context, and the gateway's log line names the trace, to find the request by it."""
    body = {"model": "m", "max_tokens": 1, "prompt": "p", "messages": [{"role": "user", "content": "p"}]}
    r = httpx.post(stack["gw"] + BASE + path, json=body, headers=TRACE)
    assert r.status_code == 200 and r.json()["saw_trace"] == TRACE
    line = _access_line(stack, r.headers["x-request-id"])
    assert line.endswith(" trace=4bf92f3577b34da6a3ce929d0e0e4736"), line
    # A tenant's flow in the gateway's queue is named there too (a client-chosen value: quoted
    # when it has spaces, so it cannot forge a field).
    r = httpx.post(stack["gw"] + BASE + path, json=body,
                   headers={"x-gateway-inference-fairness-id": "team blue flow=x"})
    line = _access_line(stack, r.headers["x-request-id"])
    assert line.endswith(' flow="id:team blue flow=x"'), line


def test_the_request_timeout_holds_on_a_connection_a_stream_used_before():
    """During a stream the gateway's idle guard replaces aiohttp's read timeout on the
    connection; the next request on that pooled connection must get its own timeout."""
    w, wu = start_echo_worker(token_delay_ms=100)
    g, gu = start_gateway("--workers", wu, "--request-timeout-ms", "1000", "--retry-count", "0")
    try:
        with httpx.Client(timeout=30) as c:
            body = {"model": "m", "prompt": "p", "max_tokens": 3, "stream": True}
            with c.stream("POST", gu + "/v1/completions", json=body) as r:
                assert r.read().endswith(b"data: [DONE]\n\n")
            t0 = time.monotonic()
            r = c.post(gu + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 30})
            assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
            assert time.monotonic() - t0 < 2.5  # not the 3 s the worker takes
    finally:
        for p in (g, w):
            p.stop()


def test_request_first_byte_and_idle_stream_timeouts():
    """A worker that takes 400 ms per token. A non-stream answer comes whole at its end: a
    first-byte timeout of 150 ms does not cut it (it cut every answer longer than the timeout,
    then retried it elsewhere and reported the worker failed); a 150 ms request timeout does,
    with a 504 and no retry. With a generous first-byte timeout but a 150 ms idle timeout, a
    stream that started ends with an SSE error event instead of hanging."""
    w, wu = start_echo_worker(token_delay_ms=400)
    g1, gu1 = start_gateway("--workers", wu, "--first-byte-timeout-ms", "150", "--retry-count", "1",
                            "--request-timeout-ms", "150")
    g2, gu2 = start_gateway(
        "--workers", wu, "--first-byte-timeout-ms", "150", "--idle-stream-timeout-ms", "150",
        "--retry-count", "1",
    )
    try:
        body = {"model": "m", "prompt": "p", "max_tokens": 2}
        r = httpx.post(gu1 + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert series_value(gu1, 'router_retries_total{reason="timeout"}', 0.0) == 0
        r = httpx.post(gu2 + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert series_value(gu2, 'router_retries_total{reason="timeout"}', 0.0) == 0
        g2.stop()
        g2, gu2 = start_gateway(
            "--workers", wu, "--first-byte-timeout-ms", "5000", "--idle-stream-timeout-ms", "150"
        )
        body = {"model": "m", "prompt": "p", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", gu2 + "/v1/completions", json=body, timeout=30) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "idle_timeout" in json.loads(events[-2])["error"]["message"]
    finally:
        for p in (g1, g2, w):
            p.stop()


def test_a_header_past_aiohttps_8_kib_default_reaches_the_worker():
    """An identity token of 20 KB (many claims), forwarded to the worker: both take it, as
    vLLM does (aiohttp alone refuses a field over 8 KiB with a plain-text 400)."""
    w, wu = start_sim_worker("m")
    g, gu = start_gateway("--workers", wu, "--forward-api-key")
    token = "Bearer " + "x" * 20_000
    try:
        body = {"model": "m", "prompt": "p", "max_tokens": 2}
        r = httpx.post(gu + "/v1/completions", json=body, headers={"Authorization": token}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        g.stop()
        w.stop()


def test_a_refused_request_s_access_line_names_its_error():
    """A 4xx line said only its status: an operator grepping the access log for why requests
    fail saw `status=400` and nothing more. It names the answer's error code (else its type)."""
    w, wu = start_echo_worker()
    g, gu = start_gateway("--workers", wu)
    try:
        errors = {}
        for i, body in enumerate((b"{not json", b"[1, 2]")):
            rid = f"refused-{i}"
            r = httpx.post(gu + "/v1/completions", content=body,
                           headers={"Content-Type": "application/json", "X-Request-Id": rid})
            assert 400 <= r.status_code < 500, r.text
            err = r.json()["error"]
            errors[rid] = err["code"] if isinstance(err["code"], str) else err["type"]
        deadline = time.monotonic() + 5
        lines: dict[str, str] = {}
        while time.monotonic() < deadline and len(lines) < len(errors):
            for rid in errors:
                line = next((x for x in g.output().splitlines() if f"router.access: id={rid} " in x), "")
                if line:
                    lines[rid] = line
            time.sleep(0.05)
        for rid, want in errors.items():
            assert f"error={want}" in lines[rid], lines[rid]
    finally:
        g.stop()
        w.stop()
