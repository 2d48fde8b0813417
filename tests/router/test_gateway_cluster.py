"""The gateway with real parts: sim workers, the scheduler and two gateway replicas, all
separate processes on 127.0.0.1. The official openai client, WebSocket, /v1/models, auth,
replicas, bad input."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import brotli
import httpx
import openai
import pytest

try:
    from compression import zstd  # Python 3.14+
except ImportError:
    from backports import zstd

from tests.router.procs import series_value, start_gateway, start_scheduler, start_sim_workers
from tests.router.stand_ins import open_leases, until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    procs = []
    try:
        (w1, u1), (w2, u2) = start_sim_workers(2)
        procs += [w1, w2]
        s, su = start_scheduler([u1, u2], "--scrape-interval-ms", "100")
        procs.append(s)
        keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
        keyfile.write_text("# gateway keys\nkey-one\nkey-two\n")
        ga, gua = start_gateway("--scheduler", su, "--debug-headers", "--max-body-bytes", "65536")
        procs.append(ga)
        gb, gub = start_gateway("--scheduler", su, "--api-key-file", str(keyfile))
        procs.append(gb)
        yield {"gw": gua, "gw_auth": gub, "scheduler": su, "workers": [u1, u2], "gw_proc": ga}
    finally:
        for p in procs:
            p.stop()


def test_openai_client_through_the_gateway(cluster):
    c = openai.OpenAI(base_url=cluster["gw"] + "/v1", api_key="none", max_retries=0, timeout=30)
    r = c.completions.create(model="m", prompt="The capital of France is", max_tokens=6)
    assert r.usage.completion_tokens == 6 and r.choices[0].text
    r = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].message.content

    chunks = list(c.completions.create(model="m", prompt="Once upon a time", max_tokens=8, stream=True))
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) >= 7
    assert all(ch.usage is None for ch in chunks)  # the gateway's own usage request is hidden

    chunks = list(
        c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text


def test_worker_and_decision_headers(cluster):
    r = httpx.post(
        cluster["gw"] + "/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200
    worker_ids = {
        w["worker_id"]: w["url"]
        for w in httpx.get(cluster["scheduler"] + "/v1/workers").json()["workers"]
    }
    assert r.headers["x-router-worker"] in worker_ids
    assert r.headers["x-router-policy"] == "llm_aware"
    assert "x-router-score" in r.headers and "x-router-data-age-ms" in r.headers
    assert json.loads(r.headers["x-router-reason"])


def test_models_is_the_union_of_healthy_workers(cluster):
    r = httpx.get(cluster["gw"] + "/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["m"]
    assert httpx.get(cluster["gw"] + "/v1/models/m").json()["id"] == "m"
    assert httpx.get(cluster["gw"] + "/v1/models/other").status_code == 404


def test_unknown_model_is_404_from_the_scheduler(cluster):
    r = httpx.post(cluster["gw"] + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_websocket_round_trip(cluster):
    async with aiohttp.ClientSession() as s, s.ws_connect(cluster["gw"] + "/v1/ws") as ws:
        for body in (
            {"model": "m", "prompt": "hello", "max_tokens": 4},
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ):
            await ws.send_str(json.dumps(body))
            chunks = []
            while True:
                msg = json.loads((await ws.receive(timeout=30)).data)
                if msg.get("type") == "done" or "error" in msg:
                    break
                chunks.append(msg)
            assert msg.get("type") == "done", msg
            assert len([c for c in chunks if c.get("choices")]) >= body["max_tokens"]


def test_two_replicas_against_one_scheduler(cluster):
    body = {"model": "m", "prompt": "replica", "max_tokens": 3}
    auth = {"Authorization": "Bearer key-two"}

    def call(i: int) -> int:
        url = cluster["gw"] if i % 2 else cluster["gw_auth"]
        return httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60).status_code

    with ThreadPoolExecutor(8) as ex:
        assert list(ex.map(call, range(16))) == [200] * 16


def test_one_request_id_from_client_through_gateway_to_worker(cluster):
    """The id in the gateway's log is the one the worker answers under (`cmpl-<id>`, as vLLM
    takes X-Request-Id), a client's own X-Request-Id is kept for tracing, and two replicas
    started together never hand out the same id (older vLLM releases fail a second request whose id
    is still in flight)."""
    body = {"model": "m", "prompt": "trace me", "max_tokens": 2}
    r = httpx.post(cluster["gw"] + "/v1/completions", json=body, timeout=30)
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    r = httpx.post(cluster["gw"] + "/v1/completions", json=body, timeout=30,
                   headers={"X-Request-Id": "client-trace-42"})
    assert r.headers["x-request-id"] == "client-trace-42"
    assert r.json()["id"] == "cmpl-client-trace-42"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "id=client-trace-42 " not in cluster["gw_proc"].output():
        time.sleep(0.05)
    assert "router.access: id=client-trace-42 " in cluster["gw_proc"].output()
    # An id that is not a plain token (a log line could be forged with it) is replaced.
    r = httpx.post(cluster["gw"] + "/v1/completions", json=body, timeout=30,
                   headers={"X-Request-Id": "x" * 200})
    assert r.status_code == 200 and r.headers["x-request-id"] != "x" * 200
    # Both replicas' first requests: ids differ (they used to be start second + counter).
    auth = {"Authorization": "Bearer key-one"}
    ids = {httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30).headers["x-request-id"]
           for url in (cluster["gw"], cluster["gw_auth"])}
    assert len(ids) == 2 and len({i.split("-")[0] for i in ids}) == 2


def test_auth_on_and_off(cluster):
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    assert httpx.post(cluster["gw"] + "/v1/completions", json=body, timeout=30).status_code == 200  # off
    url = cluster["gw_auth"] + "/v1/completions"
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer key-three"}).status_code == 401
    assert (
        httpx.post(url, json=body, headers={"Authorization": "Bearer key-one"}, timeout=30).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b"{oops", 400),
        (b'"a string"', 400),
        (b'{"prompt": "x"}', 400),
        (b'{"model": ["m"]}', 400),
        (b'{"model": "m", "prompt": "' + b"y" * 70_000 + b'"}', 413),
        (b"[" * 5000 + b"]" * 5000, 400),  # deeper than json.loads' stack: RecursionError
        (b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
        (b'{"model": "\\ud800", "prompt": "x"}', 400),  # a lone surrogate: no UTF-8 for the scheduler
    ],
)
def test_bad_input_is_4xx_never_5xx(cluster, content, status):
    r = httpx.post(
        cluster["gw"] + "/v1/chat/completions",
        content=content,
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # A model name once taken into a label must not break the page for good.
    assert httpx.get(cluster["gw"] + "/metrics", timeout=30).status_code == 200


@pytest.mark.parametrize("options", [{"include_usage": "yes"}, {"include_usage": 1},
                                     {"continuous_usage_stats": "x"}])
def test_stream_options_of_the_wrong_type_are_a_400_as_at_the_worker(cluster, options):
    """The gateway asks the worker for usage by rewriting stream_options: it made these valid
    (a 200, the usage hidden) where the worker refuses them."""
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True, "stream_options": options}
    for url in (cluster["gw"], cluster["workers"][0]):
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["param"] == "stream_options." + next(iter(options))


def test_a_previous_response_id_that_is_not_text_is_a_400(cluster):
    r = httpx.post(cluster["gw"] + "/v1/responses", timeout=30, headers={"Content-Type": "application/json"},
                   content=b'{"model": "m", "input": "x", "previous_response_id": "\\udc00"}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_an_empty_previous_response_id_is_not_found_as_vllm_says(cluster):
    """vLLM looks the empty id up (a 404 "not found"); the gateway answered 400 "must be a
    non-empty string" (benchmarks/vllm_diff_fuzz.py)."""
    r = httpx.post(cluster["gw"] + "/v1/responses", timeout=30,
                   json={"model": "m", "input": "x", "previous_response_id": ""})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_a_plain_get_of_the_websocket_endpoint_is_a_json_400(cluster):
    r = httpx.get(cluster["gw"] + "/v1/ws", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_websocket_handshake"


@pytest.mark.parametrize("first", [
    "[" * 5000 + "]" * 5000,
    '{"model": "\\ud800", "prompt": "x"}',
])
async def test_websocket_first_message_that_breaks_the_parser_or_the_name_is_a_400(cluster, first):
    async with aiohttp.ClientSession() as s, s.ws_connect(cluster["gw"] + "/v1/ws") as ws:
        await ws.send_str(first)
        msg = await ws.receive(timeout=30)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        assert json.loads(msg.data)["error"]["code"] == 400


async def test_websocket_messages_before_the_first_request_leave_the_socket_open(cluster):
    """Before its first request places the socket, a message that is no request (binary, not
    JSON, a list, a model that is not text) got its 400 and the socket closed, and a
    cancel with nothing to cancel got one too ("no 'model'"). Now each is answered as the worker
    answers it on a placed socket: the 400 and the socket stays open (the cancel dropped), and
    the request after them is served."""
    good = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2})
    async with aiohttp.ClientSession() as s, s.ws_connect(cluster["gw"] + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"type": "cancel"}))
        await ws.send_bytes(good.encode())
        for text in ("hello", "[]", '"m"', json.dumps({"model": ["m"]}), json.dumps({"model": 5}),
                     "[" * 5000 + "]" * 5000):
            await ws.send_str(text)
        await ws.send_str(good)
        answers = []
        while not answers or answers[-1].get("type") != "done":
            msg = await ws.receive(timeout=30)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg  # it used to close after the first
            answers.append(json.loads(msg.data))
        errors = [a["error"] for a in answers if "error" in a]
        assert len(errors) == 7 and {e["code"] for e in errors} == {400}, answers
        assert all(set(e) == {"message", "type", "param", "code"} for e in errors)
        chunks = [a for a in answers if a.get("object") == "text_completion"]
        assert chunks and answers[-1]["id"] == chunks[0]["id"], answers


