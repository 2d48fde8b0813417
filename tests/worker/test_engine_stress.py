"""A bounded randomized stress of the engine's KV bookkeeping under adversarial schedules.

A tiny KV pool (a preemption every few steps), a small token budget (prefills in chunks),
prompts that share prefixes, repeat an earlier prompt or end exactly on a block boundary,
n > 1 requests (choices with one arrival time: ties under the priority policy), aborts while
waiting, mid-prefill, while decoding and right after a preemption, a request that needs the
whole pool and requests larger than it. After every step the invariants a user relies on are
asserted (`check_invariants`); at the end every request has ended exactly once, every block is
free again and every greedy answer equals the same prompt's answer run alone with room to spare.

Two runners: ArithmeticRunner (the fake model: many seeds in seconds, and it raises on any read
of a KV slot that does not hold the sequence's token) and the real forward (PagedLlama) over a
2-layer random-weight SmolLM2 stand-in (benchmarks/random_weights.py), where a stale or
overwritten block changes the answers. Seeds are fixed: a failure replays exactly.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from inference_worker.engine.block_manager import BlockManager
from inference_worker.engine.errors import PromptTooLongError
from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.sequence import Sequence, SequenceStatus
from inference_worker.engine.types import FinishReason, ParallelSampling, SamplingParams
from tests.worker.engine_helpers import ArithmeticRunner, CharTokenizer, ManualClock

BS = 4
POOL_BLOCKS = 12  # 48 tokens: four modest requests do not fit at once
BUDGET = 10  # tokens per step with chunked prefill: most prompts take two or more steps
MAX_SEATS = 5
MAX_PROMPT = 28  # but for the one that fills the pool: with 11 new tokens, under 48
ARRIVAL_STEPS = 140  # new requests only this long, then the engine must drain
MAX_STEPS = 420  # a hang or a livelock fails here, not at the CI timeout
Alone = Callable[[list[int], int], list[int]]
Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class Setup:
    policy: Policy = "fcfs"
    chunked: bool = True


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_alone(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request("alone", prompt, greedy(max_tokens))
    tokens: list[int] = []
    while engine.has_unfinished:
        tokens += [t for o in engine.step() for t in o.token_ids]
    return tokens


def engine_over(runner, tokenizer, setup: Setup, num_kv_blocks: int | None, caching: bool,
                clock: Callable[[], float] | None = None) -> LLMEngine:
    """An engine with the stress test's limits (V0 order needs a budget of a whole context)."""
    return LLMEngine(
        runner, tokenizer,
        max_num_seqs=MAX_SEATS,
        max_num_batched_tokens=BUDGET if setup.chunked else 256,
        max_model_len=256,
        enable_prefix_caching=caching,
        enable_chunked_prefill=setup.chunked,
        scheduling_policy=setup.policy,
        num_kv_blocks=num_kv_blocks,
        **({"clock": clock} if clock is not None else {}),
    )


# ---- what a cached block must hold --------------------------------------------------------------
class SlotContent:
    """Checks a cached block against the ArithmeticRunner's record of every slot's (position, token).

    A hash names (block index, tokens) through the sequences that computed it; the test keeps
    that map from every sequence it has seen, so a block whose content was overwritten (or
    never written) after it was cached is caught the step it happens."""

    def __init__(self, runner: ArithmeticRunner) -> None:
        self.runner = runner
        self.named: dict[int, tuple[int, tuple[int, ...]]] = {}

    def learn(self, seq: Sequence) -> None:
        for i, h in enumerate(seq.block_hashes):
            self.named.setdefault(h, (i, tuple(seq.token_ids[i * BS : (i + 1) * BS])))

    def check(self, block: int, h: int) -> None:
        index, tokens = self.named[h]
        held = [self.runner.slots.get(block * BS + j) for j in range(BS)]
        expected = [(index * BS + j, t) for j, t in enumerate(tokens)]
        assert held == expected, f"cached block {block} holds {held}, its hash says {expected}"


class PoolContent:
    """The real pool: a hash's K/V, seen once, must be what every later block under it holds
    (equal up to float noise: batch shapes change the last bits)."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv = kv_cache
        self.seen: dict[int, torch.Tensor] = {}

    def learn(self, seq: Sequence) -> None:
        """Nothing to learn: the first look at a hash's block is its reference."""

    def check(self, block: int, h: int) -> None:
        now = self.kv[:, block * BS : (block + 1) * BS].clone()
        first = self.seen.setdefault(h, now)
        assert torch.allclose(now, first, atol=1e-4, rtol=1e-4), f"cached block {block} changed content"


