"""Block manager and scheduler logic with a deterministic fake runner (no model; see engine_helpers).

The behaviour on the real model (identical greedy output, prefix reuse, preemption)
is tested in test_engine_model.py.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from inference_worker.engine.block_manager import BlockManager
from inference_worker.engine.errors import EngineRequestError, PromptTooLongError
from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.sequence import Sequence
from inference_worker.engine.stats import EngineEventType
from inference_worker.engine.types import FinishReason, ParallelSampling, SamplingParams
from tests.worker.engine_helpers import ArithmeticRunner, CharTokenizer, ManualClock, RecordingLogger

BS = 4


def make_engine(
    num_blocks=64, max_num_seqs=8, max_batched=64, max_model_len=256, caching=True, clock=None, chunked=True,
    policy="fcfs",
):
    runner = ArithmeticRunner(BS, num_blocks)
    engine = LLMEngine(
        runner,
        CharTokenizer(),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
        clock=clock or ManualClock(tick=0.001),
    )
    logger = RecordingLogger()
    engine.add_stat_logger(logger)
    return engine, runner, logger


def run_all(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    raise AssertionError("engine did not finish in time")


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def seq_of(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", len(tokens), list(tokens), greedy(4), 0.0)


# ---- block manager ---------------------------------------------------------------------------
def test_block_accounting_allocate_free_and_usage():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a, b = seq_of(list(range(10)), 0), seq_of(list(range(50, 55)), 1)
    assert bm.allocate(a, 10)  # 3 blocks
    assert bm.allocate(b, 5)  # 2 blocks
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_used_blocks == 5 and bm.usage == pytest.approx(0.5)
    assert all(bm.ref_counts[x] == 1 for x in a.block_table + b.block_table)
    assert not bm.allocate(seq_of(list(range(30)), 2), 30)  # 8 blocks > 5 free: refused, nothing taken
    assert bm.num_used_blocks == 5
    bm.free(a)
    assert bm.num_used_blocks == 2 and a.block_table == [] and a.num_computed_tokens == 0
    bm.free(b)
    assert bm.usage == 0.0 and bm.num_free_blocks == 10


def test_prefix_blocks_shared_with_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prompt = list(range(1, 12))  # 11 tokens: 2 full blocks + 3
    a = seq_of(prompt, 0)
    assert bm.match_prefix(a) == []
    assert bm.allocate(a, len(prompt))
    b = seq_of([*prompt, 99], 1)
    cached = bm.match_prefix(b)
    assert cached == a.block_table[:2]
    bm.take_cached(b, cached)
    assert b.num_computed_tokens == 2 * BS
    assert all(bm.ref_counts[x] == 2 for x in cached)
    assert bm.allocate(b, b.num_tokens - b.num_computed_tokens)
    assert bm.num_used_blocks == 3 + 1  # b: 2 shared blocks + 1 of its own
    # The last token is never served from cache: an exactly block-aligned prompt keeps one block to compute.
    c = seq_of(prompt[:8], 2)
    assert len(bm.match_prefix(c)) == 1


def test_cached_blocks_are_shared_only_under_the_same_cache_salt():
    """vLLM's cache_salt: a tenant's salted prompt reuses its own cached blocks, never an
    unsalted or differently salted request's, nor they its (no timing probe across tenants)."""
    bm = BlockManager(num_blocks=20, block_size=BS)
    prompt = list(range(1, 12))  # 2 full blocks + 3

    def salted(seq_id: int, salt: str | None) -> Sequence:
        return Sequence(seq_id, f"r{seq_id}", len(prompt), list(prompt), greedy(4, cache_salt=salt), 0.0)

    a = salted(0, "tenant-a")
    assert bm.allocate(a, len(prompt))
    assert bm.match_prefix(salted(1, "tenant-a")) == a.block_table[:2]
    assert bm.match_prefix(salted(2, "tenant-b")) == []
    assert bm.match_prefix(salted(3, None)) == []
    plain = salted(4, None)
    assert bm.allocate(plain, len(prompt))
    assert bm.match_prefix(salted(5, None)) == plain.block_table[:2]
    assert bm.match_prefix(salted(6, "tenant-b")) == []


