"""The engine on the real SmolLM2 model (float32, CPU): identical greedy output alone, batched,
after a prefix-cache hit and after a preemption; prefix reuse really skips computation;
seeded sampling is reproducible; the forward matches transformers' own.

The model is loaded once per module; each test builds a cheap LLMEngine over one shared
runner (an engine may use only the first N blocks of the runner's KV pool).
The same checks run on a GPU (model_under_test.py; benchmarks/cuda_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.types import FinishReason, SamplingParams
from inference_worker.model.llama import PagedLlama
from inference_worker.model.loader import load_model
from inference_worker.model.tokenizer import HFTokenizer
from inference_worker.model.torch_runner import TorchModelRunner
from tests.worker.engine_helpers import RecordingLogger
from tests.worker.model_under_test import RANDOM_WEIGHTS, TEST_DEVICE, TEST_MODEL

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
]
MAX_TOKENS = 16
DEVICE = torch.device(TEST_DEVICE)


def ids_tensor(ids: list[int]) -> torch.Tensor:
    """One sequence as transformers takes it, on the device under test."""
    return torch.tensor([ids], device=DEVICE)


@pytest.fixture(scope="module")
def loaded():
    return load_model(TEST_MODEL, device=str(DEVICE))


@pytest.fixture(scope="module")
def runner(loaded):
    return TorchModelRunner(PagedLlama(loaded.hf_model, 256, 16, DEVICE, torch.float32))


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return HFTokenizer(loaded.hf_tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def make_engine(runner, tokenizer, num_kv_blocks=None, caching=True, max_num_seqs=8):
    engine = LLMEngine(
        runner,
        tokenizer,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        max_model_len=512,
        enable_prefix_caching=caching,
        num_kv_blocks=num_kv_blocks,
    )
    logger = RecordingLogger()
    engine.add_stat_logger(logger)
    return engine, logger


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def run_all(engine: LLMEngine, max_steps: int = 1000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    raise AssertionError("engine did not finish in time")


@pytest.fixture(scope="module")
def alone(runner, tokenizer, prompts):
    """Reference: each prompt on its own, prefix caching off."""
    ref = []
    for i, p in enumerate(prompts):
        engine, _ = make_engine(runner, tokenizer, caching=False)
        engine.add_request(f"alone{i}", p, greedy())
        ref.append(run_all(engine)[f"alone{i}"])
    return ref


def test_forward_matches_transformers(loaded, runner, prompts):
    from inference_worker.engine.types import ScheduledSequence, StepBatch

    ids = prompts[0]
    seq = ScheduledSequence(0, ids, 0, len(ids), list(range(-(-len(ids) // 16))), greedy(), True, True)
    inputs, _ = runner.build_inputs(StepBatch([seq]))
    inputs.logits_index = torch.arange(len(ids), device=DEVICE)
    with torch.inference_mode():
        ours = runner.model.forward(inputs)
        theirs = loaded.hf_model(ids_tensor(ids)).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_identical_batched_with_prefill_and_decode_mixed(runner, tokenizer, prompts, alone):
    engine, logger = make_engine(runner, tokenizer, caching=False)
    engine.add_request("b0", prompts[0], greedy())
    engine.add_request("b1", prompts[1], greedy())
    out: dict[str, list[int]] = {}
    for _ in range(3):  # b0/b1 are decoding when b2/b3 arrive: steps mix prefills and decodes
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    engine.add_request("b2", prompts[2], greedy())
    engine.add_request("b3", prompts[3], greedy())
    for rid, toks in run_all(engine).items():
        out.setdefault(rid, []).extend(toks)
    assert [out[f"b{i}"] for i in range(4)] == alone
    assert max(st.num_running_reqs for st, _ in logger.records) == 4  # really ran together


def test_greedy_identical_after_prefix_cache_hit_and_cached_tokens_not_recomputed(
    runner, tokenizer, prompts, alone
):
    engine, logger = make_engine(runner, tokenizer, caching=True)
    engine.add_request("first", prompts[0], greedy())
    assert run_all(engine)["first"] == alone[0]
    computed_before = engine.num_computed_tokens_total
    engine.add_request("again", prompts[0], greedy())
    assert run_all(engine)["again"] == alone[0]
    n = len(prompts[0])
    cached = (n - 1) // 16 * 16
    assert cached > 0
    # Only the uncached prompt tail and the decodes ran through the model.
    assert engine.num_computed_tokens_total - computed_before == n - cached + MAX_TOKENS - 1
    assert logger.finished[-1].num_cached_tokens == cached
    # Another prompt with the same chat preamble hits the shared system-prompt blocks.
    engine.add_request("other", prompts[1], greedy())
    assert run_all(engine)["other"] == alone[1]
    pcs = [st.prefix_cache_stats for st, it in logger.records if it is not None]
    assert sum(p.hits for p in pcs) > cached
    assert sum(p.queries for p in pcs) == 2 * n + len(prompts[1])


def test_greedy_identical_after_preemption(runner, tokenizer, prompts, alone):
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    blocks = -(-longest // 16) + 3  # one sequence always fits; four at once do not
    engine, logger = make_engine(runner, tokenizer, num_kv_blocks=blocks, caching=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, greedy())
    out = run_all(engine)
    assert sum(it.num_preempted_reqs for it in logger.iterations) > 0
    assert any(f.num_preemptions > 0 for f in logger.finished)
    assert [out[f"p{i}"] for i in range(4)] == alone
    assert engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_reproducible_alone_and_batched(runner, tokenizer, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    engine, _ = make_engine(runner, tokenizer)
    engine.add_request("s_alone", prompts[1], params)
    first = run_all(engine)["s_alone"]
    engine.add_request("noise0", prompts[0], SamplingParams(max_tokens=12, temperature=1.0))
    engine.add_request("s_batched", prompts[1], params)
    engine.add_request("noise1", prompts[2], SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    engine.add_request("other_seed", prompts[1], SamplingParams(**{**_fields(params), "seed": 4321}))
    out = run_all(engine)
    assert out["s_batched"] == first
    assert out["other_seed"] != first


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in SamplingParams.__slots__}


# ---- logprobs, penalties, logit bias, min_tokens against transformers ----------------------------
def _reference_greedy(loaded, prompt: list[int], steps: int, adjust) -> list[int]:
    """Greedy decoding with transformers' own forward over the whole sequence at each step;
    `adjust(ids, logits)` changes the last position's logits first."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = loaded.hf_model(ids_tensor(ids)).logits[0, -1].float()
            ids.append(int(adjust(ids, logits).argmax()))
    return ids[len(prompt) :]


