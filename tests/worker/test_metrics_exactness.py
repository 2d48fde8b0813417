"""/metrics of a real worker after a known workload, for both backends.

The workload goes through the official `openai` client; every expected value comes
from what the clients saw (their `usage`, finish reasons, request counts), never from
constants. Parametrised over the real model ("torch") and the sim latency model.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx
import openai
import pytest

from tests.worker.conftest import (
    SIM_AVAILABLE,
    SIM_SKIP_REASON,
    launch_worker,
    parse_samples,
    sample,
    wait_for,
)
from tests.worker.model_under_test import TEST_DEVICE, TEST_DEVICE_FLAGS, TEST_MODEL
from tests.worker.test_metrics_prometheus import FIXTURE_FILES, LEGACY, REQUIRED, by_exposed, label_names

pytestmark = pytest.mark.slow
MODEL = "smollm2"
BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("sim", id="sim", marks=pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)),
]
# Long enough to keep the first two requests running while the scrape happens.
HOLD_TOKENS = {"torch": 24, "sim": 100}
# Longer than a client waits (1 s): a GPU replaying CUDA graphs makes 300 tokens in 0.6 s; the
# sim's tiny profile takes no more than 512 tokens in all.
ABORT_TOKENS = {"torch": 2000, "sim": 300}
BACKEND_FLAGS = {
    "torch": list(TEST_DEVICE_FLAGS),
    "sim": ["--backend", "sim", "--sim-profile", "tiny", "--time-scale", "2"],
}

PER_REQUEST_HISTOGRAMS = [
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:request_num_preemptions",
    "vllm:request_prefill_kv_computed_tokens",
]


@pytest.fixture(scope="module", params=BACKENDS)
def busy_worker(request):
    backend = request.param
    if backend == "torch":
        yield backend, request.getfixturevalue("shared_torch_worker")  # started with --max-num-seqs 2
        return
    with launch_worker("--max-num-seqs", "2", *BACKEND_FLAGS[backend]) as worker:
        yield backend, worker


def aclient(worker) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=worker.api_url, api_key="unused", max_retries=0, timeout=300)


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def successes(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items() if name == "vllm:request_success_total")


def settled(worker, before: dict, finished: int) -> dict:
    """Scrape until `finished` more requests are counted (stats are recorded right after a step)."""

    def scrape_when_counted() -> dict | None:
        samples = worker.metrics()
        return samples if successes(samples) - successes(before) >= finished else None

    return wait_for(scrape_when_counted, timeout_s=60, what=f"{finished} finished requests in /metrics")


async def stream_completion(
    client: openai.AsyncOpenAI, prompt: str, max_tokens: int
) -> openai.types.CompletionUsage:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return usage


async def test_running_and_waiting_while_requests_are_held(busy_worker) -> None:
    backend, worker = busy_worker
    client = aclient(worker)
    prompts = [f"Request number {i} asks about the weather in city {i}." for i in range(6)]
    tasks = [asyncio.create_task(stream_completion(client, p, HOLD_TOKENS[backend])) for p in prompts]
    seen: list[tuple[float, float]] = []
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(2000):  # bounded: ~50 ms apart, or until all requests are done
                samples = parse_samples((await http.get(f"{worker.base_url}/metrics")).text)
                state = (
                    sample(samples, "vllm:num_requests_running"),
                    sample(samples, "vllm:num_requests_waiting"),
                )
                seen.append(state)
                if state == (2, 4) or all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.05)
        usages = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    assert (2, 4) in seen, f"never saw 2 running + 4 waiting; saw {sorted(set(seen))}"
    assert all(running <= 2 for running, _ in seen)
    assert all(u.completion_tokens == HOLD_TOKENS[backend] for u in usages)
    wait_for(lambda: sample(worker.metrics(), "vllm:num_requests_running") == 0, 30, what="idle")
    after = worker.metrics()
    assert sample(after, "vllm:num_requests_waiting") == 0
    assert sample(after, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0


def _stop_string(text: str) -> tuple[str, int]:
    """A 2-character stop string whose first occurrence in `text` is past its start."""
    for k in range(1, len(text) - 1):
        piece = text[k : k + 2]
        if piece.strip() and text.find(piece) == k:
            return piece, k
    raise AssertionError(f"no usable stop string in {text!r}")


async def test_counters_and_histograms_equal_what_clients_saw(busy_worker) -> None:
    _, worker = busy_worker
    client = aclient(worker)
    before = worker.metrics()
    usages: list[openai.types.CompletionUsage] = []
    reasons: list[str] = []

    # length: three completions (two concurrent), two streamed chats with usage
    outs = await asyncio.gather(
        *[
            client.completions.create(
                model=MODEL,
                prompt=f"Count to {n}:",
                max_tokens=n,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for n in (5, 9, 12)
        ]
    )
    for out in outs:
        usages.append(out.usage)
        reasons.append(out.choices[0].finish_reason)
    for question in ("What is rain?", "Why is the sky blue?"):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage:
                usages.append(chunk.usage)

    # stop: a stop string taken from the greedy answer of the first request
    prompt = "Count to 12:"
    full = outs[2].choices[0].text
    stop, cut = _stop_string(full)
    stopped = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].text == full[:cut]
    usages.append(stopped.usage)
    reasons.append(stopped.choices[0].finish_reason)

    # a prefix-cache hit: the same 3-block prompt twice, one after the other
    shared = " ".join(f"word{i}" for i in range(60))
    for _ in range(2):
        out = await client.completions.create(
            model=MODEL, prompt=shared, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )
        usages.append(out.usage)
        reasons.append(out.choices[0].finish_reason)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16, "the repeated prompt should hit the prefix cache"

    after = settled(worker, before, len(usages))
    n = len(usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generation_tokens = sum(u.completion_tokens for u in usages)
    assert reasons.count("stop") == 1 and reasons.count("length") == n - 1

    assert delta(after, before, "vllm:prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "vllm:generation_tokens_total") == generation_tokens
    for reason in ("stop", "length", "abort", "error"):
        assert delta(after, before, "vllm:request_success_total", finished_reason=reason) == reasons.count(
            reason
        )
    assert delta(after, before, "vllm:num_preemptions_total") == 0
    for name in PER_REQUEST_HISTOGRAMS:
        assert delta(after, before, f"{name}_count") == n, name
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == n
    # One inter-token gap per token after the first, per request (no preemption here).
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == generation_tokens - n
    assert delta(after, before, "vllm:time_per_output_token_seconds_count") == generation_tokens - n
    assert delta(after, before, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta(after, before, "vllm:request_generation_tokens_sum") == generation_tokens
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == 5 + 9 + 12 + 7 + 7 + 12 + 3 + 3
    assert delta(after, before, "vllm:iteration_tokens_total_sum") == prompt_tokens + generation_tokens
    # Prefix cache: hits equal what the clients were told was cached; sources add up.
    cached_total = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta(after, before, "vllm:prefix_cache_hits_total") == cached_total
    assert delta(after, before, "vllm:gpu_prefix_cache_hits_total") == cached_total
    assert (
        delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        + delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_compute")
        == prompt_tokens
    )
    assert delta(after, before, "vllm:prefix_cache_queries_total") >= prompt_tokens - cached_total
    assert delta(after, before, "vllm:request_prefill_kv_computed_tokens_sum") == prompt_tokens - cached_total
    assert sample(after, "vllm:kv_cache_usage_perc") == sample(after, "vllm:gpu_cache_usage_perc")


async def test_prompt_tokens_by_source_splits_cache_hits(busy_worker) -> None:
    _, worker = busy_worker
    client = aclient(worker)
    before = worker.metrics()
    shared = " ".join(f"token{i}" for i in range(60))
    usages = []
    for _ in range(2):
        out = await client.completions.create(
            model=MODEL, prompt=shared, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )
        usages.append(out.usage)
    after = settled(worker, before, 2)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    assert cached >= 16
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert (
        delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_compute")
        == prompt_tokens - cached
    )


def freed(worker) -> dict | None:
    """A scrape once nothing runs or waits (an aborted request is freed at the engine's next
    step), else None."""
    samples = worker.metrics()
    idle = sample(samples, "vllm:num_requests_running") == sample(samples, "vllm:num_requests_waiting") == 0
    return samples if idle else None


async def test_an_aborted_stream_is_freed_but_not_counted_as_finished(busy_worker) -> None:
    """As vLLM v1 (its OutputProcessor.abort_requests records no finished stats): a client that
    leaves mid-stream frees its request, which request_success_total and the per-request
    histograms never see; the prompt and the tokens it made are counted, step by step."""
    _, worker = busy_worker
    before = worker.metrics()
    prompt = "Tell me a long story about a dragon."
    received = 0
    async with httpx.AsyncClient(timeout=120) as http:
        tokens = (await http.post(f"{worker.base_url}/tokenize", json={"prompt": prompt})).json()["count"]
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream(
            "POST",
            f"{worker.api_url}/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True},
        ) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 3:
                    break  # leaving the block closes the connection mid-stream
    after = wait_for(lambda: freed(worker), 30, what="abort to free")
    assert successes(after) == successes(before)
    for name in PER_REQUEST_HISTOGRAMS:
        assert delta(after, before, f"{name}_count") == 0, name
    assert delta(after, before, "vllm:prompt_tokens_total") == tokens
    generated = delta(after, before, "vllm:generation_tokens_total")
    assert received <= generated < 400
    assert delta(after, before, "vllm:iteration_tokens_total_sum") == tokens + generated
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == 1
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == generated - 1


async def test_disconnects_of_non_stream_and_websocket_clients_abort(busy_worker) -> None:
    """A non-stream client that gives up and a WebSocket closed mid-answer both abort in the
    engine: freed before their last token, and (as in vLLM) not counted as finished."""
    backend, worker = busy_worker
    before = worker.metrics()
    max_tokens = ABORT_TOKENS[backend]
    body = {"model": MODEL, "prompt": "Write an essay about rivers.", "max_tokens": max_tokens,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=1.0) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{worker.api_url}/completions", json=body)
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{worker.base_url}/v1/ws") as ws:
        await ws.send_str(json.dumps(body))
        first = json.loads((await ws.receive(timeout=120)).data)
        assert first["object"] == "text_completion"
    after = wait_for(lambda: freed(worker), 30, what="aborts to free")
    assert successes(after) == successes(before)
    generated = delta(after, before, "vllm:generation_tokens_total")
    assert 2 <= generated < 2 * max_tokens


@pytest.fixture(scope="module", params=BACKENDS)
def tiny_kv_worker(request):
    backend = request.param
    # 6 blocks of 16 tokens: two 60-token answers cannot both fit, so one is preempted.
    flags = ["--num-kv-blocks", "6", "--block-size", "16", "--max-num-seqs", "4", "--hide-legacy-metrics"]
    flags += BACKEND_FLAGS[backend]
    with launch_worker(*flags, model=TEST_MODEL if backend == "torch" else MODEL, served_as=MODEL) as worker:
        yield backend, worker


async def test_forced_preemption_moves_the_counter(tiny_kv_worker) -> None:
    _, worker = tiny_kv_worker
    client = aclient(worker)
    before = worker.metrics()
    prompts = ["Once upon a time", "The weather today is"]
    usages = await asyncio.gather(*[stream_completion(client, p, 60) for p in prompts])
    after = settled(worker, before, len(prompts))
    preemptions = delta(after, before, "vllm:num_preemptions_total")
    assert preemptions >= 1
    assert delta(after, before, "vllm:request_num_preemptions_sum") == preemptions
    assert all(u.completion_tokens == 60 for u in usages)
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 2
    # Recomputing a preempted request does not count its tokens twice.
    assert delta(after, before, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(after, before, "vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)


def test_hide_legacy_metrics_flag_removes_the_v0_aliases(tiny_kv_worker) -> None:
    _, worker = tiny_kv_worker
    exposed = by_exposed(worker.metrics_text())
    assert "vllm:kv_cache_usage_perc" in exposed and "vllm:num_preemptions_total" in exposed
    for name in LEGACY:
        assert name not in exposed


@pytest.mark.parametrize("fixture_file", FIXTURE_FILES, ids=lambda p: p.name)
def test_live_metrics_have_the_real_vllm_families(busy_worker, fixture_file) -> None:
    """The served /metrics (not just the logger): every required family, with vLLM's type and labels."""
    _, worker = busy_worker
    ours = by_exposed(worker.metrics_text())
    real = by_exposed(fixture_file.read_text())
    for name in REQUIRED:
        assert name in ours and name in real, name
        assert ours[name].type == real[name].type, name
        if name != "vllm:cache_config_info":
            assert label_names(ours[name]) == label_names(real[name]), name
    for name in LEGACY:
        assert name in ours, name


def test_gpu_memory_gauges_on_a_gpu_only(busy_worker) -> None:
    """On a GPU (benchmarks/cuda_check.sh) the worker publishes its device's memory beside the
    KV usage; elsewhere (CPU, the sim) it publishes no such gauge rather than a made-up 0."""
    backend, worker = busy_worker
    samples = worker.metrics()
    gauges = {name: value for (name, _), value in samples.items() if name.startswith("vllm:gpu_memory_")}
    if backend == "torch" and TEST_DEVICE == "cuda":
        used, total = gauges["vllm:gpu_memory_used_bytes"], gauges["vllm:gpu_memory_total_bytes"]
        assert 0 < used <= total
    else:
        assert gauges == {}