def test_lru_eviction_of_unreferenced_cached_blocks():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old, new = seq_of([1] * 9, 0), seq_of([2] * 9, 1)  # 3 blocks each, the first 2 full (cacheable)
    assert bm.allocate(old, 9)
    bm.free(old)  # freed first: least recently used
    assert bm.allocate(new, 9)
    bm.free(new)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 4
    grab = seq_of(list(range(100, 116)), 2)
    assert bm.allocate(grab, 16)  # 4 blocks: 2 never-cached ones, then evict `old`'s, keep `new`'s
    assert bm.num_cached_blocks == 2 + 4  # `new`'s 2 + the 4 full blocks grab just wrote
    assert len(bm.match_prefix(seq_of([1] * 9, 3))) == 0
    assert len(bm.match_prefix(seq_of([2] * 9, 4))) == 2
    bm.free(grab)
    # A cached block that is hit again is taken out of the free queue (ref count 1), not evicted.
    hit = seq_of([2] * 9, 5)
    cached = bm.match_prefix(hit)
    bm.take_cached(hit, cached)
    assert all(bm.ref_counts[x] == 1 for x in cached) and bm.num_used_blocks == 2


# ---- engine + scheduler -------------------------------------------------------------------------
def test_prefix_reuse_skips_cached_tokens_and_counts_queries_and_hits():
    engine, runner, logger = make_engine()
    prompt = list(range(3, 30))  # 27 tokens: 6 full blocks
    engine.add_request("a", prompt, greedy(5))
    first = run_all(engine)["a"]
    computed_first = runner.computed_tokens
    engine.add_request("b", prompt, greedy(5))
    second = run_all(engine)["b"]
    assert second == first
    assert runner.computed_tokens - computed_first == 27 + 4 - 24  # only 3 prompt tokens + 4 decodes
    pcs = [s.prefix_cache_stats for s, it in logger.records if it is not None]
    assert sum(p.queries for p in pcs) == 2 * 27
    assert sum(p.hits for p in pcs) == 24
    assert sum(p.requests for p in pcs) == 2
    assert logger.finished[-1].num_cached_tokens == 24
    # With caching off nothing is looked up, so nothing is counted.
    off, off_runner, off_logger = make_engine(caching=False)
    off.add_request("a", prompt, greedy(5))
    off.add_request("b", prompt, greedy(5))
    assert run_all(off) == {"a": first, "b": first}
    assert off_runner.computed_tokens == 2 * (27 + 4)
    assert all(s.prefix_cache_stats.queries == 0 for s, _ in off_logger.records)


def test_chunked_prefill_respects_token_budget():
    engine, runner, _ = make_engine(max_batched=8, max_num_seqs=4)
    engine.add_request("long", list(range(3, 23)), greedy(3))  # 20 tokens: chunks 8, 8, 4
    engine.add_request("short", [5, 6, 7], greedy(3))
    out = run_all(engine)
    assert len(out["long"]) == 3 and len(out["short"]) == 3
    assert runner.computed_tokens == 20 + 2 + 3 + 2
    solo, _solo_runner, _ = make_engine()
    solo.add_request("long", list(range(3, 23)), greedy(3))
    assert run_all(solo)["long"] == out["long"]


def test_without_chunked_prefill_a_step_is_all_prefill_or_all_decode():
    """vLLM V0's order: admitting a prompt stalls every decode for that step, and a prompt goes
    in whole: the budget is never spent on part of one (FCFS: nobody overtakes it)."""
    engine, runner, _ = make_engine(max_batched=24, max_model_len=24, chunked=False)
    prompts = {"a": list(range(3, 13)), "b": list(range(20, 36)), "c": list(range(40, 49))}
    out: dict[str, list[int]] = {}

    def step() -> list[int]:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        return runner.new_tokens[-1]

    engine.add_request("a", prompts["a"], greedy(6))
    assert step() == [10]  # a's prefill
    assert step() == [1]  # nothing waits: a decodes
    engine.add_request("b", prompts["b"], greedy(6))
    engine.add_request("c", prompts["c"], greedy(6))  # 16 + 9 > 24: c does not fit beside b
    assert step() == [16]  # b alone and whole; a's decode waits
    assert step() == [9]  # c alone: still no decode
    assert step() == [1, 1, 1]  # then all three decode together
    out.update({rid: out.get(rid, []) + toks for rid, toks in run_all(engine).items()})
    for rid, prompt in prompts.items():  # the order of steps changes no answer
        solo, _, _ = make_engine()
        solo.add_request(rid, prompt, greedy(6))
        assert run_all(solo)[rid] == out[rid]


