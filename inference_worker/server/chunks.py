"""Response objects for completions and chat, built cheaply.

Streaming sends one chunk per engine step per request, so the per-token path must
be cheap: the constant part of every chunk (id, object, created, model) is
rendered once per request into a template, and each chunk only `json.dumps` its
text delta. The same chunk JSON goes into SSE `data:` lines and WebSocket messages.
A request with n > 1 has one choice per engine request; each chunk is about one
choice (its `index`), and the usage adds the choices' tokens up (`UsageTally`).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from inference_worker.engine.types import FinishReason, RequestOutput, TokenLogprobs

_dumps = json.dumps
# JSON has no -Infinity: a log-probability this low stands for "impossible" (as in vLLM).
_LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, _LOGPROB_FLOOR)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class UsageTally:
    """A request's usage so far: each prompt once, the answer tokens of every choice."""

    __slots__ = ("_cached", "_done", "n", "prompt_tokens")

    def __init__(self, prompt_tokens: int, num_choices: int = 1, n: int = 1) -> None:
        self.prompt_tokens = prompt_tokens
        self.n = n  # choices per prompt
        self._done = [0] * num_choices
        self._cached = [0] * (num_choices // n)

    def update(self, index: int, out: RequestOutput) -> None:
        self._done[index] = out.num_output_tokens
        if index % self.n == 0:  # a prompt's first choice: its cache hits, as with n = 1
            self._cached[index // self.n] = out.num_cached_tokens

    def as_dict(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, sum(self._done), sum(self._cached))


def finish_reason_json(reason: FinishReason | None) -> str:
    return "null" if reason is None else f'"{reason.value}"'


class _Chunks(ABC):
    """What both kinds share: the prebuilt chunk head, the per-token frame, the usage
    chunk and the final non-stream body."""

    chunk_object = ""  # "object" of each stream chunk
    body_object = ""  # "object" of the final non-stream body

    def __init__(self, request_id: str, model: str, continuous_usage: bool = False, n: int = 1) -> None:
        self.request_id = request_id
        self.model = model
        # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
        self.continuous_usage = continuous_usage
        self.created = int(time.time())
        self._head = (
            f'{{"id":"{request_id}","object":"{self.chunk_object}","created":{self.created},'
            f'"model":{_dumps(model)},"choices":'
        )

    def _frame(
        self,
        index: int,
        choice_fields: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None,
        tally: UsageTally | None,
    ) -> str:
        """One chunk about choice `index`; with continuous usage, the tally's usage so far."""
        logprobs_json = _dumps(self.logprobs_json(logprobs, index)) if logprobs else "null"
        frame = (
            f'{self._head}[{{"index":{index},{choice_fields},"logprobs":{logprobs_json},'
            f'"finish_reason":{finish_reason_json(finish_reason)}}}]'
        )
        if not (self.continuous_usage and tally is not None):
            return frame + "}"
        return f'{frame},"usage":{_dumps(tally.as_dict())}}}'

    def delta(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
        tally: UsageTally | None = None,
    ) -> str:
        """A chunk of choice `index`'s answer: its new text, logprobs and finish reason."""
        return self._frame(index, self._text_fields(text, finish_reason), finish_reason, logprobs, tally)

    @abstractmethod
    def _text_fields(self, text: str, finish_reason: FinishReason | None) -> str:
        """The choice's JSON fields that carry new text (each kind has its own)."""

    def usage(self, tally: UsageTally) -> str:
        return f'{self._head}[],"usage":{_dumps(tally.as_dict())}}}'

    @abstractmethod
    def logprobs_json(self, logprobs: list[TokenLogprobs], index: int = 0) -> dict[str, Any]:
        """Choice `index`'s `logprobs` object for these tokens (each kind has its own shape)."""

    @abstractmethod
    def _choice(self, index: int, text: str) -> dict[str, Any]:
        """Choice `index` of the non-stream body, with its whole text."""

    @abstractmethod
    def add_prompt_logprobs(self, body: dict[str, Any], per_choice: list[list[TokenLogprobs]]) -> None:
        """Put vLLM's `prompt_logprobs` into a non-stream body (where vLLM puts them)."""

    def full(
        self,
        texts: Sequence[str],
        lasts: Sequence[RequestOutput],
        tally: UsageTally,
        logprobs: Sequence[list[TokenLogprobs]] | None = None,
    ) -> dict[str, Any]:
        """The non-stream body: one choice per text, each ended by its last output."""
        choices = []
        for index, (text, last) in enumerate(zip(texts, lasts, strict=True)):
            tally.update(index, last)
            choice = self._choice(index, text)
            lps = logprobs[index] if logprobs else None
            choice["logprobs"] = self.logprobs_json(lps, index) if lps else None
            choice["finish_reason"] = last.finish_reason.value if last.finish_reason else None
            choice["stop_reason"] = last.matched_stop
            choices.append(choice)
        return {
            "id": self.request_id,
            "object": self.body_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": tally.as_dict(),
        }


class CompletionChunks(_Chunks):
    """`text_completion` objects (the stream chunks and the final non-stream body)."""

    chunk_object = body_object = "text_completion"

    def __init__(self, request_id: str, model: str, continuous_usage: bool = False, n: int = 1) -> None:
        super().__init__(request_id, model, continuous_usage, n)
        # Per choice: where the next token's text begins in its answer (logprobs' text_offset).
        self._text_offset = [0] * n

    def first(self, index: int = 0, tally: UsageTally | None = None) -> str | None:
        """A chunk to send before any token (none for completions)."""
        return None

    def _text_fields(self, text: str, finish_reason: FinishReason | None) -> str:
        return f'"text":{_dumps(text)}'

    def _choice(self, index: int, text: str) -> dict[str, Any]:
        return {"index": index, "text": text}

    def add_prompt_logprobs(self, body: dict[str, Any], per_choice: list[list[TokenLogprobs]]) -> None:
        for choice, entries in zip(body["choices"], per_choice, strict=True):  # each its prompt's
            choice["prompt_logprobs"] = vllm_prompt_logprobs(entries)

    def logprobs_json(self, logprobs: list[TokenLogprobs], index: int = 0) -> dict[str, Any]:
        """The legacy completions shape. Each position's top_logprobs also holds the sampled
        token (OpenAI: "up to logprobs+1 elements"); text_offset counts on from the previous
        chunk of this choice."""
        offsets = []
        for t in logprobs:
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(t.token)
        return {
            "text_offset": offsets,
            "token_logprobs": [None if t.logprob is None else _lp(t.logprob) for t in logprobs],
            "tokens": [t.token for t in logprobs],
            "top_logprobs": [_top(t) for t in logprobs],
        }


class ChatChunks(_Chunks):
    """`chat.completion.chunk` objects and the final `chat.completion` body."""

    chunk_object = "chat.completion.chunk"
    body_object = "chat.completion"

    def first(self, index: int = 0, tally: UsageTally | None = None) -> str:
        """The role chunk that opens each choice of a chat stream (as OpenAI and vLLM send it);
        it precedes every token (the tally's usage then counts none)."""
        return self._frame(index, '"delta":{"role":"assistant","content":""}', None, None, tally)

    def _text_fields(self, text: str, finish_reason: FinishReason | None) -> str:
        # The last chunk of a choice that has no more text carries an empty delta.
        delta = f'{{"content":{_dumps(text)}}}' if text or finish_reason is None else "{}"
        return f'"delta":{delta}'

    def _choice(self, index: int, text: str) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}}

    def add_prompt_logprobs(self, body: dict[str, Any], per_choice: list[list[TokenLogprobs]]) -> None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(per_choice[0])  # one prompt: at the top

    def logprobs_json(self, logprobs: list[TokenLogprobs], index: int = 0) -> dict[str, Any]:
        return {
            "content": [
                {
                    **_chat_token(t.token, t.logprob),
                    "top_logprobs": [_chat_token(tok, lp) for tok, lp in t.top],
                }
                for t in logprobs
            ]
        }


def _top(t: TokenLogprobs) -> dict[str, float] | None:
    """A position's likeliest tokens and the chosen one (None for an echoed prompt's first)."""
    if t.logprob is None:
        return None
    return {t.token: _lp(t.logprob), **{tok: _lp(lp) for tok, lp in t.top}}


def vllm_prompt_logprobs(entries: list[TokenLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from
    token id to its logprob, rank and text, for the token itself and its alternatives."""
    shaped: list[dict[str, Any] | None] = [None]
    for t in entries:
        assert t.logprob is not None
        position = {str(t.token_id): {"logprob": _lp(t.logprob), "rank": t.rank, "decoded_token": t.token}}
        for rank, (token_id, (text, lp)) in enumerate(zip(t.top_ids, t.top, strict=True), start=1):
            position.setdefault(str(token_id), {"logprob": _lp(lp), "rank": rank, "decoded_token": text})
        shaped.append(position)
    return shaped


def _chat_token(token: str, logprob: float | None) -> dict[str, Any]:
    assert logprob is not None, "chat has no echo"
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}
