"""A real sim worker process (`--backend sim --sim-profile tiny`) under more load than its KV cache.

The tiny profile has 64 KV blocks of 16 tokens. A burst of 24 requests of ~100 prompt
tokens and 80 output tokens needs ~12 blocks each, ~290 in all: requests must wait,
running ones get preempted when their decode needs a block, and the cache fills up.
None of this is scripted in the sim: it emerges from the real scheduler and block manager.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import httpx
import pytest

from tests.worker.conftest import (
    REPO,
    Worker,
    free_port,
    launch_worker,
    parse_samples,
    sample,
    wait_for,
    wait_healthy,
)

MODEL = "tiny-sim"
BURST = 24
MAX_TOKENS = 80
PROMPT = "Explain how a cluster of inference workers shares the load of many users. " * 6


@pytest.fixture(scope="module")
def worker():
    with launch_worker("--backend", "sim", "--sim-profile", "tiny", "--log-stats-interval", "1",
                       model=MODEL) as w:
        yield w


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[str, dict]:
    body = {"model": MODEL, "prompt": f"Request {i}. {PROMPT}", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            text += [c["text"] for c in chunk["choices"]]
    return "".join(text), usage


async def _poll_metrics(client: httpx.AsyncClient, stop: asyncio.Event, seen: dict[str, float]) -> None:
    while not stop.is_set():
        samples = parse_samples((await client.get("/metrics")).text)
        seen["waiting"] = max(seen["waiting"], sample(samples, "vllm:num_requests_waiting"))
        seen["kv"] = max(seen["kv"], sample(samples, "vllm:kv_cache_usage_perc"))
        seen["running"] = max(seen["running"], sample(samples, "vllm:num_requests_running"))
        await asyncio.sleep(0.03)


async def _burst(base_url: str) -> tuple[list[tuple[str, dict]], dict[str, float]]:
    seen = {"waiting": 0.0, "kv": 0.0, "running": 0.0}
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        poller = asyncio.create_task(_poll_metrics(client, stop, seen))
        results = await asyncio.wait_for(asyncio.gather(*(_stream(client, i) for i in range(BURST))), 150)
        stop.set()
        await poller
    return results, seen


def test_burst_beyond_kv_capacity_waits_preempts_fills_and_drains(worker):
    before = worker.metrics()
    started = time.monotonic()
    results, seen = asyncio.run(_burst(worker.base_url))
    after = worker.metrics()

    # Loaded: requests queued, the cache was (nearly) full, and decodes were preempted.
    assert seen["waiting"] > 0
    assert seen["kv"] >= 0.9
    assert 0 < seen["running"] <= 16  # tiny's max_num_seqs
    preemptions = sample(after, "vllm:num_preemptions_total") - sample(before, "vllm:num_preemptions_total")
    assert preemptions > 0

    # Every request still got exactly its tokens, and the counters add up to what clients saw.
    assert all(usage["completion_tokens"] == MAX_TOKENS for _, usage in results)
    generated = sample(after, "vllm:generation_tokens_total") - sample(before, "vllm:generation_tokens_total")
    prompt = sample(after, "vllm:prompt_tokens_total") - sample(before, "vllm:prompt_tokens_total")
    assert generated == BURST * MAX_TOKENS
    assert prompt == sum(usage["prompt_tokens"] for _, usage in results)

    # Drained: nothing running or waiting, every block back in the free pool.
    def drained() -> bool:
        m = worker.metrics()
        gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        return all(sample(m, name) == 0 for name in gauges)

    wait_for(drained, timeout_s=10, what="running, waiting and KV usage back to 0")
    assert time.monotonic() - started < 150


def test_preempted_output_is_the_same_as_alone(worker):
    """A request that ran in the burst (possibly preempted and recomputed) gives the same text alone."""
    results, _ = asyncio.run(_burst(worker.base_url))

    async def alone() -> tuple[str, dict]:
        async with httpx.AsyncClient(base_url=worker.base_url, timeout=60) as client:
            return await _stream(client, BURST - 1)  # the newest request: first to be preempted

    text, usage = asyncio.run(alone())
    assert usage["completion_tokens"] == MAX_TOKENS
    assert text == results[BURST - 1][0]
    assert len(text.split()) >= MAX_TOKENS // 2  # readable words, not empty deltas


@pytest.mark.parametrize("path", ["/metrics", "/metrics/"])
def test_metrics_name_filter_serves_only_the_asked_series(worker, path):
    """`?name[]=...` as prometheus_client's exposition serves it, on `/metrics` and on
    `/metrics/` (where the scheduler sends it, because vLLM honours it only there): the
    scheduler asks for the dozen series it reads every 100 ms instead of every bucket."""
    asked = ["vllm:num_requests_running", "vllm:prompt_tokens_total",
             "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"]
    with httpx.Client(base_url=worker.base_url, timeout=10) as client:
        client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8})
        whole = client.get("/metrics")
        part = client.get(path, params=[("name[]", name) for name in asked])
    assert whole.status_code == part.status_code == 200
    assert part.headers["Content-Type"] == whole.headers["Content-Type"]
    whole_samples, part_samples = parse_samples(whole.text), parse_samples(part.text)
    assert {name for name, _ in part_samples} == set(asked)
    for key, value in part_samples.items():  # the same series, the same values (idle worker)
        assert whole_samples[key] == value, key
    assert sample(part_samples, "vllm:prompt_tokens_total") > 0
    assert len(part.content) * 5 < len(whole.content)


def test_the_sim_publishes_how_far_its_timeline_stretched(worker):
    """sim:* counters: the modelled step time, and the stretch of a busy engine's timeline
    beyond it (CPU contention on the host, which a GPU would not suffer). An idle second is
    not a stretch."""
    with httpx.Client(base_url=worker.base_url, timeout=30) as client:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
        assert client.post("/v1/completions", json=body).status_code == 200
        before = parse_samples(client.get("/metrics").text)
        time.sleep(1.0)
        assert client.post("/v1/completions", json=body).status_code == 200
        after = parse_samples(client.get("/metrics").text)
    assert sample(after, "sim:steps_total") > sample(before, "sim:steps_total") > 0
    assert sample(after, "sim:modelled_seconds_total") > sample(before, "sim:modelled_seconds_total")
    assert sample(after, "sim:stretch_seconds_total") - sample(before, "sim:stretch_seconds_total") < 0.5
    assert sample(after, "sim:late_seconds_total") >= 0


def test_chat_answers_and_sampled_choices_are_their_own(worker):
    """Every chat prompt ends with `[/INST]`: questions of one token length must still get
    answers of their own (on vLLM each prompt's answer, and with EOS its length, is its own
    draw), and the n choices of a sampled request differ while greedy ones agree, as on vLLM."""
    questions = ("What is the capital of France?", "Write me a poem about the sea", "Who are you, my dear?")
    with httpx.Client(base_url=worker.base_url, timeout=30) as client:
        def chat(question: str, **extra) -> list[str]:
            messages = [{"role": "user", "content": question}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
            answer = client.post("/v1/chat/completions", json=body).json()
            return [choice["message"]["content"] for choice in answer["choices"]]

        def prompt_len(question: str) -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": question}]}
            return client.post("/tokenize", json=body).json()["count"]

        lengths = {prompt_len(q) for q in questions}
        assert len(lengths) == 1  # one prompt length: only the questions' words tell them apart
        assert len({chat(q)[0] for q in questions}) == len(questions)
        sampled = chat(questions[0], n=2, temperature=1.0)
        greedy = chat(questions[0], n=2, temperature=0.0)
    assert sampled[0] != sampled[1]
    assert greedy[0] == greedy[1]



# What the torch worker answers (tests/worker/test_server_openai.py sends the same bodies): its
# tokenizer (SmolLM2's) gives an empty text no tokens, so the prompt is refused, as vLLM refuses
# an empty decoder prompt; a token list must not be empty at all.
EMPTY_PROMPT = "The prompt is empty."
EMPTY_LIST = "prompt must be a string, a non-empty list of token ids, or a non-empty list of either"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": ""}, EMPTY_PROMPT),
        ("/v1/completions", {"prompt": "", "stream": True}, EMPTY_PROMPT),
        ("/v1/completions", {"prompt": "", "echo": True, "max_tokens": 0}, EMPTY_PROMPT),
        ("/v1/completions", {"prompt": ["a story", ""]}, EMPTY_PROMPT),
        ("/v1/completions", {"prompt": []}, EMPTY_LIST),
        ("/v1/completions", {"prompt": [[1, 2], []]}, EMPTY_LIST),
    ],
    ids=["empty-text", "empty-text-stream", "empty-text-echo", "empty-in-batch", "empty-ids",
         "empty-ids-in-batch"],
)
def test_an_empty_prompt_is_a_400_as_on_the_torch_worker(worker, path, body, message):
    """The sim's tokenizer is Llama-2's in all but this: an empty text has no tokens (Llama-2's
    would give <s>), so the sim refuses it with the torch worker's 400, not a served answer."""
    response = httpx.post(worker.base_url + path, json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": "prompt", "code": None}}


def test_an_empty_prompt_is_refused_over_the_websocket_too(worker):
    """The WebSocket prepares its requests as /v1/completions does: the same refusal."""
    async def ask() -> dict:
        async with aiohttp.ClientSession() as session, session.ws_connect(worker.base_url + "/v1/ws") as ws:
            await ws.send_json({"model": MODEL, "prompt": ""})
            return await asyncio.wait_for(ws.receive_json(), 30)

    answer = asyncio.run(ask())
    assert answer["error"]["message"] == EMPTY_PROMPT and answer["error"]["param"] == "prompt", answer


def test_a_binary_message_is_refused_in_its_turn_not_inside_the_answer_streaming(worker):
    """Answers on a socket come one after the other, in order, each ended once. A binary
    message sent while an answer streamed was refused at once: its error came among that
    answer's chunks, and a client pairing answers' ends with its requests in order took it for
    that answer's end (benchmarks/api_fuzz.py's WebSocket cases found it). Now it waits its
    turn: the answer streaming ends with its done, then the binary's error."""
    async def ask() -> list[dict]:
        async with aiohttp.ClientSession() as session, session.ws_connect(worker.base_url + "/v1/ws") as ws:
            await ws.send_json({"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True})
            got = [await asyncio.wait_for(ws.receive_json(), 30)]  # its answer streams
            await ws.send_bytes(b'{"model": "m", "prompt": "hi"}')
            while not ("error" in got[-1] and len(got) > 1):
                got.append(await asyncio.wait_for(ws.receive_json(), 30))
            return got

    *chunks, done, refusal = asyncio.run(ask())
    assert done.get("type") == "done", f"the refusal came inside the answer streaming: {done}, {refusal}"
    assert done["id"] == chunks[0]["id"] and "cancelled" not in done, done
    assert all(c.get("object") == "text_completion" for c in chunks), [c for c in chunks if "error" in c]
    assert refusal["error"]["message"] == "send JSON text messages, not binary ones", refusal


def test_tokenizing_an_empty_text_gives_no_tokens(worker):
    answer = httpx.post(worker.base_url + "/tokenize", json={"model": MODEL, "prompt": ""}, timeout=30).json()
    assert answer["count"] == 0 and answer["tokens"] == []


def test_add_special_tokens_decides_the_prompts_bos_as_in_vllm(worker):
    """vLLM's add_special_tokens: on by default for a completions prompt (the tokenizer's BOS),
    off for chat (the template writes its own; on, the tokenizer's comes on top of it). The
    worker took the field and ignored it. The sim's tokenizer adds a BOS as Llama-2's does
    (SmolLM2's adds none, so the torch worker's answers do not differ): the prompt's tokens,
    and the usage the answer reports, are with it or without it as asked. /tokenize follows
    vLLM's defaults too (on for a prompt, off for messages)."""
    prompt = "The three primary colors are"
    messages = [{"role": "user", "content": "Name the primary colors."}]
    with httpx.Client(base_url=worker.base_url, timeout=30) as client:
        def used(path: str, body: dict, **extra) -> int:
            answer = client.post(path, json={"model": MODEL, **body, "max_tokens": 2, **extra})
            assert answer.status_code == 200, answer.text
            return answer.json()["usage"]["prompt_tokens"]

        def tokens(body: dict, **extra) -> list[int]:
            answer = client.post("/tokenize", json={"model": MODEL, **body, **extra})
            assert answer.status_code == 200, answer.text
            return answer.json()["tokens"]

        text = tokens({"prompt": prompt})
        assert text[0] == 1 and 1 not in text[1:]  # <s>, once
        assert tokens({"prompt": prompt}, add_special_tokens=False) == text[1:]
        assert tokens({"prompt": prompt}, add_special_tokens=True) == text
        assert used("/v1/completions", {"prompt": prompt}) == len(text)
        assert used("/v1/completions", {"prompt": prompt}, add_special_tokens=True) == len(text)
        assert used("/v1/completions", {"prompt": prompt}, add_special_tokens=False) == len(text) - 1
        # Token ids are the prompt as given: no BOS put before them either way.
        assert used("/v1/completions", {"prompt": text[1:]}) == len(text) - 1

        chat = tokens({"messages": messages})
        assert chat[0] == 1 and chat[1] != 1  # the template's own <s>
        assert tokens({"messages": messages}, add_special_tokens=False) == chat
        assert tokens({"messages": messages}, add_special_tokens=True) == [1, *chat]
        assert used("/v1/chat/completions", {"messages": messages}) == len(chat)
        assert used("/v1/chat/completions", {"messages": messages}, add_special_tokens=False) == len(chat)
        assert used("/v1/chat/completions", {"messages": messages}, add_special_tokens=True) == len(chat) + 1
        # Not a bool: a 400 naming it, as in vLLM.
        for path, body in (("/v1/completions", {"prompt": prompt}),
                           ("/v1/chat/completions", {"messages": messages}),
                           ("/tokenize", {"prompt": prompt})):
            answer = client.post(path, json={"model": MODEL, **body, "add_special_tokens": "no"})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "add_special_tokens"


def test_prompt_logprobs_depend_on_the_prompt_alone(worker):
    """A model's prompt logprobs are its forward pass over the prompt: the same for every seed
    and every request, through prompt_logprobs and through echo. The seed picks the samples."""
    prompt = "The three primary colors are red, yellow and blue"
    with httpx.Client(base_url=worker.base_url, timeout=30) as client:
        def complete(**extra) -> dict:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True, **extra}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        seeds = (None, 1, 2, 7, 12345)
        asked = [complete(prompt_logprobs=2, seed=seed) for seed in seeds]
        echoed = [complete(echo=True, logprobs=2, max_tokens=0, seed=seed) for seed in seeds]
        sampled = {complete(seed=seed, temperature=1.0)["text"] for seed in seeds}
    assert all(choice["prompt_logprobs"] == asked[0]["prompt_logprobs"] for choice in asked)
    assert asked[0]["prompt_logprobs"][0] is None and len(asked[0]["prompt_logprobs"]) > 5
    assert all(choice["logprobs"] == echoed[0]["logprobs"] for choice in echoed)
    assert echoed[0]["text"] == prompt
    assert len(sampled) > 1


def _decode_seconds(scale: str) -> tuple[float, float]:
    """(simulated decode seconds from /metrics, wall seconds) of one 60-token request."""
    with launch_worker("--backend", "sim", "--sim-profile", "tiny", "--time-scale", scale, model=MODEL) as w:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}
        started = time.monotonic()
        response = httpx.post(f"{w.base_url}/v1/completions", json=body, timeout=60)
        wall = time.monotonic() - started
        assert response.json()["usage"]["completion_tokens"] == 60
        return sample(w.metrics(), "vllm:request_decode_time_seconds_sum"), wall


def test_time_scale_stretches_wall_time_but_metrics_report_simulated_seconds():
    # Scales 2 and 6 rather than 1 and 3: the larger the scale, the less a busy CI machine's
    # Python overhead weighs against the simulated step, so the ratio stays near its ideal.
    simulated_2, wall_2 = _decode_seconds("2")
    simulated_6, wall_6 = _decode_seconds("6")
    assert 0.7 < simulated_6 / simulated_2 < 1.4  # the same simulated time (3 if not divided back)
    assert 2.0 < wall_6 / wall_2 < 4.0  # three times the wall time (server overhead aside)


def test_sim_worker_serves_without_importing_torch(tmp_path):
    """A sim cluster on a laptop starts in about a second: the sim backend must not import torch
    or transformers (torch's import alone is ~1.2 s of CPU, paid by every worker of every
    benchmark run, five at a time on two cores)."""
    port = free_port()
    report = ("import atexit, runpy, sys; atexit.register(lambda: print('heavy modules:', "
              "[m for m in ('torch', 'transformers') if m in sys.modules], flush=True)); "
              "runpy.run_module('inference_worker', run_name='__main__')")
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", report, "--backend", "sim", "--sim-profile", "tiny",
             "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
        )
    sim = Worker(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_healthy(sim)
        response = httpx.post(f"{sim.base_url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert "heavy modules: []" in sim.output(), sim.output()[-3000:]


def test_cache_salt_keeps_cached_prefixes_apart_as_in_vllm(worker):
    """vLLM's cache_salt: a repeated prompt is served from the prefix cache only for requests
    of the same salt (usage.prompt_tokens_details.cached_tokens), so one tenant cannot tell by
    the timing whether another sent a prompt. The worker took the field and ignored it."""
    prompt = "Salted: " + " ".join(f"word{i}" for i in range(80))  # several full blocks
    with httpx.Client(base_url=worker.base_url, timeout=30) as client:
        def cached(**extra) -> int:
            answer = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                          "max_tokens": 1, **extra})
            assert answer.status_code == 200, answer.text
            return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(cache_salt="tenant-a") == 0  # first sight
        assert cached(cache_salt="tenant-a") > 0  # its own prefix
        assert cached(cache_salt="tenant-b") == 0  # the same text, another tenant
        assert cached() == 0  # nor an unsalted request
        assert cached() > 0