async def test_websocket_first_request_not_placeable_leaves_the_socket_open_for_the_next(cluster):
    """A first request the gateway could not place (here an unknown model, 404; no worker and a
    full queue take the same path) got its error and the socket was closed, so a client that
    corrected the model name had to reconnect. Now the error comes as before and the socket
    stays open, unplaced: the next request places it afresh and is answered. The refusal is one
    answer of the socket (its own access-log line, counted once in router_requests_total), and
    no lease is left behind."""
    gw, sid = cluster["gw"], "ws-refused-then-served"
    refused = 'router_requests_total{model="unknown",status="404",worker="-"}'
    refused0 = await asyncio.to_thread(series_value, gw, refused, 0.0)
    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws",
                                                          headers={"X-Request-Id": sid}) as ws:
        await ws.send_str(json.dumps({"model": "no-such-model", "prompt": "hello", "max_tokens": 2}))
        msg = await ws.receive(timeout=30)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        error = json.loads(msg.data)["error"]
        assert error["code"] == 404 and "no-such-model" in error["message"], error
        await until(lambda: open_leases(cluster["scheduler"]) == 0)  # the refusal holds none
        await ws.send_str(json.dumps({"model": "m", "prompt": "hello", "max_tokens": 3}))
        answers = []
        while not answers or answers[-1].get("type") != "done":
            msg = await ws.receive(timeout=30)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg  # it used to be closed by now
            answers.append(json.loads(msg.data))
        assert not [a for a in answers if "error" in a], answers
        chunks = [a for a in answers if a.get("object") == "text_completion"]
        assert len(chunks) == 3 and answers[-1]["id"] == chunks[0]["id"], answers
        assert not answers[-1].get("cancelled")
    await until(lambda: open_leases(cluster["scheduler"]) == 0)

    def lines() -> dict[str, str]:
        found = re.findall(rf"router\.access: id=({re.escape(sid)}(?:\.\d+)?) (.*)",
                           cluster["gw_proc"].output())
        return dict(found)

    await until(lambda: sid in lines())  # the socket's line comes at its close
    logged = lines()
    assert sorted(logged) == [sid, sid + ".1", sid + ".2"], logged
    assert "model=no-such-model worker=- status=404 " in logged[sid + ".1"]
    assert "model=m " in logged[sid + ".2"] and " status=200 " in logged[sid + ".2"]
    # The socket's line is its placement's: the model and worker of the request that placed it.
    assert "model=m " in logged[sid] and " status=101 " in logged[sid] and "worker=-" not in logged[sid]
    assert await asyncio.to_thread(series_value, gw, refused, 0.0) - refused0 == 1


