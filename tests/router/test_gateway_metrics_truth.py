"""The gateway's numbers against what a client really got: real sim workers, scheduler and
gateway on 127.0.0.1, requests whose token counts come from the answers' usage or from the
chunks the client counted, and times the client measured itself. Only ratios of times
measured in the same run are compared, never absolute times."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.router.procs import (
    SimStack,
    series_value,
    sim_stack,
)
from tests.router.stand_ins import stand_ins_behind_router

_TPOT = 'router_time_per_output_token_seconds_{}{{model="m"}}'


@pytest.fixture(scope="module")
def stack() -> Iterator[SimStack]:
    with sim_stack(1) as st:
        yield st


def _stream(gw: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one request; returns its usage and the client's own time per output token per
    answer: first to last content chunk over the answer's tokens after its first."""
    first = last = None
    usage: dict[str, Any] | None = None
    with httpx.stream("POST", gw + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
                last = time.perf_counter()
                first = first or last
    assert usage is not None and first is not None and last is not None
    return {"usage": usage, "span": last - first}


@pytest.mark.parametrize(
    ("path", "body", "answers"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 1),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
        ("/v1/completions", {"prompt": ["one prompt", "another prompt"], "n": 2}, 4),
    ],
    ids=["chat", "chat-n3", "completions-batch2-n2"],
)
def test_time_per_output_token_is_per_answer_for_n_and_batches(
    stack: SimStack, path: str, body: dict[str, Any], answers: int
) -> None:
    """n answers (or a batch's) are generated side by side: dividing the stream's time by all
    their tokens together read n times too fast (a chat with n=3 showed a third of its real
    time per token, on the dashboard's TPOT panels and in their percentiles)."""
    gw = stack.gateway
    tokens = 30
    full = {"model": "m", "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    count0, sum0 = (series_value(gw, _TPOT.format(s), 0.0) for s in ("count", "sum"))
    seen = _stream(gw, path, full)
    assert seen["usage"]["completion_tokens"] == tokens * answers  # the tiny sim runs to max_tokens
    # The series is written when the request is done, just after the stream's end.
    deadline = time.monotonic() + 5
    while series_value(gw, _TPOT.format("count"), 0.0) == count0:
        assert time.monotonic() < deadline, "the request never reached the TPOT histogram"
        time.sleep(0.02)
    gateway_tpot = series_value(gw, _TPOT.format("sum")) - sum0
    client_tpot = seen["span"] / (tokens - 1)
    # Both time the same answer's tokens; they differ by delivery jitter (a busy machine can
    # delay either side's reads, hence the wide upper bound), not by a factor of n.
    assert 0.6 < gateway_tpot / client_tpot < 2.5, (gateway_tpot, client_tpot)


def _content_chunks(chunk: dict[str, Any]) -> int:
    """Choices in a chunk that carry text (a token each, as the sim writes one per chunk)."""
    return sum(1 for c in chunk.get("choices") or [] if (c.get("delta") or {}).get("content"))


def _wait_for_change(gw: str, series: str, before: float, timeout_s: float = 5.0) -> float:
    """The series' value once it moved from `before` (written when the request is done)."""
    deadline = time.monotonic() + timeout_s
    while (now := series_value(gw, series, 0.0)) == before:
        assert time.monotonic() < deadline, f"{series} never moved from {before}"
        time.sleep(0.02)
    return now


_GENERATED = 'router_generation_tokens_total{model="m"}'
# A killed worker's connection drops: aiohttp reads it as a payload error ("connection").
_STREAM_ERRORS = 'router_stream_errors_total{reason="connection"}'


def test_a_chat_stream_cut_by_its_worker_counts_the_tokens_it_carried_and_a_stream_error() -> None:
    """A stream cut short has no usage: the gateway counts its events. The role chunk that
    opens each choice of a chat stream is no token, yet counted as one: a worker that died
    mid-answer showed n tokens more than its client got (in the token counters, the tenant's
    token turns and the lease's KV credit). And the stream's status had gone out as 200, all
    that router_requests_total said of it: no metric counted the failure."""
    with sim_stack(1) as st:
        gw = st.gateway
        before = series_value(gw, _GENERATED, 0.0)
        errors0 = series_value(gw, _STREAM_ERRORS, 0.0)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
                "n": 2, "stream": True}
        got, events = 0, []
        with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    got += _content_chunks(events[-1])
                    if got >= 10 and all(p.alive() for p in st.workers.values()):
                        next(iter(st.workers.values())).kill()
        assert "error" in events[-1]  # it was cut: the gateway said so in the stream
        assert got < 2 * 300
        assert _wait_for_change(gw, _GENERATED, before) - before == got
        assert series_value(gw, _STREAM_ERRORS) - errors0 == 1