# ---- invariants ---------------------------------------------------------------------------------
def check_invariants(engine: LLMEngine, live: list[Sequence], content: SlotContent | PoolContent) -> None:
    check_queues(engine, live)
    check_ownership(engine.block_manager, live)
    check_prefix_index(engine.block_manager, content)


def check_queues(engine: LLMEngine, live: list[Sequence]) -> None:
    """Every unfinished request sits in exactly one queue, with the matching status."""
    running, waiting = engine.scheduler.running, list(engine.scheduler.waiting)
    assert len({id(s) for s in running + waiting}) == len(running) + len(waiting), "a sequence queued twice"
    assert {id(s) for s in running + waiting} == {id(s) for s in live}
    assert all(s.status is SequenceStatus.RUNNING for s in running)
    assert all(s.status is SequenceStatus.WAITING for s in waiting)
    assert len(running) <= engine.scheduler.max_num_seqs
    for s in waiting:  # never scheduled, or preempted: either way it holds nothing
        assert not s.block_table and s.num_computed_tokens == 0, f"{s.request_id} waits holding blocks"
    for s in running:
        assert s.num_computed_tokens < s.num_tokens, f"{s.request_id} computed its unsampled token"
        assert len(s.block_table) >= -(-s.num_computed_tokens // BS), f"{s.request_id} lost computed blocks"


def check_ownership(bm: BlockManager, live: list[Sequence]) -> None:
    """Ref counts are exactly the block tables' references; a block in two tables is a shared
    prefix block (same hash, same index); free blocks are exactly the unreferenced ones."""
    refs: Counter[int] = Counter()
    where: dict[int, set[tuple[int, int]]] = {}
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), f"{s.request_id} holds a block twice"
        refs.update(s.block_table)
        for i, b in enumerate(s.block_table):
            where.setdefault(b, set()).add((i, s.block_hashes[i] if i < len(s.block_hashes) else -1))
    assert [refs[b] for b in range(bm.num_blocks)] == bm.ref_counts, "ref counts differ from block tables"
    assert set(bm._free) == {b for b in range(bm.num_blocks) if refs[b] == 0}, "free queue != unreferenced"
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for b, owners in where.items():
        if refs[b] > 1:
            assert len(owners) == 1 and bm.block_hash[b] == next(iter(owners))[1], (
                f"block {b} owned by {refs[b]} sequences but not one shared prefix block: {owners}"
            )


def check_prefix_index(bm: BlockManager, content: SlotContent | PoolContent) -> None:
    """The hash index and the per-block hashes agree both ways, and every cached block still
    holds what its hash names."""
    for h, b in bm._cached.items():
        assert bm.block_hash[b] == h, f"index maps {h} to block {b}, which is marked {bm.block_hash[b]}"
        content.check(b, h)
    for b, h in enumerate(bm.block_hash):
        assert h is None or bm._cached.get(h) == b, f"block {b} marked cached but not in the index"


# ---- the driver ---------------------------------------------------------------------------------
@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    seq: Sequence
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    abort_asked: bool = False
    choices: ParallelSampling | None = None