async def test_websocket_a_deeply_nested_message_is_answered_and_the_socket_goes_on(cluster):
    good = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2})
    async with aiohttp.ClientSession() as s, s.ws_connect(cluster["gw"] + "/v1/ws") as ws:
        for text in (good, "[" * 5000 + "]" * 5000, good):
            await ws.send_str(text)
        ends = []
        while len(ends) < 3:
            msg = await ws.receive(timeout=30)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg  # the relay used to die here: closed
            body = json.loads(msg.data)
            if body.get("type") == "done" or "error" in body:
                ends.append(body)
        assert [e.get("type") for e in ends] == ["done", None, "done"]
        assert ends[1]["error"]["code"] == "invalid_json"  # the worker's word, not a 500


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_body_its_content_encoding_does_not_match_is_a_400(cluster, encoding):
    r = httpx.post(cluster["gw"] + "/v1/completions", content=b'{"model": "m", "prompt": "x"}',
                   headers={"Content-Type": "application/json", "Content-Encoding": encoding}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body"
    time.sleep(0.2)  # aiohttp would log the body's error after the answer
    assert "Traceback" not in cluster["gw_proc"].output()


@pytest.mark.parametrize(
    ("encoding", "compress"), [("gzip", gzip.compress), ("br", brotli.compress), ("zstd", zstd.compress)]
)
def test_a_compressed_body_is_served(cluster, encoding, compress):
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 3}).encode()
    r = httpx.post(cluster["gw"] + "/v1/completions", content=compress(body), timeout=30,
                   headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# Values of every JSON type and edge, put into the fields clients send, a few at a time.
ODD_VALUES = [None, True, 0, -1, 2**63, 1e308, -0.5, 3.7, "", "x", "0", [], [1], ["a"], [[1, 2]], {},
              {"a": 1}, "a" * 3000, [{"role": "user"}], [{"role": 1, "content": 2}], [None], [-5],
              [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]]
REQUEST_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
                  "top_p", "top_k", "n", "stream", "stop", "seed", "logprobs", "top_logprobs",
                  "presence_penalty", "frequency_penalty", "stream_options", "min_tokens", "ignore_eos",
                  "echo", "best_of", "logit_bias", "response_format", "tools", "tool_choice", "priority"]


