"""Turn the logits of one step into one token per sequence.

Rows whose request sets penalties, a logit bias or min_tokens are adjusted first
(logits_adjust.py). Greedy rows (temperature 0, or below 1e-5 as in vLLM, or top_k 1) are
then an argmax, over the whole batch at once where nothing was adjusted. Random rows apply
temperature, then min-p, top-k and top-p (vLLM's order), then draw. A seeded request draws
from a generator seeded with (seed, number of tokens generated so far), so its stream is
reproducible whatever it was batched with and even after a preemption (the runner does
not need to keep generator state across steps). Logprobs are the model's own
(`logprobs_of`), computed only for the rows that ask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from inference_worker.engine.logits_adjust import adjust_row, needs_adjusting
from inference_worker.engine.types import SampleLogprobs, SamplingParams

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


def _bounded(row: torch.Tensor) -> torch.Tensor:
    """An adjusted or temperature-scaled row with +inf at float32's largest value and NaN at -inf.

    A tiny repetition_penalty (the API takes any value > 0, e.g. 1e-39) divides positive logits
    past float32's range, an infinite one makes 0 x inf; the softmax of such a row is NaN, which
    torch.multinomial refuses: the step, and with it the engine loop, would fail."""
    return torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    token_ids: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """logits: [n, vocab] (any float dtype); one SamplingParams and output count per row.
    token_ids: each row's sequence so far (prompt then answer), needed only by the rows whose
    penalties or min_tokens apply (logits_adjust.py)."""
    n = logits.shape[0]
    if n == 0:
        return []
    adjusted = [
        i for i, p in enumerate(params) if needs_adjusting(p, num_output_tokens[i])
    ]
    # A temperature too small to scale logits (non-positive included) is greedy (SamplingParams.greedy).
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy_rows) == n and not adjusted:
        return logits.argmax(dim=-1).tolist()
    rows: dict[int, torch.Tensor] = {}
    for i in adjusted:
        assert token_ids is not None, "penalties need the rows' token ids"
        rows[i] = adjust_row(logits[i].float().clone(), params[i], token_ids[i], num_output_tokens[i])
    out: list[int] = [0] * n
    plain_greedy = [i for i in greedy_rows if i not in rows]
    if plain_greedy:
        picked = logits[plain_greedy].argmax(dim=-1).tolist()
        for row, tok in zip(plain_greedy, picked, strict=True):
            out[row] = tok
    greedy_set = set(greedy_rows)
    for i, p in enumerate(params):
        if i in greedy_set:
            if i in rows:
                out[i] = int(_bounded(rows[i]).argmax())
            continue
        row = rows[i] if i in rows else logits[i].float()
        row = row / p.temperature
        if i in rows:
            row = _bounded(row)
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


def logprobs_of(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[SampleLogprobs | None]:
    """The model's own log-probabilities (before penalties, temperature and filters, as
    vLLM's default "raw_logprobs") of each row's sampled token and its `logprobs` likeliest,
    for the rows that ask."""
    out: list[SampleLogprobs | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.logprobs is not None:
            (out[i],) = rows_logprobs(logits[i : i + 1], torch.tensor([tokens[i]]), p.logprobs)
    return out


def rows_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> list[SampleLogprobs]:
    """logits [R, vocab], targets [R]: each row's log-probability of its target token, that
    token's rank in the vocabulary, and the row's top_n likeliest tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, targets.to(logp.device)[:, None])
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(ranks)
    if top_n:
        values, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    found = zip(chosen[:, 0].tolist(), tops, ranks, strict=True)
    return [SampleLogprobs(lp, top, rank) for lp, top, rank in found]