class Stress:
    def __init__(self, engine: LLMEngine, seed: int, token_range: tuple[int, int],
                 content: SlotContent | PoolContent) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.token_range = token_range
        self.content = content
        self.requests: dict[str, Request] = {}
        self.aborts: Counter[str] = Counter()
        self.refused = 0
        self.preemptions = 0
        self.next_id = 0
        self.pool_tokens = engine.max_model_len
        # Shared prefixes: two block-aligned (whole cached blocks), one not.
        self.prefixes = [self._tokens(n) for n in (2 * BS, 3 * BS, 2 * BS + 1)]

    # -- requests --
    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*self.token_range) for _ in range(n)]

    def _prompt(self) -> list[int]:
        roll = self.rng.random()
        if roll < 0.4:  # a shared prefix + its own tail (or none: then it equals the prefix)
            return self.rng.choice(self.prefixes) + self._tokens(self.rng.randrange(0, 10))
        if roll < 0.55:  # ends exactly on a block boundary
            return self._tokens(BS * self.rng.randrange(1, 6))
        earlier = [r.prompt for r in self.requests.values() if len(r.prompt) <= MAX_PROMPT]
        if roll < 0.65 and earlier:  # an earlier prompt again: all of it cached but the last token
            return list(self.rng.choice(earlier))
        return self._tokens(self.rng.randrange(1, 25))

    def _add(self, prompt: list[int], max_tokens: int, priority: int, choices: int = 1) -> None:
        group = ParallelSampling(choices, choices) if choices > 1 else None
        # Now and then an echo with logprobs: it reads no cache, so its copies of cached blocks
        # stay uncached (and go to the eviction front when freed).
        echo = 0 if self.rng.random() < 0.1 else None
        params = greedy(max_tokens, priority=priority, parallel=group, prompt_logprobs=echo)
        arrival = self.engine.clock()  # one arrival for all choices: rank ties under "priority"
        for c in range(choices):
            rid = f"r{self.next_id}" + (f"#{c}" if group else "")
            self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            seq = self.engine.sequence(rid)
            assert seq is not None
            self.requests[rid] = Request(rid, list(prompt), max_tokens, seq, choices=group)
        self.next_id += 1

    def _refuse_oversized(self) -> None:
        """Longer than the whole pool: refused at once, leaving no trace in the engine."""
        n = self.rng.randrange(self.pool_tokens - 8, self.pool_tokens + 8)
        max_tokens = max(1, self.pool_tokens - n + self.rng.randrange(1, 6))  # n + max_tokens > the pool
        rid = f"big{self.next_id}"
        self.next_id += 1
        free = self.engine.block_manager.num_free_blocks
        with pytest.raises(PromptTooLongError, match="maximum context length"):
            self.engine.add_request(rid, self._tokens(n), SamplingParams(max_tokens=max_tokens))
        assert self.engine.sequence(rid) is None and self.engine.block_manager.num_free_blocks == free
        self.refused += 1

    def arrive(self) -> None:
        roll = self.rng.random()
        priority = self.rng.randrange(3)
        if roll < 0.05:
            self._refuse_oversized()
        elif roll < 0.08:  # exactly the whole pool: everyone else must make way for it
            max_tokens = self.rng.randrange(2, 8)
            self._add(self._tokens(self.pool_tokens - max_tokens), max_tokens, priority)
        elif roll < 0.18:
            self._add(self._prompt(), self.rng.randrange(1, 10), priority, choices=self.rng.randrange(2, 4))
        elif roll < 0.6:
            self._add(self._prompt(), self.rng.randrange(1, 12), priority)

    # -- aborts --
    def _abort_candidates(self, preempted_now: set[str]) -> dict[str, list[Request]]:
        kinds: dict[str, list[Request]] = {"waiting": [], "prefill": [], "decode": [], "preempted": []}
        for req in self.requests.values():
            s = req.seq
            if req.finish is not None or req.abort_asked:
                continue
            if req.rid in preempted_now:
                kinds["preempted"].append(req)
            elif s.status is SequenceStatus.WAITING and not s.ever_scheduled:
                kinds["waiting"].append(req)
            elif s.status is SequenceStatus.RUNNING:
                mid_prefill = s.num_computed_tokens < s.num_tokens - 1
                kinds["prefill" if mid_prefill else "decode"].append(req)
        return {k: v for k, v in kinds.items() if v}

    def maybe_abort(self, preempted_now: set[str]) -> None:
        kinds = self._abort_candidates(preempted_now)
        # Most preempted requests must come back (recompute, prefix hits on their own blocks):
        # abort a third of them right after their preemption, and others now and then.
        if "preempted" in kinds and self.rng.random() < 0.35:
            kind = "preempted"
        elif self.rng.random() < 0.12 and kinds.keys() - {"preempted"}:
            kind = self.rng.choice(sorted(kinds.keys() - {"preempted"}))
        else:
            return
        req = self.rng.choice(kinds[kind])
        self.engine.abort_request(req.rid)
        if self.rng.random() < 0.3:
            self.engine.abort_request(req.rid)  # twice: still one end
        req.abort_asked = True
        self.aborts[kind] += 1

    # -- steps --
    def live(self) -> list[Sequence]:
        return [r.seq for r in self.requests.values() if r.finish is None]

    def step(self) -> set[str]:
        """One engine step and its checks; returns the requests it preempted."""
        before = {r.rid: r.seq.num_preemptions for r in self.requests.values() if r.finish is None}
        scanned = self.live()
        outputs = self.engine.step()
        for out in outputs:
            req = self.requests[out.request_id]
            assert req.finish is None, f"{req.rid}: an output after its end"
            req.tokens += out.token_ids
            if req.abort_asked:  # the abort lands at this step, before anything is computed
                assert out.finished and out.finish_reason is FinishReason.ABORT and not out.token_ids
            if out.finished:
                assert out.finish_reason is not None
                req.finish = out.finish_reason
                assert self.engine.sequence(req.rid) is None
        for req in self.requests.values():
            assert not (req.abort_asked and req.finish is None), f"{req.rid}: abort did not end it"
        for seq in scanned:
            self.content.learn(seq)
        check_invariants(self.engine, self.live(), self.content)
        preempted = {rid for rid, n in before.items() if self.requests[rid].seq.num_preemptions > n}
        self.preemptions += len(preempted)
        return preempted

    def run(self) -> None:
        preempted: set[str] = set()
        for step in range(MAX_STEPS):
            if step < ARRIVAL_STEPS:
                self.arrive()
            self.maybe_abort(preempted)
            if step >= ARRIVAL_STEPS and not self.engine.has_unfinished:
                return
            preempted = self.step()
        raise AssertionError(f"not drained after {MAX_STEPS} steps: a request hangs or loops")

    # -- the end --
    def check_end(self, alone: Alone) -> None:
        bm = self.engine.block_manager
        assert not self.engine.has_unfinished
        assert not self.engine.scheduler.running and not self.engine.scheduler.waiting
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts), "leaked KV blocks"
        longest: dict[tuple[int, ...], int] = {}
        for req in self.requests.values():
            assert req.finish is not None, f"{req.rid} never ended"
            assert req.choices is None or req.choices.unfinished == 0, f"{req.rid}: choices not all ended"
            key = tuple(req.prompt)
            longest[key] = max(longest.get(key, 0), req.max_tokens)
        reference = {p: alone(list(p), n) for p, n in longest.items()}
        for req in self.requests.values():
            ref = reference[tuple(req.prompt)]
            if req.abort_asked:
                assert req.finish is FinishReason.ABORT
                assert req.tokens == ref[: len(req.tokens)], f"{req.rid}: answer differs from alone"
            else:
                assert req.finish is FinishReason.LENGTH
                assert req.tokens == ref[: req.max_tokens], f"{req.rid}: answer differs from alone"

    def check_coverage(self, setup: Setup) -> None:
        """The schedule really went through the transitions this test is for."""
        wanted = {"waiting", "decode", "preempted"} | ({"prefill"} if setup.chunked else set())
        assert wanted <= set(self.aborts), f"abort kinds seen: {dict(self.aborts)}"
        assert self.preemptions >= 5 and self.refused >= 1
        assert sum(r.seq.num_cached_tokens for r in self.requests.values()) > 0, "no prefix-cache hit"
        assert any(r.choices for r in self.requests.values())