async def test_a_chat_answer_over_a_websocket_counts_its_tokens_not_its_role_chunks(
    stack: SimStack,
) -> None:
    """The socket's chunks are counted as tokens (the worker's usage there is the client's to
    ask for); the role chunk opening each choice was counted too, n tokens too many."""
    import aiohttp

    gw = stack.gateway
    before = series_value(gw, _GENERATED, 0.0)
    got = 0
    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 7, "n": 2}))
        for _ in range(100):  # bounded: 2 role chunks, 14 tokens and a `done`
            msg = json.loads((await ws.receive(timeout=30)).data)
            if msg.get("type") == "done":
                break
            assert "error" not in msg, msg
            got += _content_chunks(msg)
    assert got == 2 * 7
    assert _wait_for_change(gw, _GENERATED, before) - before == got


def test_a_made_up_model_name_refused_before_routing_opens_no_series(stack: SimStack) -> None:
    """A request refused before any worker took it (here a malformed body) was counted under
    its model as the client spelled it: each made-up name a series of its own, and past the
    bound (2,000) the real models' new series were counted as model "other"."""
    gw = stack.gateway
    unknown = 'router_requests_total{model="unknown",status="400",worker="-"}'
    real = 'router_requests_total{model="m",status="400",worker="-"}'
    unknown0, real0 = series_value(gw, unknown, 0.0), series_value(gw, real, 0.0)
    names = [f"made-up-{i}" for i in range(3)]
    for name in [*names, "m"]:
        r = httpx.post(gw + "/v1/completions", json={"model": name, "prompt": "x", "stream": "maybe"},
                       timeout=10)
        assert r.status_code == 400
    text = httpx.get(gw + "/metrics", timeout=10).text
    assert not [line for line in text.splitlines() if "made-up-" in line]
    assert series_value(gw, unknown) - unknown0 == len(names)
    assert series_value(gw, real) - real0 == 1  # a model the pool serves keeps its name
    # A request that names no model (a stored response's GET) keeps "-", not "unknown".
    made = httpx.post(gw + "/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 2},
                      timeout=10)
    no_model = f'router_requests_total{{model="-",status="200",worker="{made.headers["x-router-worker"]}"}}'
    no_model0 = series_value(gw, no_model, 0.0)
    assert httpx.get(gw + f"/v1/responses/{made.json()['id']}", timeout=10).status_code == 200
    assert series_value(gw, no_model) - no_model0 == 1


async def test_a_websocket_answer_cut_by_its_worker_is_a_stream_error() -> None:
    """The socket's status (101) says nothing of an answer its worker cut: only the client's
    error message did, and no metric."""
    import aiohttp

    with sim_stack(1) as st:
        gw = st.gateway
        series = [f'router_stream_errors_total{{reason="{r}"}}' for r in ("connection", "upstream_closed")]
        before = sum(series_value(gw, s, 0.0) for s in series)
        async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
            await ws.send_str(json.dumps({"model": "m", "prompt": "long", "max_tokens": 400}))
            for _ in range(3):
                assert "choices" in json.loads((await ws.receive(timeout=30)).data)
            next(iter(st.workers.values())).kill()
            last: dict[str, Any] = {}
            for _ in range(1000):  # bounded: at most the 400 tokens, then the error
                msg = await ws.receive(timeout=30)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                last = json.loads(msg.data)
            assert "error" in last
        assert sum(series_value(gw, s, 0.0) for s in series) - before == 1


def _latency(gw: str, name: str) -> tuple[float, float]:
    """(count, sum) of one of the per-model latency histograms."""
    series = f"router_{name}_seconds_{{}}{{{{model=\"m\"}}}}"
    return series_value(gw, series.format("count"), 0.0), series_value(gw, series.format("sum"), 0.0)


async def test_websocket_answers_are_observed_each_not_the_socket_life(stack: SimStack) -> None:
    """A socket carries many requests and may stay open for hours. Its life was observed as one
    request's end-to-end latency (an idle socket of an hour: one request of an hour, in the +Inf
    bucket), and its answers had no TTFT at all. Each answer is observed now, from its message
    to its first token and to its end, which the client's own timings enclose."""
    import aiohttp

    gw = stack.gateway
    before = {name: _latency(gw, name) for name in ("time_to_first_token", "e2e_request_latency")}
    client_ttft = client_e2e = 0.0
    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        for i in range(2):
            sent = time.perf_counter()
            # Different prompts, so the second is not answered from the prefix cache at once.
            await ws.send_str(json.dumps({"model": "m", "prompt": f"{i} " + "hello world " * 60,
                                          "max_tokens": 8}))
            first = None
            for _ in range(50):  # bounded: 8 chunks and a `done`
                msg = json.loads((await ws.receive(timeout=30)).data)
                if msg.get("type") == "done":
                    break
                assert "error" not in msg, msg
                first = first or time.perf_counter()
            assert first is not None
            client_ttft += first - sent
            client_e2e += time.perf_counter() - sent
            await asyncio.sleep(0.3)  # the socket idles between requests, as a chat client's does
    deadline = time.monotonic() + 5
    while _latency(gw, "e2e_request_latency")[0] - before["e2e_request_latency"][0] < 2:
        assert time.monotonic() < deadline, "the answers never reached the e2e histogram"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the socket's own end comes after: it must add nothing
    for name, client in (("time_to_first_token", client_ttft), ("e2e_request_latency", client_e2e)):
        count, total = (a - b for a, b in zip(_latency(gw, name), before[name], strict=True))
        assert count == 2, name
        # The gateway times each answer inside the client's own interval for it (the socket's
        # life, idle pauses included, would not fit).
        assert 0 < total <= client, (name, total, client)


