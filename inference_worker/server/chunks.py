"""Response objects for completions and chat, built cheaply.

Streaming sends one chunk per engine step per request, so the per-token path must
be cheap: the constant part of every chunk (id, object, created, model) is
rendered once per request into a template, and each chunk only `json.dumps` its
text delta. The same chunk JSON goes into SSE `data:` lines and WebSocket messages.
"""

from __future__ import annotations

import json
import time
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


def usage_of(last: RequestOutput) -> dict[str, Any]:
    return usage_dict(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)


def finish_reason_json(reason: FinishReason | None) -> str:
    return "null" if reason is None else f'"{reason.value}"'


class _Chunks:
    """What both kinds share: the prebuilt chunk head, the per-token frame, the usage
    chunk and the final non-stream body."""

    chunk_object = ""  # "object" of each stream chunk
    body_object = ""  # "object" of the final non-stream body

    def __init__(self, request_id: str, model: str, continuous_usage: bool = False) -> None:
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
        choice_fields: str,
        finish_reason: FinishReason | None,
        out: RequestOutput | None,
        completion_tokens: int | None = None,
    ) -> str:
        """One chunk; with continuous usage, `out`'s usage so far (or `completion_tokens`).
        The logprobs of `out`'s tokens, where it has them, unless `completion_tokens` says
        the chunk precedes every token."""
        logprobs = "null"
        if out is not None and out.logprobs and completion_tokens is None:
            logprobs = _dumps(self.logprobs_json(out.logprobs))
        frame = (
            f'{self._head}[{{"index":0,{choice_fields},"logprobs":{logprobs},'
            f'"finish_reason":{finish_reason_json(finish_reason)}}}]'
        )
        if not (self.continuous_usage and out is not None):
            return frame + "}"
        done = out.num_output_tokens if completion_tokens is None else completion_tokens
        usage = usage_dict(out.num_prompt_tokens, done, out.num_cached_tokens)
        return f'{frame},"usage":{_dumps(usage)}}}'

    def usage(self, last: RequestOutput) -> str:
        return f'{self._head}[],"usage":{_dumps(usage_of(last))}}}'

    def logprobs_json(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        """The choice's `logprobs` object for these tokens (each kind has its own shape)."""
        raise NotImplementedError

    def _body(
        self, choice: dict[str, Any], last: RequestOutput, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        choice["logprobs"] = self.logprobs_json(logprobs) if logprobs else None
        choice["finish_reason"] = last.finish_reason.value if last.finish_reason else None
        choice["stop_reason"] = last.matched_stop
        return {
            "id": self.request_id,
            "object": self.body_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_of(last),
        }


class CompletionChunks(_Chunks):
    """`text_completion` objects (the stream chunks and the final non-stream body)."""

    chunk_object = body_object = "text_completion"

    def __init__(self, request_id: str, model: str, continuous_usage: bool = False) -> None:
        super().__init__(request_id, model, continuous_usage)
        self._text_offset = 0  # where the next token's text begins in the answer (logprobs)

    def first(self, out: RequestOutput | None = None) -> str | None:
        """A chunk to send before any token (none for completions)."""
        return None

    def delta(self, text: str, finish_reason: FinishReason | None, out: RequestOutput | None = None) -> str:
        return self._frame(f'"text":{_dumps(text)}', finish_reason, out)

    def full(
        self, text: str, last: RequestOutput, logprobs: list[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        return self._body({"index": 0, "text": text}, last, logprobs)

    def logprobs_json(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        """The legacy completions shape. Each position's top_logprobs also holds the sampled
        token (OpenAI: "up to logprobs+1 elements"); text_offset counts on from the previous
        chunk of this request."""
        offsets = []
        for t in logprobs:
            offsets.append(self._text_offset)
            self._text_offset += len(t.token)
        return {
            "text_offset": offsets,
            "token_logprobs": [_lp(t.logprob) for t in logprobs],
            "tokens": [t.token for t in logprobs],
            "top_logprobs": [
                {**{tok: _lp(lp) for tok, lp in t.top}, t.token: _lp(t.logprob)} for t in logprobs
            ],
        }


class ChatChunks(_Chunks):
    """`chat.completion.chunk` objects and the final `chat.completion` body."""

    chunk_object = "chat.completion.chunk"
    body_object = "chat.completion"

    def first(self, out: RequestOutput | None = None) -> str:
        """The role chunk that opens every chat stream (as OpenAI and vLLM send it); it
        precedes every token, so its usage counts none."""
        return self._frame('"delta":{"role":"assistant","content":""}', None, out, 0)

    def delta(self, text: str, finish_reason: FinishReason | None, out: RequestOutput | None = None) -> str:
        delta = f'{{"content":{_dumps(text)}}}' if text or finish_reason is None else "{}"
        return self._frame(f'"delta":{delta}', finish_reason, out)

    def full(
        self, text: str, last: RequestOutput, logprobs: list[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        return self._body({"index": 0, "message": {"role": "assistant", "content": text}}, last, logprobs)

    def logprobs_json(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **_chat_token(t.token, t.logprob),
                    "top_logprobs": [_chat_token(tok, lp) for tok, lp in t.top],
                }
                for t in logprobs
            ]
        }


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}