def test_random_malformed_requests_get_4xx_in_the_openai_shape_never_5xx(cluster):
    """Seeded: 160 requests, each a valid body with 1-3 fields set to odd values, through the
    gateway to the sim workers. Whatever the gateway or the worker rejects is a 4xx with an
    OpenAI error object; whatever is accepted streams to [DONE]."""
    rng = random.Random(7)
    with httpx.Client(timeout=30) as client:
        for i in range(160):
            chat = i % 2 == 1
            body = {"model": "m", "max_tokens": 3,
                    **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
            for field in rng.sample(REQUEST_FIELDS, rng.randint(1, 3)):
                body[field] = rng.choice(ODD_VALUES)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            r = client.post(cluster["gw"] + path, json=body)
            assert r.status_code < 500, (body, r.status_code, r.text[:300])
            if r.status_code >= 400:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], body
            elif body.get("stream") is True:
                assert r.text.rstrip().endswith("data: [DONE]"), (body, r.text[-300:])


def test_wrong_types_rejected_by_worker_stay_4xx(cluster):
    r = httpx.post(
        cluster["gw"] + "/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": "many"},
        timeout=30,
    )
    assert 400 <= r.status_code < 500 and "error" in r.json()


def _series_sum(worker_url: str, name: str) -> float:
    text = httpx.get(worker_url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def test_client_disconnect_mid_stream_aborts_the_request_on_the_worker(cluster):
    """The client hangs up after a few chunks: the gateway closes its upstream request and the
    worker aborts the request, long before its 400 tokens would be done. As on vLLM v1, an
    aborted request is not counted as finished: what shows it is that the worker stops running
    it with far fewer tokens generated, and no request_success_total moves."""
    names = ("vllm:generation_tokens_total", "vllm:request_success_total")
    before = {u: {n: _series_sum(u, n) for n in names} for u in cluster["workers"]}
    body = {"model": "m", "prompt": "a long answer", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", cluster["gw"] + "/v1/completions", json=body, timeout=30) as r:
        worker_id = r.headers["x-router-worker"]
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    worker = next(u for u in cluster["workers"] if u.endswith(worker_id.split("//")[-1]))
    deadline = time.monotonic() + 10
    while _series_sum(worker, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _series_sum(worker, "vllm:num_requests_running") == 0
    generated = _series_sum(worker, names[0]) - before[worker][names[0]]
    assert 1 <= generated < 200, generated  # it ran, and stopped early
    assert _series_sum(worker, names[1]) == before[worker][names[1]]


def test_client_gone_before_the_answer_gives_the_lease_back(cluster):
    def leases() -> int:
        return sum(
            w["in_flight_leases"]
            for w in httpx.get(cluster["scheduler"] + "/v1/workers").json()["workers"]
        )

    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            cluster["gw"] + "/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 300},
            timeout=0.3,
        )
    deadline = time.monotonic() + 5
    while leases() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leases() == 0


def _prefilled_reports(cluster) -> float:
    text = httpx.get(cluster["scheduler"] + "/metrics").text
    m = re.search(r'^scheduler_prefilled_reports_total\{outcome="ok"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _stream_one(gateway: str) -> None:
    body = {"model": "m", "prompt": "count to ten", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass


def _wait_reports(cluster, expected: float) -> None:
    deadline = time.monotonic() + 5
    while _prefilled_reports(cluster) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _prefilled_reports(cluster) == expected


async def _websocket_one(gateway: str) -> None:
    async with aiohttp.ClientSession() as s, s.ws_connect(gateway + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}))
        while json.loads((await ws.receive(timeout=30)).data).get("type") != "done":
            pass


def test_streamed_first_token_is_reported_to_the_scheduler(cluster):
    # The first chunk of a stream means the worker has prefilled the prompt: the gateway (reports
    # are on by default) tells the scheduler at once (the worker's prompt counter would show it
    # only at the next scrape).
    expected = _prefilled_reports(cluster) + 1
    _stream_one(cluster["gw"])
    _wait_reports(cluster, expected)
    expected += 1
    asyncio.run(_websocket_one(cluster["gw"]))  # a WebSocket connection's first answer too
    _wait_reports(cluster, expected)
    # A non-streamed answer has no first token to report; a gateway run with
    # --no-report-prefilled stays quiet.
    r = httpx.post(cluster["gw"] + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200
    quiet, quiet_url = start_gateway("--scheduler", cluster["scheduler"], "--no-report-prefilled")
    try:
        _stream_one(quiet_url)
    finally:
        quiet.stop()
    time.sleep(0.3)
    assert _prefilled_reports(cluster) == expected