# ---- the fake model: many seeds ------------------------------------------------------------------
SETUPS = [Setup("fcfs", True), Setup("priority", True), Setup("fcfs", False), Setup("priority", False)]


def arithmetic_alone(prompt: list[int], max_tokens: int) -> list[int]:
    engine = engine_over(ArithmeticRunner(BS, 64), CharTokenizer(), Setup(), None, caching=False)
    return run_alone(engine, prompt, max_tokens)


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"{s.policy}-{'chunked' if s.chunked else 'v0'}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_bookkeeping_holds_under_a_random_adversarial_schedule(setup: Setup, seed: int) -> None:
    runner = ArithmeticRunner(BS, POOL_BLOCKS, vocab=50)
    engine = engine_over(runner, CharTokenizer(), setup, None, caching=True, clock=ManualClock(tick=0.001))
    stress = Stress(engine, seed, (3, 50), SlotContent(runner))
    stress.run()
    stress.check_end(arithmetic_alone)
    stress.check_coverage(setup)


# ---- the real forward on a tiny random-weight model ----------------------------------------------
# Larger initial weights than the default 0.02: the answers then depend on the whole context
# (at 0.02 they repeat the last token), so a wrong K/V shows in them.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "initializer_range": 0.2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from benchmarks.random_weights import build
    from inference_worker.model.llama import PagedLlama
    from inference_worker.model.loader import load_model, resolve_model_dir
    from inference_worker.model.tokenizer import HFTokenizer
    from inference_worker.model.torch_runner import TorchModelRunner

    path = tmp_path_factory.mktemp("tiny") / "model"
    build(resolve_model_dir("smollm2"), path, 7, "float32", "cpu", TINY)
    loaded = load_model(str(path), device="cpu")
    model = PagedLlama(loaded.hf_model, 4 * POOL_BLOCKS, BS, torch.device("cpu"), torch.float32)
    return TorchModelRunner(model), HFTokenizer(loaded.hf_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("setup", [Setup("fcfs", True), Setup("priority", True)], ids=["fcfs", "priority"])
def test_real_forward_answers_survive_preemption_prefix_hits_and_aborts(tiny, setup: Setup) -> None:
    runner, tokenizer = tiny
    engine = engine_over(runner, tokenizer, setup, POOL_BLOCKS, caching=True)
    stress = Stress(engine, 11, (100, 5000), PoolContent(runner.model.kv_cache))
    with torch.inference_mode():
        stress.run()

        def alone(prompt: list[int], max_tokens: int) -> list[int]:
            # The whole pool and no prefix cache: nothing of the stress run is reused.
            return run_alone(engine_over(runner, tokenizer, Setup(), None, caching=False), prompt, max_tokens)

        stress.check_end(alone)
    stress.check_coverage(setup)


# ---- targeted regressions (found by the stress above) ---------------------------------------------
def test_a_block_cached_for_a_step_its_sequence_was_preempted_from_is_not_served_unwritten() -> None:
    """Priority policy: "x" (priority 5) is scheduled first and its decode fills a block, which is
    cached at once (for same-step sharing); then "y" (priority 0), behind it in the same step,
    needs a block and preempts "x", so that step never writes the block. It must not stay in the
    prefix cache: "z", sharing x's first 12 tokens, would attend to a position never computed."""
    runner = ArithmeticRunner(BS, 9)
    engine = LLMEngine(runner, CharTokenizer(), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=36,
                       scheduling_policy="priority", clock=ManualClock(tick=0.001))
    content = SlotContent(runner)
    shared = list(range(3, 11))  # two full blocks
    engine.add_request("v", [*shared, 50, 51], greedy(20))  # holds the shared blocks in the cache throughout
    engine.step()
    # Asking for prompt logprobs, "x" computes the shared prompt afresh: its copies stay uncached,
    # so its freed blocks are not all at the eviction front and the filled one survives there.
    engine.add_request("x", shared, greedy(20, priority=5, prompt_logprobs=0))
    engine.step()
    engine.add_request("y", list(range(20, 26)), greedy(20))
    for _ in range(4):
        engine.step()
        for rid in ("v", "x", "y"):
            content.learn(engine.sequence(rid))
    x = engine.sequence("x")
    assert x is not None and x.num_preemptions == 1  # the schedule this test is about happened
    check_prefix_index(engine.block_manager, content)
    engine.add_request("z", [*x.token_ids[:12], 7], greedy(3))
    while engine.has_unfinished:
        engine.step()  # the runner raises if "z" reads a position never computed


def test_by_priority_a_request_that_preempts_itself_does_not_stall_the_better_ones_behind_it() -> None:
    """"batch" (priority 5) runs first and needs a block; the pool is full, so the worst-ranked
    request, itself, is preempted. "urgent" (priority 0), behind it and needing no block, must
    still get its token in that step (it got none: the step ran empty)."""
    engine = LLMEngine(ArithmeticRunner(BS, 4), CharTokenizer(), max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=16, scheduling_policy="priority", clock=ManualClock(tick=0.001))
    engine.add_request("batch", [3] * 7, greedy(8, priority=5))  # 2 blocks, the 2nd full after 1 decode
    engine.step()
    engine.add_request("urgent", [4] * 7, greedy(8))  # the other 2 blocks
    engine.step()
    outputs = engine.step()  # "batch" needs a 3rd block
    assert engine.sequence("batch").num_preemptions == 1
    assert [o.request_id for o in outputs] == ["urgent"]
