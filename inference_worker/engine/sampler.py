"""Turn the logits of one step into one token per sequence.

Greedy rows (temperature 0 or top_k 1) are an argmax over the whole batch at once.
Random rows apply temperature, then min-p, top-k and top-p (vLLM's order), then draw. A seeded request draws
from a generator seeded with (seed, number of tokens generated so far), so its stream
is reproducible whatever it was batched with and even after a preemption (the runner
does not need to keep generator state across steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from inference_worker.engine.types import SamplingParams

_SEED_STRIDE = 1_000_003  # mixes the step index into the seed


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the likeliest token's (1-D): in log space,
    logit < max logit + log(min_p). The likeliest token always survives."""
    return logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Return logits with everything outside top-k / the top-p nucleus set to -inf (1-D)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False  # the most likely token always survives, even for top_p <= 0
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
) -> list[int]:
    """logits: [n, vocab] (any float dtype); one SamplingParams and output count per row."""
    n = logits.shape[0]
    if n == 0:
        return []
    # A non-positive temperature cannot scale logits: treat it as greedy rather than fail the step.
    greedy_rows = [i for i, p in enumerate(params) if p.greedy or p.temperature <= 0]
    if len(greedy_rows) == n:
        return logits.argmax(dim=-1).tolist()
    out: list[int] = [0] * n
    if greedy_rows:
        picked = logits[greedy_rows].argmax(dim=-1).tolist()
        for row, tok in zip(greedy_rows, picked, strict=True):
            out[row] = tok
    greedy_set = set(greedy_rows)
    for i, p in enumerate(params):
        if i in greedy_set:
            continue
        row = logits[i].float() / p.temperature
        if p.min_p > 0.0:
            row = _filter_min_p(row, p.min_p)
        row = _filter_top_k_top_p(row, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed((p.seed * _SEED_STRIDE + num_output_tokens[i]) & 0x7FFF_FFFF_FFFF_FFFF)
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