def test_without_chunked_prefill_a_preempted_request_recomputes_in_a_prefill_step():
    engine, runner, logger = make_engine(num_blocks=6, caching=False, max_num_seqs=2, max_batched=24,
                                         max_model_len=24, chunked=False)
    engine.add_request("old", [3] * 7, greedy(12))  # grows to 19 tokens = 5 blocks
    engine.add_request("new", [4] * 7, greedy(12))
    out = run_all(engine)
    assert sum(it.num_preempted_reqs for it in logger.iterations) > 0
    solo, _, _ = make_engine()
    solo.add_request("new", [4] * 7, greedy(12))
    assert run_all(solo)["new"] == out["new"]  # recompute reproduces the same answer
    # The recompute prefilled prompt + output so far in one step, with no decode beside it.
    assert any(len(step) == 1 and step[0] > 7 for step in runner.new_tokens)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("chunked, small, expected", [
    (False, 36, [1]),  # V0: 9 of the 10 free blocks would leave 1 < the 2-block watermark: decode
    (False, 28, [28]),  # V0: 7 blocks leave 3: admitted, alone in its prefill step
    (True, 36, [1, 36]),  # V1: no watermark, admitted beside the decode
])
def test_without_chunked_prefill_admission_keeps_one_percent_of_blocks_free(chunked, small, expected):
    """vLLM V0 admits a prompt only while 1 % of the blocks stay free (its watermark), so a
    sequence just preempted for lack of blocks is not re-admitted into the room its
    neighbours grow into next step, to be recomputed and preempted again."""
    engine, runner, _ = make_engine(num_blocks=200, max_batched=800, max_model_len=800,
                                    caching=False, chunked=chunked)
    engine.add_request("big", [3] * 760, greedy(8))  # 190 of 200 blocks
    engine.step()
    assert runner.new_tokens[-1] == [760]
    engine.add_request("small", [5] * small, greedy(2))
    engine.step()
    assert runner.new_tokens[-1] == expected


def test_without_chunked_prefill_a_request_the_watermark_leaves_no_room_for_is_refused():
    """Beside the watermark a whole-pool request could never be admitted, and FCFS would stall
    everyone behind it: it is refused with the context-length error instead."""
    v0, _, _ = make_engine(num_blocks=200, max_batched=800, max_model_len=800, chunked=False)
    assert v0.max_model_len == (200 - 2) * BS
    with pytest.raises(PromptTooLongError):
        v0.add_request("whole-pool", [3] * 790, greedy(5))
    v1, _, _ = make_engine(num_blocks=200, max_batched=800, max_model_len=800, chunked=True)
    v1.add_request("whole-pool", [3] * 790, greedy(5))
    assert len(run_all(v1)["whole-pool"]) == 5


def test_without_chunked_prefill_the_budget_must_hold_the_longest_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(max_batched=64, max_model_len=256, chunked=False)


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_recomputes_to_identical_output(caching):
    prompts = {f"r{i}": [3 + i, *list(range(10, 18))] for i in range(4)}  # 9 tokens each
    ref = {}
    for rid, p in prompts.items():
        solo, _, _ = make_engine()
        solo.add_request(rid, p, greedy(16))
        ref[rid] = run_all(solo)[rid]
    # 4 x (9 + 16) tokens need 4 x 7 blocks; 12 blocks force preemptions.
    engine, _, logger = make_engine(num_blocks=12, caching=caching)
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy(16))
    out = run_all(engine)
    assert out == ref
    preempted = sum(it.num_preempted_reqs for it in logger.iterations)
    assert preempted > 0
    fin = {f.num_preemptions for f in logger.finished}
    assert max(fin) > 0
    assert engine.block_manager.num_used_blocks == 0


