"""How long one engine step of a GPU inference engine takes: a roofline model.

A transformer forward over a step's batch does two things that bound its time:
- it reads memory: every weight once per step (decode is a matrix-vector product per
  sequence, so the weights are streamed once for the whole batch), plus the KV cache
  of every context token attended to;
- it computes: ~2 FLOPs per parameter per token that goes through the layers
  (prompt tokens of a prefill chunk and the one new token of each decode), plus
  attention, 4 * n_layers * hidden FLOPs for every (query token, key token) pair
  (QK^T and the weighted sum of V, 2 FLOPs per multiply-add each).
The GPU overlaps the two, so the forward takes the larger of them (the roofline):

    forward = max(bytes_read / (bandwidth * memory_efficiency),
                  flops / (peak_flops * compute_efficiency))
    step    = step_overhead + per_sequence_overhead * num_sequences + forward

bytes_read = weight_bytes + kv_bytes_per_token * context_tokens, where context tokens
are all tokens of the scheduled sequences up to the end of this step; flops =
flops_per_token * computed_tokens + attention_flops_per_pair * attention_pairs. A
sequence that computes n new tokens after c cached ones has n*c + n(n+1)/2 pairs (causal
attention); a decode (n=1) has c+1. The fixed overhead is the engine's CPU side
(scheduling, input preparation, sampling launch); the per-sequence term is sampling and
bookkeeping that grows with the batch.

What this gives, qualitatively as on real engines: a decode step costs about the same
for 1 or 64 sequences (memory bound: TPOT stays flat as concurrency grows) and then
grows with the KV cache read; a long prefill is compute bound and stalls the decodes
scheduled in the same step (chunked prefill trades TTFT for TPOT through
max_num_batched_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class LatencyParams(BaseModel):
    """The hardware/model numbers of the roofline, as written in a profile (SI units)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step_overhead_s: float = Field(ge=0, description="fixed CPU-side cost of one engine step")
    per_sequence_overhead_s: float = Field(0.0, ge=0, description="extra cost per scheduled sequence")
    weight_bytes: float = Field(gt=0, description="weight bytes streamed once per forward")
    kv_bytes_per_token: float = Field(gt=0, description="K+V bytes of one token, all layers")
    memory_bandwidth: float = Field(gt=0, description="peak memory bandwidth, bytes/s")
    memory_efficiency: float = Field(gt=0, le=1, description="achieved fraction of the peak bandwidth")
    flops_per_token: float = Field(gt=0, description="~2 * parameters (without the embedding table)")
    attention_flops_per_pair: float = Field(0.0, ge=0, description="4 * n_layers * hidden")
    peak_flops: float = Field(gt=0, description="peak dense FLOP/s at the serving dtype")
    compute_efficiency: float = Field(gt=0, le=1, description="achieved fraction of the peak FLOP/s")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step does, in the terms the latency model needs."""

    computed_tokens: int  # prompt tokens of prefill chunks + one per decoding sequence
    num_sequences: int
    context_tokens: int  # KV positions read: all tokens of all scheduled sequences after the step
    attention_pairs: int  # (query, key) pairs of causal attention in this step


class LatencyModel:
    """Step durations in simulated seconds (the runner multiplies by --time-scale)."""

    def __init__(self, params: LatencyParams) -> None:
        self.params = params
        p = params
        # Precomputed reciprocals: the runner calls step_time once per engine step.
        self._seconds_per_byte = 1.0 / (p.memory_bandwidth * p.memory_efficiency)
        self._seconds_per_flop = 1.0 / (p.peak_flops * p.compute_efficiency)

    def memory_time(self, shape: StepShape) -> float:
        p = self.params
        return (p.weight_bytes + p.kv_bytes_per_token * shape.context_tokens) * self._seconds_per_byte

    def compute_time(self, shape: StepShape) -> float:
        p = self.params
        flops = p.flops_per_token * shape.computed_tokens + p.attention_flops_per_pair * shape.attention_pairs
        return flops * self._seconds_per_flop

    def step_time(self, shape: StepShape) -> float:
        if shape.num_sequences == 0:
            return 0.0
        p = self.params
        forward = max(self.memory_time(shape), self.compute_time(shape))
        return p.step_overhead_s + p.per_sequence_overhead_s * shape.num_sequences + forward

    def step_time_raw(self, computed_tokens: int, num_sequences: int, context_tokens: int,
                      attention_pairs: int) -> float:
        """`step_time` without building a StepShape (the runner's hot path)."""
        if num_sequences == 0:
            return 0.0
        p = self.params
        memory = (p.weight_bytes + p.kv_bytes_per_token * context_tokens) * self._seconds_per_byte
        compute = (p.flops_per_token * computed_tokens
                   + p.attention_flops_per_pair * attention_pairs) * self._seconds_per_flop
        return p.step_overhead_s + p.per_sequence_overhead_s * num_sequences + max(memory, compute)

    # Convenience figures for docs, logs and tests.
    def decode_step_time(self, batch_size: int, context_per_seq: int) -> float:
        """One decode step of `batch_size` sequences each holding `context_per_seq` tokens."""
        ctx = batch_size * context_per_seq
        return self.step_time(StepShape(batch_size, batch_size, ctx, ctx))

    def prefill_time(self, prompt_tokens: int, max_num_batched_tokens: int) -> float:
        """A lone prompt prefilled in chunks of at most `max_num_batched_tokens`."""
        total, done = 0.0, 0
        while done < prompt_tokens:
            n = min(max_num_batched_tokens, prompt_tokens - done)
            pairs = n * done + n * (n + 1) // 2
            total += self.step_time(StepShape(n, 1, done + n, pairs))
            done += n
        return total