def _text(tokenizer, token: int) -> str:
    """A token's text as logprobs name it (special tokens included)."""
    return tokenizer.decode([token], skip_special_tokens=False)


def _outputs(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(1000):
        if not engine.has_unfinished:
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish in time")


def test_logprobs_are_the_models_own_batched_or_not(loaded, runner, tokenizer, prompts):
    """Each token's logprob and its 3 likeliest alternatives are transformers' log-softmax at that
    position, for a request batched beside others that ask for none."""
    engine, _ = make_engine(runner, tokenizer)
    engine.add_request("plain", prompts[0], greedy())
    asks = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    engine.add_request("lp", prompts[1], asks)
    outs = _outputs(engine)
    assert all(o.logprobs is None for o in outs["plain"])
    answer = [t for o in outs["lp"] for t in o.token_ids]
    logprobs = [lp for o in outs["lp"] for lp in o.logprobs]
    assert len(logprobs) == len(answer) == 6
    ids = prompts[1] + answer
    with torch.inference_mode():
        theirs = torch.log_softmax(loaded.hf_model(ids_tensor(ids)).logits[0].float(), dim=-1)
    for i, (token, lp) in enumerate(zip(answer, logprobs, strict=True)):
        row = theirs[len(prompts[1]) - 1 + i]
        assert lp.token == _text(tokenizer, token)
        assert lp.logprob == pytest.approx(float(row[token]), abs=2e-3)
        values, top_ids = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == [_text(tokenizer, t) for t in top_ids.tolist()]
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=2e-3)
        assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-6)  # greedy: the sampled one is the top