def test_each_websocket_answer_counts_in_requests_total_with_its_status(stack: SimStack) -> None:
    """router_requests_total counted a socket once (101, at its close), whatever it carried: a
    socket's failed answers were in no error rate and no alert. Each answer now counts with its
    own status, as an HTTP request does; the socket's upgrade stays one 101."""
    import aiohttp

    gw = stack.gateway
    [worker] = [w["worker_id"] for w in httpx.get(stack.scheduler + "/v1/workers").json()["workers"]]
    series = {status: f'router_requests_total{{model="m",status="{status}",worker="{worker}"}}'
              for status in ("101", "200", "400")}
    before = {k: series_value(gw, v, 0.0) for k, v in series.items()}

    def counted(status: str) -> float:
        return series_value(gw, series[status], 0.0) - before[status]

    async def dialog() -> None:
        async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
            for request in ({"model": "m", "prompt": "a", "max_tokens": 2},
                            {"model": "m", "prompt": "b", "max_tokens": -1},  # the worker refuses it
                            {"model": "m", "prompt": "c", "max_tokens": 2}):
                await ws.send_str(json.dumps(request))
                for _ in range(20):  # bounded: 2 chunks and a `done`, or one error
                    msg = json.loads((await ws.receive(timeout=30)).data)
                    if msg.get("type") == "done" or "error" in msg:
                        break
            deadline = time.monotonic() + 5
            while counted("200") < 2:
                assert time.monotonic() < deadline, "the answers were never counted"
                await asyncio.sleep(0.05)
            assert counted("400") == 1
            assert counted("101") == 0  # the socket is still open

    asyncio.run(dialog())
    deadline = time.monotonic() + 5
    while counted("101") == 0:
        assert time.monotonic() < deadline, "the socket's close was never counted"
        time.sleep(0.05)
    assert counted("200") == 2 and counted("101") == 1


async def _first_ws_answer(gw: str, request: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(gw + "/v1/ws") as ws:
        await ws.send_str(json.dumps(request))
        return json.loads((await ws.receive(timeout=30)).data)


def test_a_websocket_refused_for_want_of_a_healthy_worker_is_a_503_no_worker() -> None:
    """Over HTTP, a model whose every worker is down gets 503 no_worker and counts in
    router_rejected_requests_total; a socket refused so was counted as a 404 (model=unknown,
    as if nobody served the model) and as no rejection at all."""
    with sim_stack(1) as down:
        su, gu = down.scheduler, down.gateway
        for worker in down.workers.values():
            worker.kill()
        deadline = time.monotonic() + 10
        while any(x["healthy"] for x in httpx.get(su + "/v1/workers").json()["workers"]):
            assert time.monotonic() < deadline, "the scheduler never saw the worker down"
            time.sleep(0.05)
        rejected = 'router_rejected_requests_total{reason="no_worker"}'
        before = series_value(gu, rejected, 0.0)
        answer = asyncio.run(_first_ws_answer(gu, {"model": "m", "prompt": "x", "max_tokens": 2}))
        assert answer["error"]["code"] == 503, answer
        deadline = time.monotonic() + 5
        while series_value(gu, rejected, 0.0) == before:
            assert time.monotonic() < deadline, "the refusal never reached the rejected counter"
            time.sleep(0.05)
        # The scheduler knows the model (its worker is only down): it keeps its name, over a
        # socket as over HTTP, though no worker has served it here yet.
        assert series_value(gu, 'router_requests_total{model="m",status="503",worker="-"}') == 1
        r = httpx.post(gu + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=20)
        assert r.status_code == 503
        assert series_value(gu, 'router_requests_total{model="m",status="503",worker="-"}') == 2


def test_a_background_response_acknowledged_queued_is_no_end_to_end_latency(stack: SimStack) -> None:
    """A background response is answered `queued` at once and generated afterwards: that
    acknowledgment (a few milliseconds) was observed as the request's end-to-end latency,
    pulling the e2e percentiles down by as many requests as went to the background."""
    gw = stack.gateway
    # The stack's one worker: every request of "m" goes to it.
    [worker] = [w["worker_id"] for w in httpx.get(stack.scheduler + "/v1/workers").json()["workers"]]
    served = f'router_requests_total{{model="m",status="200",worker="{worker}"}}'
    served0 = series_value(gw, served, 0.0)
    e2e_count0 = _latency(gw, "e2e_request_latency")[0]
    r = httpx.post(gw + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 20,
                                               "background": True}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "queued"
    assert r.headers["x-router-worker"] == worker
    # The request is counted (so it was finished here) and its acknowledgment is no latency.
    deadline = time.monotonic() + 5
    while series_value(gw, served, 0.0) == served0:
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.02)
    assert _latency(gw, "e2e_request_latency")[0] == e2e_count0