def test_the_body_request_id_names_the_answer_unless_the_header_does_as_in_vllm(worker):
    """vLLM's request_id body field: the answer's id (`cmpl-<id>`, `chatcmpl-<id>`, every chunk
    too) where no usable X-Request-Id header gives one (vLLM prefers the header), under the
    header's rules (one that is not a plain token gets a fresh id); not text is a 400 naming it.
    Unknown to the worker before, it was passed over and every answer got a fresh id."""
    cmpl = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    with httpx.Client(base_url=worker.base_url, timeout=30) as client:
        def answer_id(path: str, body: dict, **headers: str) -> str:
            answer = client.post(path, json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            return answer.json()["id"]

        assert answer_id("/v1/completions", {**cmpl, "request_id": "job-7.a"}) == "cmpl-job-7.a"
        assert answer_id("/v1/chat/completions", {**chat, "request_id": "job-8"}) == "chatcmpl-job-8"
        with client.stream("POST", "/v1/chat/completions",
                           json={**chat, "request_id": "job-9", "stream": True}) as r:
            ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line.startswith("data: {")}
        assert ids == {"chatcmpl-job-9"}
        # The header wins; a header that is no plain token leaves the body's; a body's that is
        # none gets a fresh id, as such a header does.
        headers = {"X-Request-Id": "gw-1"}
        assert answer_id("/v1/completions", {**cmpl, "request_id": "job-10"}, **headers) == "cmpl-gw-1"
        bad = {"X-Request-Id": 'a"b'}
        assert answer_id("/v1/completions", {**cmpl, "request_id": "job-11"}, **bad) == "cmpl-job-11"
        fresh = answer_id("/v1/completions", {**cmpl, "request_id": 'x"y' + "z" * 200})
        assert fresh.startswith("cmpl-") and '"' not in fresh and "zzz" not in fresh
        assert answer_id("/v1/completions", {**cmpl, "request_id": ""}) != "cmpl-"
        for body in ({**cmpl, "request_id": 7}, {**chat, "request_id": None}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            refused = client.post(path, json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "request_id"
        # The Responses API's ids stay its own (vLLM's request_id names a response there).
        response = client.post("/v1/responses", json={"model": MODEL, "input": "Hello",
                                                      "max_output_tokens": 2, "request_id": "job-12"})
        assert response.status_code == 200 and response.json()["id"].startswith("resp_")


def test_a_retry_under_the_request_id_of_a_request_just_dropped_gets_its_own_whole_answer(worker):
    """A client (or a gateway in front) whose connection dropped mid-answer sends the request
    again at once with the same X-Request-Id. The first is aborted as its connection closes;
    the retry must get its own answer, whole, under that id: before, it could be handed the
    first one's last outputs (a 400 "already in flight", or an answer cut short)."""
    stream = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
    whole = {"model": MODEL, "prompt": "Hello there", "max_tokens": 12}

    async def main() -> list[tuple[int, dict]]:
        answers = []
        for attempt in range(6):
            headers = {"X-Request-Id": f"dropped-{attempt}"}
            async with aiohttp.ClientSession() as session:
                first = await session.post(worker.base_url + "/v1/completions", json=stream, headers=headers)
                assert first.status == 200
                for _ in range(2 + attempt % 3):  # a few chunks in: mid-generation
                    await first.content.readline()
                first.close()  # the connection dropped
            await asyncio.sleep(0.002 * attempt)
            async with aiohttp.ClientSession() as session, session.post(
                    worker.base_url + "/v1/completions", json=whole, headers=headers) as again:
                answers.append((again.status, await again.json()))
        return answers

    for status, body in asyncio.run(asyncio.wait_for(main(), 60)):
        assert status == 200, body
        assert body["id"].startswith("cmpl-dropped-")
        assert body["usage"]["completion_tokens"] == 12, body
        assert body["choices"][0]["finish_reason"] == "length", body