def test_preemption_picks_the_newest_running_request():
    engine, _, _ = make_engine(num_blocks=6, caching=False, max_num_seqs=2)
    engine.add_request("old", [3] * 7, greedy(12))  # 2 blocks, grows to 5
    engine.add_request("new", [4] * 7, greedy(12))
    events = {}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        for rid in ("old", "new"):
            seq = engine.sequence(rid)
            if seq is not None:
                events[rid] = [e.type for e in seq.events]
        engine.step()
    assert EngineEventType.PREEMPTED in events["new"]
    assert EngineEventType.PREEMPTED not in events["old"]


def _finish_order(engine: LLMEngine) -> list[str]:
    order = []
    for _ in range(2000):
        if not engine.has_unfinished:
            return order
        order += [o.request_id for o in engine.step() if o.finished]
    raise AssertionError("engine did not finish in time")


@pytest.mark.parametrize(("policy", "expected"), [("fcfs", ["a", "b", "c", "d"]),
                                                   ("priority", ["a", "d", "c", "b"])])
def test_the_priority_policy_admits_lower_priority_values_first(policy, expected):
    """One seat: "a" runs; of those waiting, priority -1 goes before 0 before 5 (fcfs: arrival
    order, priority ignored, as vLLM does)."""
    engine, _, _ = make_engine(max_num_seqs=1, policy=policy)
    engine.add_request("a", [3] * 5, greedy(4, priority=9))
    engine.step()  # "a" holds the seat; a better priority waits for it, as in vLLM
    for rid, priority in (("b", 5), ("c", 0), ("d", -1)):
        engine.add_request(rid, [3] * 5, greedy(4, priority=priority))
    assert _finish_order(engine) == expected


def test_the_priority_policy_preempts_the_worst_priority_not_the_newest():
    engine, _, _ = make_engine(num_blocks=6, caching=False, max_num_seqs=2, policy="priority")
    engine.add_request("batch", [3] * 7, greedy(12, priority=5))  # 2 blocks, grows to 5
    engine.add_request("urgent", [4] * 7, greedy(12, priority=0))
    preempted = set()
    while engine.has_unfinished:
        for rid in ("batch", "urgent"):
            seq = engine.sequence(rid)
            if seq is not None and EngineEventType.PREEMPTED in [e.type for e in seq.events]:
                preempted.add(rid)
        engine.step()
    assert preempted == {"batch"}


def test_by_priority_a_victim_already_in_the_step_gives_its_tokens_back():
    """Budget 4, pool 5 blocks of 4. "batch" (priority 5) runs first in the running list, then
    "urgent" (0), then "late" (0, still in its prompt). In step 5 "batch" gets its decode token,
    then "urgent" needs a block, none is free, and "batch", the worst ranked, is preempted. As
    in vLLM v1 its token goes back to the step's budget: "late" computes 3 prompt tokens, not 2,
    and the step uses the whole budget."""
    engine, runner, _ = make_engine(num_blocks=5, max_num_seqs=3, max_batched=4, caching=False,
                                    policy="priority")
    engine.add_request("batch", [3] * 2, greedy(8, priority=5))
    engine.step()
    engine.add_request("urgent", [4] * 2, greedy(8))
    engine.add_request("late", [5] * 8, greedy(8))
    for _ in range(3):
        engine.step()
    assert runner.new_tokens[-1] == [1, 1, 2]  # batch, urgent, late; every block now in use
    assert engine.block_manager.num_free_blocks == 0
    engine.step()
    assert engine.sequence("batch").num_preemptions == 1  # the schedule this test is about happened
    assert runner.new_tokens[-1] == [1, 3]  # urgent, late (2 before: batch's token was lost)
    assert run_all(engine).keys() == {"batch", "urgent", "late"}


