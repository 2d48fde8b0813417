"""Types shared by the engine, its model runners and the API server.

This is the contract between the parts of the worker:
- the server builds a `SamplingParams` and calls `AsyncEngine.generate(...)`;
- the engine yields `RequestOutput`s (text already detokenized, stop strings applied);
- a `ModelRunner` (the real transformer, or the sim latency model) executes one
  `StepBatch` per engine step and returns one sampled token per sequence that needs one.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inference_worker.engine.errors import EngineShutdownError

# vLLM's _SAMPLING_EPS: a temperature below it samples greedily. Dividing logits by a tinier
# one (the API takes any value >= 0, e.g. 1e-40) overflows them to inf and the softmax to NaN,
# which torch.multinomial refuses: the engine step, and with it the engine loop, would fail.
GREEDY_BELOW_TEMPERATURE = 1e-5


class FinishReason(enum.StrEnum):
    """Values of vLLM's `finished_reason` label and of OpenAI's `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False, slots=True)
class ParallelSampling:
    """The n choices of one request with n > 1, each an engine request of its own (vLLM's
    ParentRequest): the per-request histograms of n and of the longest answer count the
    request once, when its last choice ends. Touched only on the engine thread."""

    n: int
    unfinished: int
    max_generation_tokens: int = 0

    def finish(self, num_generation_tokens: int) -> bool:
        """One choice ended with this many tokens; True when it was the last."""
        self.unfinished -= 1
        self.max_generation_tokens = max(self.max_generation_tokens, num_generation_tokens)
        return self.unfinished == 0

    def drop(self) -> None:
        """One choice was aborted: it holds the request open no longer, and its length is not
        observed (vLLM's ParentRequest). If it was the last, the request's n goes unrecorded."""
        self.unfinished -= 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    # 0: off. Else tokens less likely than min_p x the likeliest one's probability are dropped.
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Keep a matched stop string at the end of the text (vLLM's option); cut it by default.
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Penalties and bias (see engine/logits_adjust.py); logit_bias as (token id, bias) pairs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # The tokens that would end the answer (stop_token_ids, and EOS unless ignore_eos): kept
    # out before min_tokens. Filled by the engine, which knows the tokenizer's EOS.
    ends_answer_ids: tuple[int, ...] = ()
    # None: no logprobs. N >= 0: the sampled token's log-probability and the N likeliest.
    logprobs: int | None = None
    # The same for every prompt token after the first (echo with logprobs). Such a request
    # computes its whole prompt: its prefix-cache hits are not used.
    prompt_logprobs: int | None = None
    n: int = 1
    # With n > 1: the choices' shared record (each choice is an engine request of its own).
    parallel: ParallelSampling | None = None
    # The request's own max_tokens (None when the client left it unset), for
    # vllm:request_params_max_tokens; unset, the engine reports max_tokens there instead (the
    # value vLLM's server puts in its SamplingParams), and a 0 is not observed (as in vLLM).
    max_tokens_param: int | None = None
    # Not sampling: the request's scheduling priority (vLLM's field; lower goes first under
    # --scheduling-policy priority), carried with its other per-request settings.
    priority: int = 0
    # vLLM's prefix-cache salt: a request's cached blocks are shared only with requests of the
    # same salt (a tenant's prompts cannot be probed by another's timing). None: unsalted.
    cache_salt: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


@dataclass(frozen=True, slots=True)
class SampleLogprobs:
    """A runner's log-probabilities at one position: the sampled token's, and the request's
    `logprobs` likeliest tokens as (token id, log-probability), likeliest first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    # The token's 1-based rank in the vocabulary, where the runner computed it (prompt
    # positions, for vLLM's prompt_logprobs); 0: not computed.
    rank: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One token's log-probabilities as the API shows them: token texts (and, for vLLM's
    prompt_logprobs, the ids and the token's rank)."""

    token: str
    logprob: float | None  # None only for an echoed prompt's first token: nothing predicts it
    top: tuple[tuple[str, float], ...] = ()
    token_id: int = -1
    rank: int = 0
    top_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """One streamed update for a request.

    `text` and `token_ids` are the *delta* since the previous output of this
    request. The last output has `finished=True` and a `finish_reason`.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, for usage
    num_cached_tokens: int = 0
    matched_stop: str | int | None = None
    # One entry per token of `token_ids` when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # On the request's first output, when it asked: prompt tokens 1.. (the first has none).
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of an engine step, as a model runner sees it.

    `token_ids` are all tokens of the sequence known so far (prompt + output).
    The step computes positions [num_computed_tokens, num_computed_tokens + num_new_tokens).
    `block_table` maps logical KV blocks to physical block ids in the KV pool.
    `needs_sample` is false for a non-final prefill chunk.
    """

    seq_id: int
    token_ids: Sequence[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_table: Sequence[int]
    sampling: SamplingParams
    needs_sample: bool
    # True while the step still computes prompt tokens (a prefill or a prefill chunk).
    is_prefill: bool = False
    # Tokens generated so far (for seeded sampling streams to stay reproducible).
    num_output_tokens: int = 0
    # Filled by the runner when the request asks for logprobs (sampling.logprobs is set).
    sampled_logprobs: SampleLogprobs | None = None
    # Filled by the runner for a prefill step when sampling.prompt_logprobs is set: entry i
    # is for token num_computed_tokens + 1 + i (the prompt tokens this step's rows predict).
    prompt_logprobs: list[SampleLogprobs] | None = None


@dataclass(slots=True)
class StepBatch:
    sequences: list[ScheduledSequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences if s.is_prefill)

    @property
    def num_decode_sequences(self) -> int:
        return sum(1 for s in self.sequences if not s.is_prefill)

    @property
    def num_context_tokens(self) -> int:
        return sum(s.num_computed_tokens + s.num_new_tokens for s in self.sequences)


class ModelRunner(Protocol):
    """Runs one batched forward (or its simulation) over a step's sequences."""

    block_size: int
    num_kv_blocks: int

    def execute(self, batch: StepBatch) -> list[int | None]:
        """Return one sampled token id per sequence (None where needs_sample is false)."""
        ...


class WorkerTokenizer(Protocol):
    """What the server and the engine need of a tokenizer (HF, or the sim's fake one)."""

    eos_token_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]: ...


class AsyncEngineClient(Protocol):
    """What the API server uses of the engine (implemented in engine/async_engine.py).

    The engine's step loop runs off the event loop (a thread); `generate` streams
    outputs as the steps produce them. Closing the `generate` iterator early (client
    disconnect, stop string seen by the server) aborts the request in the engine and
    frees its KV blocks at the next step. Like vLLM v1, it is not counted as finished (no
    request_success_total{finished_reason="abort"}, no per-request histograms).
    All engine timestamps come from the engine's own clock (for the sim backend:
    monotonic seconds divided by --time-scale, so metrics report simulated seconds).
    """

    model_name: str
    max_model_len: int
    tokenizer: WorkerTokenizer

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def fail_all(self, exc: EngineShutdownError) -> int: ...

    @property
    def is_healthy(self) -> bool: ...