def test_prompt_logprobs_are_the_models_own_in_chunks_despite_a_cached_prefix(
    loaded, runner, tokenizer, prompts
):
    """Echo with logprobs: each prompt token after the first gets transformers' log-softmax at
    the position before it, whether the prompt was prefilled in several chunks or its prefix
    was already cached (a request asking for prompt logprobs computes its whole prompt)."""
    prompt = prompts[1]
    with torch.inference_mode():
        theirs = torch.log_softmax(loaded.hf_model(ids_tensor(prompt)).logits[0].float(), dim=-1)
    engine = LLMEngine(runner, tokenizer, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    run_all(engine)  # the prompt's full blocks are now cached
    computed = engine.num_computed_tokens_total
    engine.add_request("echo", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    outs = _outputs(engine)["echo"]
    assert engine.num_computed_tokens_total - computed == len(prompt) + 1  # no cache hit, 16 per step
    got = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert len(got) == len(prompt) - 1
    for position, entry in enumerate(got, start=1):
        row = theirs[position - 1]
        assert entry.token == _text(tokenizer, prompt[position])
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=2e-3)
        likeliest = torch.topk(row, 2).indices.tolist()
        assert [t for t, _ in entry.top] == [_text(tokenizer, t) for t in likeliest]


def test_repetition_penalty_matches_transformers_processor(loaded, runner, tokenizer, prompts):
    from transformers import RepetitionPenaltyLogitsProcessor

    processor = RepetitionPenaltyLogitsProcessor(1.5)
    expected = _reference_greedy(
        loaded, prompts[2], 10, lambda ids, logits: processor(ids_tensor(ids), logits[None])[0]
    )
    engine, _ = make_engine(runner, tokenizer)
    engine.add_request("rep", prompts[2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                       repetition_penalty=1.5))
    engine.add_request("plain", prompts[2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    out = run_all(engine)
    assert out["rep"] == expected
    assert out["plain"] != expected  # the penalty changed the answer, and only where asked


def test_frequency_and_presence_penalties_follow_openais_formula(loaded, runner, tokenizer, prompts):
    """OpenAI's documented rule: logit[j] -= count_in_answer[j] * frequency + (count > 0) * presence."""
    prompt = prompts[1]  # its answers differ if the prompt's own tokens were counted too

    def penalize(ids, logits):
        answer = ids[len(prompt) :]
        for tok in set(answer):
            logits[tok] -= answer.count(tok) * 1.0 + 1.0
        return logits

    expected = _reference_greedy(loaded, prompt, 12, penalize)
    engine, _ = make_engine(runner, tokenizer)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
                            presence_penalty=1.0)
    engine.add_request("pen", prompt, params)
    engine.add_request("plain", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    out = run_all(engine)
    assert out["pen"] == expected
    assert out["plain"] != expected


def test_logit_bias_and_min_tokens(runner, tokenizer, prompts):
    engine, _ = make_engine(runner, tokenizer)
    forced = tokenizer.encode(" banana")[0]
    engine.add_request("bias", prompts[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                        logit_bias=((forced, 100.0),)))
    # Without min_tokens a short greedy answer ends with EOS; with it, not before 40 tokens.
    engine.add_request("free", prompts[2], SamplingParams(max_tokens=60, temperature=0.0))
    engine.add_request("min", prompts[2], SamplingParams(max_tokens=60, temperature=0.0, min_tokens=40))
    outs = _outputs(engine)
    assert [t for o in outs["bias"] for t in o.token_ids] == [forced] * 5
    free, held = outs["free"][-1], outs["min"][-1]
    if not RANDOM_WEIGHTS:  # random weights need not say EOS within 60 tokens
        assert free.finish_reason is FinishReason.STOP and free.num_output_tokens < 40
    assert held.num_output_tokens >= 40
    held_tokens = [t for o in outs["min"] for t in o.token_ids]
    assert not set(held_tokens[:39]) & tokenizer.eos_token_ids


# ---- AsyncEngine: streaming, stop strings, abort on close / cancel, stats --------------------------
async def _collect(agen) -> list:
    return [o async for o in agen]


async def _wait_until(predicate, timeout_s: float = 120.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_async_engine_streams_stops_aborts_and_reports_stats(runner, tokenizer, prompts):
    import asyncio

    from inference_worker.engine.async_engine import AsyncEngine
    from inference_worker.engine.errors import PromptTooLongError
    from inference_worker.engine.types import FinishReason

    engine, logger = make_engine(runner, tokenizer)
    aengine = AsyncEngine(engine, "smollm2", log_stats_interval=0.2)
    await aengine.start()
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        arrival = aengine.clock() - 0.25  # e.g. the HTTP request came in before tokenization
        full = await _collect(aengine.generate("full", prompts[1], params, arrival_time=arrival))
        assert full[-1].finished and full[-1].finish_reason is FinishReason.LENGTH
        assert [o.finished for o in full[:-1]] == [False] * (len(full) - 1)
        token_ids = [t for o in full for t in o.token_ids]
        assert len(token_ids) == full[-1].num_output_tokens == 24
        text = "".join(o.text for o in full)
        assert text == tokenizer.decode(token_ids)

        # A stop string from the middle of that text: cut before its first occurrence, reason stop.
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = await _collect(
            aengine.generate("stopped", prompts[1], SamplingParams(**{**_fields(params), "stop": (stop,)}))
        )
        assert "".join(o.text for o in stopped) == text[: text.index(stop)]
        assert stopped[-1].finish_reason is FinishReason.STOP and stopped[-1].matched_stop == stop

        # Closing the iterator early aborts the request and frees its blocks.
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        gen = aengine.generate("closed", prompts[0], long)
        got = [await gen.__anext__(), await gen.__anext__()]
        assert not got[-1].finished
        await gen.aclose()
        await _wait_until(lambda: not engine.has_unfinished)
        assert engine.block_manager.num_used_blocks == 0

        # Cancelling the consuming task aborts too.
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate("cancelled", prompts[2], long):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 120)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_until(lambda: not engine.has_unfinished)
        assert engine.block_manager.num_used_blocks == 0
        # The idle engine reports once more, so running/waiting/KV gauges drop to 0.
        await _wait_until(lambda: logger.records[-1][1] is None)
        assert logger.records[-1][0].num_running_reqs == 0 and logger.records[-1][0].kv_cache_usage == 0

        with pytest.raises(PromptTooLongError):
            await _collect(aengine.generate("too-long", [1] * 500, params))
        # The periodic log() runs, busy or idle (on a GPU all of the above can take under 0.2 s).
        await _wait_until(lambda: logger.logs >= 1)
    finally:
        await aengine.shutdown()

    finished = {f.finish_reason: f for f in logger.finished}
    # The two aborted requests are not counted as finished (as in vLLM v1)...
    assert [f.finish_reason for f in logger.finished] == [FinishReason.LENGTH, FinishReason.STOP]
    # ... but the tokens they took and made are, step by step: at least what their readers got.
    its = logger.iterations
    generated = sum(it.num_generation_tokens for it in its)
    assert generated >= sum(f.num_generation_tokens for f in logger.finished) + 2 + 1
    assert sum(it.num_prompt_tokens for it in its) == len(prompts[1]) * 2 + len(prompts[0]) + len(prompts[2])
    assert len([x for it in its for x in it.time_to_first_tokens_iter]) == 4
    n_itl = len([x for it in its for x in it.inter_token_latencies_iter])
    assert n_itl == generated - 4  # a gap per token after each request's first
    for f, early in zip(logger.finished, [0.25, 0.0], strict=True):  # "full" arrived 0.25 s early
        parts = f.queued_time + f.prefill_time + f.decode_time
        e2e = f.e2e_latency - early
        # e2e also holds the hand-over to the engine thread.
        assert 0 <= e2e - parts <= 0.5 * e2e
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)
    full_stats = finished[FinishReason.LENGTH]
    assert full_stats.mean_time_per_output_token == pytest.approx(full_stats.decode_time / 23)


def test_greedy_identical_with_decode_steps_padded_for_graphs(loaded, tokenizer, prompts):
    """Decode-only steps padded to a graph's bucket (captured on a GPU, run as they are on CPU;
    decode_graphs.py) give the eager runner's tokens: three sequences padded to four rows, whose
    contexts cross from the 4- to the 8-block bucket. Block 0 is the first a sequence gets, so a
    padded row writing anywhere but the scratch slot would change an answer."""
    eager = TorchModelRunner(PagedLlama(loaded.hf_model, 64, 16, DEVICE, torch.float32), decode_graphs=False)
    padded = TorchModelRunner(PagedLlama(loaded.hf_model, 64, 16, DEVICE, torch.float32), decode_graphs=True)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)  # 35-38 prompt tokens: past 64
    results = []
    for runner in (eager, padded):
        engine, _ = make_engine(runner, tokenizer, caching=False)
        for i in range(3):
            engine.add_request(f"r{i}", prompts[i], params)
        out = run_all(engine)
        results.append([out[f"r{i}"] for i in range(3)])
    assert results[0] == results[1]
    assert eager.num_graph_steps == 0
    assert padded.num_graph_steps >= 31  # every step after the prefill
    assert {b for b, _ in padded.decode_graphs._buckets} == {4}
    assert {n for _, n in padded.decode_graphs._buckets} >= {4, 8}