def test_abort_frees_blocks_at_next_step_and_is_not_counted_as_finished():
    """As in vLLM v1: a request aborted from outside gets no finished stats (no
    request_success_total{finished_reason="abort"}, no per-request histograms); the tokens it
    made were counted step by step and stay counted."""
    engine, _, logger = make_engine()
    engine.add_request("x", list(range(3, 20)), greedy(50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request("x")
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == "x"] == [FinishReason.ABORT]
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished
    assert logger.finished == []
    assert sum(it.num_generation_tokens for it in logger.iterations) == 2


def test_an_aborted_choice_leaves_n_to_its_siblings():
    """n > 1: an aborted choice no longer holds the request open (vLLM's ParentRequest), so the
    last choice to finish still records n and the longest finished answer."""
    engine, _, logger = make_engine()
    parallel = ParallelSampling(n=2, unfinished=2)
    engine.add_request("a", list(range(3, 12)), greedy(4, parallel=parallel))
    engine.add_request("b", list(range(3, 12)), greedy(50, parallel=parallel))
    engine.step()
    engine.abort_request("b")
    run_all(engine)
    (finished,) = logger.finished
    assert (finished.n_param, finished.max_num_generation_tokens) == (2, 4)


def test_stop_string_stop_token_eos_and_length():
    engine, _, _ = make_engine()
    prompt = list(range(3, 12))
    engine.add_request("len", prompt, greedy(12))
    full = run_all(engine)["len"]
    text = CharTokenizer().decode(full)
    stop = text[5:7]
    engine.add_request("stop", prompt, greedy(12, stop=(stop,)))
    engine.add_request("tok", prompt, greedy(12, stop_token_ids=(full[3],)))
    outs: dict[str, list] = {}
    while engine.has_unfinished:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    s = outs["stop"]
    assert s[-1].finish_reason is FinishReason.STOP and s[-1].matched_stop == stop
    assert "".join(o.text for o in s) == text[: text.index(stop)]
    t = outs["tok"]
    assert t[-1].finish_reason is FinishReason.STOP and t[-1].num_output_tokens == full.index(full[3]) + 1


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after():
    engine, _, _ = make_engine()
    prompt = list(range(3, 12))
    engine.add_request("len", prompt, greedy(12))
    text = CharTokenizer().decode(run_all(engine)["len"])
    stop = text[5:7]
    engine.add_request("keep", prompt, greedy(12, stop=(stop,), include_stop_str_in_output=True))
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].matched_stop == stop
    assert "".join(o.text for o in outs) == text[: text.index(stop) + len(stop)]


def test_request_validation():
    engine, _, _ = make_engine(max_model_len=32)
    with pytest.raises(PromptTooLongError):
        engine.add_request("a", list(range(3, 40)), greedy(1))
    with pytest.raises(PromptTooLongError):
        engine.add_request("b", list(range(3, 20)), greedy(20))
    with pytest.raises(EngineRequestError):
        engine.add_request("c", [], greedy(1))
    with pytest.raises(ValueError):
        engine.add_request("d", [5], SamplingParams(max_tokens=0))


def test_stats_intervals_follow_the_event_timestamps():
    clock = ManualClock(start=0.0, tick=0.0)
    engine, _, logger = make_engine(clock=clock, max_num_seqs=1)
    engine.add_request("a", list(range(3, 10)), greedy(4), arrival_time=-0.5)
    clock.advance(1.0)
    engine.add_request("b", list(range(3, 10)), greedy(2))  # queued at 1.0, waits for "a"
    for _ in range(50):
        if not engine.has_unfinished:
            break
        clock.advance(1.0)
        engine.step()
    a, b = logger.finished
    # a: scheduled at 2 (first step), tokens at 2, 3, 4, 5.
    assert a.queued_time == pytest.approx(2.0)  # QUEUED at 0, first SCHEDULED at 2
    assert a.prefill_time == pytest.approx(0.0)
    assert a.decode_time == pytest.approx(3.0) and a.inference_time == pytest.approx(3.0)
    assert a.e2e_latency == pytest.approx(5.5)  # from arrival (-0.5) to the finishing iteration (5)
    assert a.mean_time_per_output_token == pytest.approx(1.0)
    # b: queued at 1, scheduled at 6 once a left, tokens at 6 and 7.
    assert b.queued_time == pytest.approx(5.0) and b.decode_time == pytest.approx(1.0)
    its = logger.iterations
    assert sum(it.num_generation_tokens for it in its) == 6
    assert sum(it.num_prompt_tokens for it in its) == 14
    assert sorted(x for it in its for x in it.time_to_first_tokens_iter) == pytest.approx([2.5, 5.0])
    assert len([x for it in its for x in it.inter_token_latencies_iter]) == 3 + 1
    engine.record_idle()
    idle, none = logger.records[-1]
    assert none is None and idle.num_running_reqs == 0 and idle.kv_cache_usage == 0.0


