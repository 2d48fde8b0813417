"""SimModelRunner: a ModelRunner whose forward is a sleep of the modelled step time.

The engine (scheduler, block manager, metrics) is the real one; this replaces only the
batched forward. `execute` sums what the step computes, asks the latency model how long
a GPU would take, sleeps that long times --time-scale, and returns one token per
sequence that needs a sample.

Timing. Steps are laid on a virtual GPU timeline: a step ends at
`max(previous step's end, call time - credit) + duration`. The engine's own Python time
between two steps (processing outputs, scheduling) therefore does not add to the
simulated time: it stands in for the modelled per-step overhead, up to `credit` (the
profile's step_overhead_s x time scale), and sleep overshoot is absorbed the same way.
After an idle period the next step is credited the full overhead (the engine spent at
least that long scheduling it). When the engine is slower than the model (Python work
per step above the credit, or the process's other threads holding the GIL: HTTP, metrics
scrapes), the simulated timeline stretches; `stats.gap_s` counts that excess between steps
of a busy engine (the engine says when it goes idle, and idle time is not counted), and
`stats.late_s` the steps that ended after their modelled end. The worker publishes both
(sim/metrics.py), so a benchmark can tell how far its CPU contention slowed the "GPU".

Tokens. The next token is a hash of the last two tokens, the position and a digest of the
prompt, mapped onto the sim tokenizer's word list: it depends only on the sequence's content,
so a sequence's output is the same alone, batched, after a prefix-cache hit or after a
preemption (recompute). The prompt's digest is there because the last two tokens and the
position alone are shared by many prompts (every chat prompt ends with its template's
`[/INST]`): without it, all prompts of one length got one answer and one length, where on
vLLM each prompt's answer is its own. The choices of an n > 1 request differ when sampled, as
vLLM draws each on its own: a seeded one by its seed (the server gives choice i seed + i, as
vLLM does), an unseeded one by its sequence id; greedy choices are one answer, as on vLLM.
Sampling parameters other than `seed`, `ignore_eos`, `min_tokens` and greedy-or-not (for
n > 1) are not modelled. When the profile sets mean_output_tokens and the request does not
ignore EOS, EOS comes out with probability 1/mean_output_tokens at each position (a geometric
length, drawn afresh for every prompt). Logprobs report that modelled distribution: the word,
and EOS where it may come out (prompt logprobs: a prompt token is certain if it is the word
the last two tokens and the position lead to, else impossible; a position of the prompt
cannot see the whole prompt, so no digest there, and no seed either: a model's prompt logprobs
come from its forward pass over the prompt, which no sampling seed changes).
"""

from __future__ import annotations

import math
import time
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from inference_worker.engine.types import SampleLogprobs, ScheduledSequence, StepBatch
from inference_worker.sim.latency_model import LatencyModel
from inference_worker.sim.tokenizer import EOS_ID

_MASK = 0xFFFFFFFF
# Prompt digests kept (one per sequence); past this many they are all dropped and worked out
# again as sequences come back: a digest is a function of the prompt alone, so only time is lost.
_MAX_DIGESTS = 8192


@dataclass(slots=True)
class RunnerStats:
    """Cumulative timing of the runner, in wall seconds (already x time scale)."""

    steps: int = 0
    modelled_s: float = 0.0  # sum of modelled step durations x time scale
    slept_s: float = 0.0  # time actually spent sleeping
    late_s: float = 0.0  # how far steps ended after their modelled end (runner itself too slow)
    late_steps: int = 0
    # Time between the previous step's modelled end and this call, beyond the credit, while
    # the engine was busy: its Python time (or GIL waits) in excess of the modelled overhead.
    gap_s: float = 0.0