_CRLF_PROMPT_TOKENS, _CRLF_WORDS = 7, ("one", "two", "three")


async def _crlf_chat(request: web.Request) -> web.StreamResponse:
    """A chat stream framed with CRLF, as servers built on sse-starlette frame theirs: a role
    chunk, a token a chunk, and the usage chunk only when asked for, as OpenAI's API does."""
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + json.dumps({"object": "chat.completion.chunk", "choices": choices,
                                       **extra}).encode() + b"\r\n\r\n"

    await resp.write(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
    for word in _CRLF_WORDS:
        await resp.write(chunk([{"index": 0, "delta": {"content": word}}]))
    await resp.write(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": _CRLF_PROMPT_TOKENS, "completion_tokens": len(_CRLF_WORDS)}
        await resp.write(chunk([], usage=usage))
    await resp.write(b"data: [DONE]\r\n\r\n")
    await resp.write_eof()
    return resp


async def test_a_crlf_framed_stream_hides_the_usage_the_client_did_not_ask_for() -> None:
    """The gateway asks the worker for usage (its token counts) and drops the usage chunk for a
    client that had not asked for it. A stream framed with CRLF was passed through untouched:
    its client got a usage chunk it had not asked for (a client that takes `choices[0]` of
    every chunk fails on it)."""
    async with stand_ins_behind_router([([("POST", "/v1/chat/completions", _crlf_chat)], None)]) as (
        _, gw,
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with httpx.AsyncClient(timeout=30) as client:
            before = [series_value(gw, f'router_{kind}_tokens_total{{model="m"}}', 0.0)
                      for kind in ("prompt", "generation")]
            r = await client.post(gw + "/v1/chat/completions", json=body)
        assert r.status_code == 200
        events = [e for e in re.split(r"\r\n\r\n|\n\n", r.text) if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert [c.get("usage") for c in chunks] == [None] * 5  # role, 3 tokens, finish: no usage
        # ...and the gateway read the usage it asked for: the worker's counts, not estimates
        # (written as the request ends, just after the client has its last byte).
        await asyncio.to_thread(_wait_for_change, gw, _GENERATED, before[1])
        after = [series_value(gw, f'router_{kind}_tokens_total{{model="m"}}', 0.0)
                 for kind in ("prompt", "generation")]
        assert [a - b for a, b in zip(after, before, strict=True)] == [_CRLF_PROMPT_TOKENS,
                                                                       len(_CRLF_WORDS)]


async def test_the_stats_line_mean_ttft_counts_websocket_answers() -> None:
    """The periodic stats line's mean TTFT took each request's record, and a socket's has none:
    a gateway serving WebSockets logged mean_ttft_ms=0.0 however slow its answers were."""
    import aiohttp

    with sim_stack(1, gateway_flags=("--log-stats-interval", "0.2")) as st:
        async with aiohttp.ClientSession() as s, s.ws_connect(st.gateway + "/v1/ws") as ws:
            sent = time.perf_counter()
            await ws.send_str(json.dumps({"model": "m", "prompt": "hello world " * 60, "max_tokens": 4}))
            client_ttft = None
            for _ in range(20):  # bounded: 4 chunks and a `done`
                msg = json.loads((await ws.receive(timeout=30)).data)
                if msg.get("type") == "done":
                    break
                client_ttft = client_ttft or time.perf_counter() - sent
            assert client_ttft is not None
            means: list[float] = []
            deadline = time.monotonic() + 5
            while not any(means):  # the socket stays open: its answer is what the line counts
                assert time.monotonic() < deadline, "no stats line counted the answer's TTFT"
                await asyncio.sleep(0.1)
                means = [float(m) for m in re.findall(r"router\.stats: .* mean_ttft_ms=(\S+)",
                                                      st.gateway_proc.output())]
        # One answer in its interval: the line's mean is its TTFT, which the client's encloses.
        [mean] = [m for m in means if m]
        assert 0 < mean <= client_ttft * 1000 + 0.1  # the line rounds to 0.1 ms