def test_step_cost_stays_flat_with_many_streams():
    """160 concurrent sequences: a step must not be quadratic in the number of sequences."""
    engine, runner, _ = make_engine(num_blocks=4000, max_num_seqs=256, max_batched=4096, max_model_len=512)
    for i in range(160):
        engine.add_request(f"s{i}", [3 + i % 40, 4, 5, 6], greedy(8))
    out = run_all(engine)
    assert len(out) == 160 and all(len(v) == 8 for v in out.values())
    assert max(runner.batch_sizes) == 160


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_that_ban_every_token_still_sample(temperature):
    """min_tokens with every token of the vocabulary among the stop ids (the API takes any
    list) bans the whole row: its softmax was NaN, torch.multinomial raised and the engine loop
    died with every request in it (found by benchmarks/sampler_fuzz.py on 301f47b^). The row
    still yields a token of the vocabulary, and the row beside it is sampled as without it."""
    import torch

    from inference_worker.engine.sampler import sample

    vocab = 6
    logits = torch.tensor([[0.5, 2.0, -1.0, 0.0, 1.0, 0.3], [0.0, 0.0, 9.0, 0.0, 0.0, 0.0]])
    banned = SamplingParams(max_tokens=4, temperature=temperature, min_tokens=3,
                            ends_answer_ids=tuple(range(vocab)))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    for k in range(20):
        first, second = sample(logits, [banned, greedy], [k % 3, 0], [[1, 2], [3]])
        assert 0 <= first < vocab and second == 2


def test_sampler_filters_and_edge_parameters():
    import torch

    from inference_worker.engine.sampler import sample

    params = [
        SamplingParams(max_tokens=1, temperature=0.0),  # greedy
        SamplingParams(max_tokens=1, temperature=1.0, top_k=1),  # greedy via top_k
        SamplingParams(max_tokens=1, temperature=-1.0),  # invalid temperature: greedy, not a crash
        # Too small to divide logits by (they overflow to inf, the softmax to NaN): greedy, as in vLLM.
        SamplingParams(max_tokens=1, temperature=1e-40, seed=3),
        SamplingParams(max_tokens=1, temperature=1.0, top_p=0.0, seed=3),  # only the top token survives
        SamplingParams(max_tokens=1, temperature=1.0, top_k=2, seed=3),
        SamplingParams(max_tokens=1, temperature=5.0, top_p=0.5, seed=3),
    ]
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0, 4.8]] * len(params))
    for _ in range(20):
        out = sample(logits, params, [0] * len(params))
        assert out[:5] == [1, 1, 1, 1, 1]
        assert out[5] in (1, 2) and out[6] in (1, 2)
    # min_p: tokens below min_p x the top probability never come out (at temperature 1 here,
    # 4.8 is e^-0.2 = 0.82 of the top and 0.0 is e^-5 of it); min_p 0 leaves them all possible.
    kept = SamplingParams(max_tokens=1, temperature=1.0, min_p=0.8)
    assert {sample(logits[:1], [kept], [k])[0] for k in range(200)} <= {1, 2, 4}
    hot = SamplingParams(max_tokens=1, temperature=5.0, min_p=0.0)
    assert {sample(logits[:1], [hot], [k])[0] for k in range(400)} == {0, 1, 2, 3, 4}
    narrow = SamplingParams(max_tokens=1, temperature=5.0, min_p=0.99)  # only the top survives
    assert {sample(logits[:1], [narrow], [k])[0] for k in range(50)} == {1}
    # A repetition penalty so small (or so large) that penalized logits leave float32's range
    # (inf, or 0 x inf = NaN for token 0) still samples: a tiny one puts the seen tokens with
    # positive logits first, an infinite one leaves them 0 and the negative ones impossible.
    seen = [0, 1, 3, 4]
    for penalty, possible in ((1e-39, {1, 4}), (float("inf"), {1, 2, 4})):
        penalized = SamplingParams(max_tokens=1, temperature=1.0, repetition_penalty=penalty)
        assert {sample(logits[:1], [penalized], [k], [seen])[0] for k in range(30)} <= possible
    # Seeded draws depend on (seed, output index) only.
    row = torch.randn(1, 1000)
    p = [SamplingParams(max_tokens=1, temperature=1.0, seed=11)]
    assert [sample(row, p, [k]) for k in range(5)] == [sample(row, p, [k]) for k in range(5)]
    assert len({sample(row, p, [k])[0] for k in range(20)}) > 1


