"""Helpers for the engine tests: a scripted clock, a recording stat logger, a fake runner.

`ArithmeticRunner` stands in for the model only in the pure scheduler/block-manager
tests: its next token is a pure function of the sequence's tokens (so recompute after a
preemption must reproduce it), and it checks that every K/V slot a step reads was
written by an earlier step or the same one, which catches block-table bugs.
"""

from __future__ import annotations

from inference_worker.engine.stats import IterationStats, SchedulerStats
from inference_worker.engine.types import StepBatch


class ManualClock:
    def __init__(self, start: float = 100.0, tick: float = 0.0) -> None:
        self.now = start
        self.tick = tick  # added on every read, so each event gets its own timestamp

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingLogger:
    def __init__(self) -> None:
        self.records: list[tuple[SchedulerStats, IterationStats | None]] = []
        self.logs = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None) -> None:
        self.records.append((scheduler_stats, iteration_stats))

    def log(self) -> None:
        self.logs += 1

    @property
    def iterations(self) -> list[IterationStats]:
        return [it for _, it in self.records if it is not None]

    @property
    def finished(self):
        return [f for it in self.iterations for f in it.finished_requests]


class ArithmeticRunner:
    """Deterministic fake model: next token = f(all tokens so far); tracks slot contents."""

    def __init__(self, block_size: int, num_kv_blocks: int, vocab: int = 50) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.vocab = vocab
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token) written there
        self.computed_tokens = 0
        self.steps = 0
        self.batch_sizes: list[int] = []
        self.new_tokens: list[list[int]] = []  # per step: tokens computed for each sequence

    def _slot(self, table, pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, batch: StepBatch) -> list[int | None]:
        self.steps += 1
        self.batch_sizes.append(len(batch.sequences))
        self.new_tokens.append([s.num_new_tokens for s in batch.sequences])
        for s in batch.sequences:  # write first (the real forward writes the whole batch per layer)
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.slots[self._slot(s.block_table, pos)] = (pos, s.token_ids[pos])
            self.computed_tokens += s.num_new_tokens
        out: list[int | None] = []
        for s in batch.sequences:
            end = s.num_computed_tokens + s.num_new_tokens
            for pos in range(end):  # "attend": every context slot must hold this sequence's token
                if self.slots.get(self._slot(s.block_table, pos)) != (pos, s.token_ids[pos]):
                    raise AssertionError(f"seq {s.seq_id}: KV slot for position {pos} holds stale data")
            if s.needs_sample:
                out.append(3 + (sum(s.token_ids[:end]) * 31 + end) % (self.vocab - 3))
            else:
                out.append(None)
        return out


class CharTokenizer:
    """Token id t <-> character chr(t + 60); ids 0..2 are special (2 = eos)."""

    eos_token_ids = frozenset({2})

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 60 for c in text]

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t + 60) for t in token_ids if t > 2)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))
