"""The scheduler's vLLM dialect reads a live sim worker's /metrics as it reads real vLLM's.

tests/scheduler/test_parse.py reads the real vLLM 0.32 captures; here the same code
(detection, the `?name[]=` filtered path it switches to, extraction) reads our worker,
and every value it extracts must equal what the clients and the worker's flags say.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from scheduler.scrape import dialects
from scheduler.scrape.parse import parse_selected
from scheduler.scrape.snapshot import RawSample
from tests.worker.conftest import (
    SIM_AVAILABLE,
    SIM_SKIP_REASON,
    launch_worker,
    parse_samples,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)]
MODEL = "smollm2"
BLOCK_SIZE, NUM_BLOCKS, SEATS = 16, 48, 2
HELD = 4  # requests in flight at once: SEATS running, the rest waiting
HOLD_TOKENS = 150  # long enough to be seen held (tiny profile, ~6 ms a step at time scale 1)


@pytest.fixture(scope="module")
def worker():
    flags = ["--backend", "sim", "--sim-profile", "tiny", "--time-scale", "2", "--num-kv-blocks",
             str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(SEATS)]
    with launch_worker(*flags, model=MODEL) as w:
        yield w


def read(text: str) -> RawSample:
    dialect = dialects.detect(text)
    assert dialect is dialects.VLLM_V1, dialect
    return dialect.read(parse_selected(text, dialect.wanted))


async def scrape(http: httpx.AsyncClient, filtered: bool) -> str:
    path = dialects.VLLM_V1.filtered_metrics_path if filtered else "/metrics"
    response = await http.get(path)
    assert response.status_code == 200
    return response.text


async def held_stream(client: openai.AsyncOpenAI, prompt: str) -> openai.types.CompletionUsage:
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=HOLD_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None
    return usage


async def test_the_vllm_dialect_reads_a_busy_worker_as_its_flags_and_clients_say(worker) -> None:
    client = openai.AsyncOpenAI(base_url=worker.api_url, api_key="unused", max_retries=0, timeout=120)
    async with httpx.AsyncClient(base_url=worker.base_url, timeout=30) as http:
        before = read(await scrape(http, filtered=False))
        prompts = [f"Question {i} about rivers and seas." for i in range(HELD)]
        tasks = [asyncio.create_task(held_stream(client, p)) for p in prompts]
        held: list[tuple[RawSample, float]] = []
        try:
            for _ in range(400):  # bounded: ~25 ms apart, or until every request is done
                text = await scrape(http, filtered=True)
                raw = read(text)
                if (raw.running, raw.waiting) == (SEATS, HELD - SEATS):
                    held.append((raw, sample(parse_samples(text), "vllm:kv_cache_usage_perc")))
                    break
                if all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.025)
            usages = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        assert held, "never saw the held requests as running + waiting"
        raw, kv_on_page = held[0]
        assert (raw.block_size, raw.num_blocks) == (BLOCK_SIZE, NUM_BLOCKS)
        assert raw.waiting_deferred == 0
        assert raw.kv_usage == kv_on_page and 0 < raw.kv_usage <= 1

        wait_for(lambda: sample(worker.metrics(), "vllm:num_requests_running") == 0, 30, what="idle")
        whole, part = read(await scrape(http, filtered=False)), read(await scrape(http, filtered=True))
    assert part == whole  # the filtered page carries everything the dialect reads
    assert (whole.running, whole.waiting, whole.kv_usage) == (0, 0, 0)

    def moved(key: str) -> float:
        return whole.counters[key] - before.counters.get(key, 0.0)

    assert moved("prompt_tokens") == sum(u.prompt_tokens for u in usages)
    assert moved("prompt_tokens_computed") == sum(u.prompt_tokens for u in usages)  # nothing cached
    assert moved("generation_tokens") == sum(u.completion_tokens for u in usages) == HELD * HOLD_TOKENS
    assert moved("ttft_count") == HELD
    assert moved("itl_count") == HELD * (HOLD_TOKENS - 1)
    assert moved("prefix_queries") == sum(u.prompt_tokens for u in usages)
    assert moved("prefix_hits") == 0


async def test_a_chat_without_max_tokens_is_observed_with_the_rest_of_the_context(worker) -> None:
    """vLLM's server fills max_tokens with max_model_len - prompt length when the client sets
    none, and its request_params_max_tokens observes that value for every request."""
    before = worker.metrics()
    async with httpx.AsyncClient(base_url=worker.base_url, timeout=60) as http:
        max_model_len = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a river."}], "stop": [" "]}
        answer = (await http.post("/v1/chat/completions", json=body)).json()
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert answer["choices"][0]["finish_reason"] == "stop"
    count = "vllm:request_params_max_tokens_count"

    def counted() -> dict | None:
        samples = worker.metrics()
        return samples if sample(samples, count) > sample(before, count) else None

    after = wait_for(counted, 30, what="the finished chat in /metrics")

    def moved(name: str) -> float:
        return sample(after, name) - sample(before, name)

    assert moved("vllm:request_params_max_tokens_count") == 1
    assert moved("vllm:request_params_max_tokens_sum") == max_model_len - prompt_tokens