class _FailingRunner(ArithmeticRunner):
    def execute(self, batch):
        raise RuntimeError("device lost")


async def test_engine_loop_death_fails_open_requests_and_reports_unhealthy():
    from inference_worker.engine.async_engine import AsyncEngine
    from inference_worker.engine.errors import EngineDeadError

    engine = LLMEngine(
        _FailingRunner(BS, 16), CharTokenizer(), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64
    )
    aengine = AsyncEngine(engine, "m")
    await aengine.start()
    try:
        assert aengine.is_healthy
        with pytest.raises(EngineDeadError):
            async for _ in aengine.generate("x", [5, 6, 7], greedy(3)):
                pass
        assert not aengine.is_healthy
        with pytest.raises(EngineDeadError):  # later requests fail fast instead of hanging
            async for _ in aengine.generate("y", [5, 6, 7], greedy(3)):
                pass
    finally:
        await aengine.shutdown()


async def test_a_late_abort_of_a_finished_request_spares_a_new_one_under_its_id():
    """A consumer cancelled with its last output still queued (a client gone as its answer
    ended) aborts an id the engine has already finished; a retry under the same id that
    reaches the engine thread in the same turn must not be the one aborted."""
    from inference_worker.engine.async_engine import AsyncEngine

    engine, _, logger = make_engine()
    aengine = AsyncEngine(engine, "m")
    await aengine.start()
    try:
        old = aengine.generate("r", [5, 6, 7], greedy(1))
        reader = asyncio.ensure_future(anext(old))
        await asyncio.sleep(0)  # the request is in the engine's inbox
        with aengine._cond:  # the engine thread takes nothing until both are posted
            for _ in range(500):  # let it finish "r" (its output is then on its way to the loop)
                if logger.finished:
                    break
                aengine._cond.wait(0.01)
            assert logger.finished and not engine.has_unfinished
            reader.cancel()  # before the loop hands it the output: its generator aborts "r"
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            retry = aengine.generate("r", [5, 6, 7], greedy(4))
            first = asyncio.ensure_future(anext(retry))
            await asyncio.sleep(0)  # the retry's add is posted after the stale abort
        outs = [await first]
        async for out in retry:
            outs.append(out)
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in outs) == 4
    finally:
        await aengine.shutdown()


@pytest.mark.parametrize("attempt", range(5))
async def test_a_request_retried_under_its_id_as_the_first_is_aborted_gets_only_its_own_outputs(attempt):
    """A client whose connection dropped retries at once with the same X-Request-Id: the first
    request is aborted at the engine's next step, and its outputs of the step before are still
    on their way to the loop. The retry must get none of them: before, its queue took them (its
    answer began with the old one's tokens, or ended with its abort), and the engine's
    DuplicateRequestError came too late to matter."""
    from inference_worker.engine.async_engine import AsyncEngine

    engine, _, _ = make_engine()
    aengine = AsyncEngine(engine, "m")
    await aengine.start()
    try:
        old = aengine.generate("r", [5, 6, 7], greedy(200))
        for _ in range(3 + attempt):  # mid-generation: the engine thread steps without pause
            await anext(old)
        await old.aclose()  # the client left: its abort is posted
        outs = [out async for out in aengine.generate("r", [9, 9, 9, 9], greedy(6))]
        assert [o.finish_reason for o in outs if o.finished] == [FinishReason.LENGTH]
        assert sum(len(o.token_ids) for o in outs) == 6
        assert outs[-1].num_prompt_tokens == 4
    finally:
        await aengine.shutdown()
