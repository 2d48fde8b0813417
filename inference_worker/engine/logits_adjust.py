"""Per-request changes to a row of logits before sampling: logit bias, min_tokens, penalties.

vLLM's order: the logit bias and the min_tokens mask first, then the repetition, frequency
and presence penalties, then (in the sampler) temperature and the filters. Greedy requests
get them too: a penalty changes which token is likeliest.
- repetition_penalty (vLLM, HF): every token already in the prompt or the answer has a
  positive logit divided by it, a negative one multiplied.
- frequency_penalty / presence_penalty (OpenAI): subtracted once per occurrence / once for
  any occurrence of a token in the answer so far (not the prompt).
- min_tokens: EOS and the request's stop token ids (`ends_answer_ids`, filled by the
  engine) cannot come out before the answer has that many tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_worker.engine.types import SamplingParams


def needs_adjusting(params: SamplingParams, num_output_tokens: int) -> bool:
    return bool(
        params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or num_output_tokens < params.min_tokens
    )


def adjust_row(
    row: torch.Tensor,
    params: SamplingParams,
    token_ids: Sequence[int],
    num_output_tokens: int,
) -> torch.Tensor:
    """row: one sequence's float32 logits [vocab] (a copy: changed in place and returned), on
    the model's device: the index tensors made here go there too (CPU ones fail on a GPU).
    token_ids: the sequence so far, prompt then answer."""
    vocab = row.shape[-1]
    bias = [(t, b) for t, b in params.logit_bias if t < vocab]  # the server checked the ids
    if bias:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor([b for _, b in bias], dtype=row.dtype, device=row.device))
    if num_output_tokens < params.min_tokens:
        banned = [t for t in params.ends_answer_ids if 0 <= t < vocab]
        if banned:
            row[banned] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=row.device)
        seen = seen[seen < vocab]
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.presence_penalty or params.frequency_penalty) and num_output_tokens:
        answer = torch.tensor(
            token_ids[len(token_ids) - num_output_tokens :], dtype=torch.long, device=row.device
        )
        ids, counts = torch.unique(answer[answer < vocab], return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
    return row
