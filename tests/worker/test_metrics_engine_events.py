"""The engine's stats through the real PrometheusStatLogger, for known event sequences.

The engine runs the deterministic fake runner (engine_helpers) on a scripted clock, so each
expected value follows from the events the test arranges (steps, chunks, cache lookups), as
vLLM v1 would count them (shared/metrics-reference.md 1.5).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.types import SamplingParams
from inference_worker.metrics.prometheus import PrometheusStatLogger
from tests.worker.engine_helpers import ArithmeticRunner, CharTokenizer, ManualClock

BS = 4
MAX_MODEL_LEN = 256


def make(max_batched: int = 64, caching: bool = True) -> tuple[LLMEngine, CollectorRegistry]:
    engine = LLMEngine(
        ArithmeticRunner(BS, 64),
        CharTokenizer(),
        max_num_seqs=8,
        max_num_batched_tokens=max_batched,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=caching,
        clock=ManualClock(tick=0.001),
    )
    registry = CollectorRegistry()
    engine.add_stat_logger(PrometheusStatLogger(registry, "m", MAX_MODEL_LEN, engine.cache_info))
    return engine, registry


def metric(registry: CollectorRegistry, sample_name: str) -> float:
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == sample_name:
                return s.value
    raise KeyError(sample_name)


def run(engine: LLMEngine, max_steps: int = 500) -> list[int]:
    """Step until idle; the number of tokens each step produced."""
    produced: list[int] = []
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return produced
        produced.append(sum(len(out.token_ids) for out in engine.step()))
    raise AssertionError("the engine did not finish")


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_iteration_tokens_observes_only_steps_that_produced_tokens() -> None:
    # A 20-token prompt with a budget of 8: chunks of 8, 8 and 4; only the last one samples.
    engine, registry = make(max_batched=8)
    engine.add_request("long", list(range(3, 23)), greedy(3))
    produced = run(engine)
    assert produced == [0, 0, 1, 1, 1]  # the arranged events: two silent prefill chunks
    assert metric(registry, "vllm:iteration_tokens_total_count") == 3
    assert metric(registry, "vllm:iteration_tokens_total_sum") == 20 + 3


def test_a_prompt_logprobs_request_is_no_prefix_cache_query() -> None:
    # vLLM skips the prefix-cache lookup of a request that wants prompt logprobs (every prompt
    # position must be computed), and counts no query for it; the next plain one is counted.
    engine, registry = make()
    prompt = list(range(3, 30))  # 27 tokens: 6 full blocks of 4
    engine.add_request("logprobs", prompt, greedy(2, prompt_logprobs=1))
    run(engine)
    assert metric(registry, "vllm:prefix_cache_queries_total") == 0
    engine.add_request("plain", prompt, greedy(2))
    run(engine)
    assert metric(registry, "vllm:prefix_cache_queries_total") == 27
    assert metric(registry, "vllm:prefix_cache_hits_total") == 24


def test_request_params_max_tokens_sees_the_effective_limit_when_the_client_set_none() -> None:
    # vLLM's OpenAI server always fills SamplingParams.max_tokens (the client's value, else
    # max_model_len - prompt length), so every finished request is observed, with that value;
    # a client's 0 (completions' echo) is not observed, as vLLM skips a falsy max_tokens.
    engine, registry = make()
    engine.add_request("unset", [5, 6, 7], greedy(4))  # what the server sends for an unset one
    engine.add_request("set", [5, 6, 8], greedy(3, max_tokens_param=3))
    engine.add_request("echo-only", [5, 6, 9], greedy(1, max_tokens_param=0))
    run(engine)
    assert metric(registry, "vllm:request_params_max_tokens_count") == 2
    assert metric(registry, "vllm:request_params_max_tokens_sum") == 4 + 3
