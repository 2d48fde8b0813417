"""Log-probabilities, from the runner's (token ids and floats) to the API's (token texts).

The runner fills `SampleLogprobs` (the torch runner with sampler.logprobs_of: the model's
own log-softmax, before penalties, temperature and filters, as vLLM's default
"raw_logprobs"); the engine turns a step's into `TokenLogprobs` (`token_logprobs`) and keeps
a prompt's as its prefill chunks come (`collect_prompt_logprobs`). No torch here: the sim
worker runs without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from inference_worker.engine.sequence import Sequence as Seq
from inference_worker.engine.types import SampleLogprobs, ScheduledSequence, TokenLogprobs, WorkerTokenizer


def _decoder(tokenizer: WorkerTokenizer) -> Callable[[Sequence[int]], str]:
    """Token texts for logprobs keep special tokens ("<|im_end|>"), as vLLM shows them: an
    answer's text leaves them out, its logprobs name every token."""
    return partial(tokenizer.decode, skip_special_tokens=False)


def token_logprobs(
    tokenizer: WorkerTokenizer, token: int, sampled: SampleLogprobs | None
) -> list[TokenLogprobs] | None:
    """One step's logprobs of a sequence, with token texts (None when it did not ask)."""
    if sampled is None:
        return None
    decode = _decoder(tokenizer)
    top = tuple((decode([t]), lp) for t, lp in sampled.top)
    return [TokenLogprobs(decode([token]), sampled.logprob, top)]


def collect_prompt_logprobs(tokenizer: WorkerTokenizer, seq: Seq, scheduled: ScheduledSequence) -> None:
    """Keep the prompt logprobs of a prefill step for the tokens not seen yet (a recompute
    after a preemption computes them again)."""
    assert scheduled.prompt_logprobs is not None
    decode = _decoder(tokenizer)
    for i, sampled in enumerate(scheduled.prompt_logprobs):
        position = scheduled.num_computed_tokens + 1 + i  # the prompt token it is for
        if position != len(seq.prompt_logprobs) + 1:
            continue
        top = tuple((decode([t]), lp) for t, lp in sampled.top)
        token = seq.token_ids[position]
        top_ids = tuple(t for t, _ in sampled.top)
        seq.prompt_logprobs.append(
            TokenLogprobs(decode([token]), sampled.logprob, top, token, sampled.rank, top_ids)
        )