class SimModelRunner:
    """Implements engine.types.ModelRunner with a latency model instead of a model."""

    def __init__(
        self,
        latency: LatencyModel,
        generation_token_ids: tuple[int, ...],
        block_size: int,
        num_kv_blocks: int,
        time_scale: float = 1.0,
        mean_output_tokens: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not generation_token_ids:
            raise ValueError("generation_token_ids must not be empty")
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.time_scale = time_scale
        self.latency = latency
        self.stats = RunnerStats()
        self._words = generation_token_ids
        self._num_words = len(generation_token_ids)
        # EOS when the position hash falls under this threshold (probability 1/mean).
        self._eos_threshold = int((_MASK + 1) / mean_output_tokens) if mean_output_tokens else 0
        self._credit = latency.params.step_overhead_s * time_scale
        self._sleep = sleep
        self._clock = clock
        self._end = float("-inf")  # modelled end of the previous step, on `clock`
        self._digests: dict[int, int] = {}  # seq_id -> prompt digest

    def execute(self, batch: StepBatch) -> list[int | None]:
        if not batch.sequences:
            return []  # nothing ran on the "GPU": no time, and the timeline is not moved
        start_call = self._clock()
        computed = context = pairs = 0
        out: list[int | None] = []
        for seq in batch.sequences:
            n = seq.num_new_tokens
            c = seq.num_computed_tokens
            computed += n
            context += c + n
            pairs += n * c + n * (n + 1) // 2
            out.append(self._sample(seq, c + n) if seq.needs_sample else None)
            if seq.sampling.prompt_logprobs is not None and seq.is_prefill:
                seq.prompt_logprobs = self._prompt_logprobs(seq)
        seconds = self.latency.step_time_raw(computed, len(batch.sequences), context, pairs)
        duration = seconds * self.time_scale
        stats = self.stats
        start = start_call - self._credit
        if start > self._end:
            if self._end > float("-inf"):
                stats.gap_s += start - self._end
        else:
            start = self._end
        end = start + duration
        self._end = end
        stats.steps += 1
        stats.modelled_s += duration
        remaining = end - self._clock()
        if remaining > 0:
            self._sleep(remaining)
            stats.slept_s += remaining
        else:
            stats.late_s -= remaining
            stats.late_steps += 1
        return out

    def _sample(self, seq: ScheduledSequence, position: int) -> int:
        """The token for `position` (the index the new token will have), and its logprobs."""
        sampling = seq.sampling
        may_end = not sampling.ignore_eos and seq.num_output_tokens >= sampling.min_tokens
        word, ends = self._next_token(seq.token_ids, position, self._salt(seq))
        token = EOS_ID if ends and may_end else word
        if sampling.logprobs is not None:
            seq.sampled_logprobs = self._logprobs(token, word, may_end, sampling.logprobs)
        return token

    def _salt(self, seq: ScheduledSequence) -> int:
        """What, beside the last two tokens and the position, picks this sequence's next tokens:
        its prompt, and which of a request's sampled choices it is."""
        sampling = seq.sampling
        if sampling.seed is not None:
            choice = sampling.seed
        elif sampling.parallel is not None and not sampling.greedy:
            choice = seq.seq_id  # n > 1, unseeded, sampled: vLLM's choices are independent draws
        else:
            choice = 0
        return (choice * 0x27D4EB2F + self._prompt_digest(seq)) & _MASK

    def _prompt_digest(self, seq: ScheduledSequence) -> int:
        """crc32 of the prompt's ids, worked out once per sequence (a prompt can be long, and a
        decode step must stay cheap). The prompt is what precedes the outputs, also when a
        preempted sequence is computed again. Kept by seq_id: the engine never gives one seq_id to
        two sequences, and a sequence's prompt never changes."""
        digest = self._digests.get(seq.seq_id)
        if digest is None:
            if len(self._digests) >= _MAX_DIGESTS:
                self._digests.clear()
            prompt_len = len(seq.token_ids) - seq.num_output_tokens
            digest = zlib.crc32(array("q", seq.token_ids[:prompt_len]))
            self._digests[seq.seq_id] = digest
        return digest

    def _prompt_logprobs(self, seq: ScheduledSequence) -> list[SampleLogprobs]:
        """The modelled odds of the prompt tokens this step's positions predict: certain where
        the prompt goes on as the sim would, impossible elsewhere (the model is a hash). A
        function of the prompt alone, as a forward pass is: the request's seed picks samples,
        not these odds, so every request with this prompt gets the same ones."""
        prompt_len = len(seq.token_ids) - seq.num_output_tokens
        start = seq.num_computed_tokens
        top_n = seq.sampling.prompt_logprobs or 0
        found = []
        for position in range(start + 1, min(start + seq.num_new_tokens, prompt_len - 1) + 1):
            word, _ = self._next_token(seq.token_ids, position, 0)
            certain = seq.token_ids[position] == word
            found.append(SampleLogprobs(0.0 if certain else float("-inf"), ((word, 0.0),)[:top_n],
                                        1 if certain else 2))
        return found

    def _next_token(self, token_ids, position: int, seed: int) -> tuple[int, bool]:
        """The word this content leads to at `position`, and whether EOS comes out instead."""
        last = token_ids[position - 1] if position >= 1 else 0
        before = token_ids[position - 2] if position >= 2 else 0
        h = (last * 0x9E3779B1 + before * 0x85EBCA6B + position * 0xC2B2AE35 + seed) & _MASK
        h ^= h >> 16
        h = (h * 0x7FEB352D) & _MASK
        h ^= h >> 15
        return self._words[h % self._num_words], h < self._eos_threshold

    def _logprobs(self, token: int, word: int, may_end: bool, top_n: int) -> SampleLogprobs:
        """The modelled distribution, honestly: the content's word, or EOS with probability
        1/mean_output_tokens where the profile sets it and the request may end here."""
        p_eos = self._eos_threshold / (_MASK + 1) if may_end else 0.0
        choices = [(word, math.log1p(-p_eos))] + ([(EOS_ID, math.log(p_eos))] if p_eos > 0 else [])
        choices.sort(key=lambda c: -c[1])
        return SampleLogprobs(dict(choices)[token], tuple(choices[:top_n]))

    def idle(self) -> None:
        """The engine has nothing to run: the wait until its next step is not a stretch."""
        self._end = float("-inf")

    @property
    def lag_fraction(self) -> float:
        """Late time as a fraction of modelled time (0 when the engine keeps up)."""
        return self.stats.late_s / self.stats.modelled_s if self.stats.modelled_s else 0.0
