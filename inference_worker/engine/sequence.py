"""One request's state inside the engine: tokens, KV block table, status and timing events."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inference_worker.engine.stats import EngineEvent, EngineEventType
from inference_worker.engine.types import FinishReason, SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt followed by generated tokens
    sampling: SamplingParams
    arrival_time: float  # engine clock, when the request was handed to the engine
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first schedule
    block_table: list[int] = field(default_factory=list)
    # Hash chain of this sequence's full blocks (index i = block i), computed once per block.
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    aborted: bool = False
    # Timing, on the engine clock (see stats.py for the interval definitions).
    events: list[EngineEvent] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_preemptions: int = 0
    ever_scheduled: bool = False
    # With sampling.prompt_logprobs: prompt tokens 1.. so far (a recompute does not redo them).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens (or, after a preemption, recomputed ones) remain.

        A decode step is exactly the last generated token; anything else is a prefill.
        """
        return self.num_computed_tokens < self.num_tokens - 1 or self.num_tokens == self.prompt_len

    def record(self, kind: EngineEventType, now: float) -> None:
        self.events.append(EngineEvent(kind, now))

    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]
