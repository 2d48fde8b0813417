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

from inference_worker.engine.types import FinishReason, RequestOutput

_dumps = json.dumps


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


class CompletionChunks:
    """`text_completion` objects (the stream chunks and the final non-stream body)."""

    object_name = "text_completion"

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._head = (
            f'{{"id":"{request_id}","object":"{self.object_name}","created":{self.created},'
            f'"model":{_dumps(model)},"choices":'
        )

    def first(self) -> str | None:
        """A chunk to send before any token (none for completions)."""
        return None

    def delta(self, text: str, finish_reason: FinishReason | None) -> str:
        return (
            f'{self._head}[{{"index":0,"text":{_dumps(text)},"logprobs":null,'
            f'"finish_reason":{finish_reason_json(finish_reason)}}}]}}'
        )

    def usage(self, last: RequestOutput) -> str:
        return f'{self._head}[],"usage":{_dumps(usage_of(last))}}}'

    def full(self, text: str, last: RequestOutput) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": last.finish_reason.value if last.finish_reason else None,
                    "stop_reason": last.matched_stop,
                }
            ],
            "usage": usage_of(last),
        }


class ChatChunks:
    """`chat.completion.chunk` objects and the final `chat.completion` body."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._head = (
            f'{{"id":"{request_id}","object":"chat.completion.chunk","created":{self.created},'
            f'"model":{_dumps(model)},"choices":'
        )

    def first(self) -> str:
        """The role chunk that opens every chat stream (as OpenAI and vLLM send it)."""
        return (
            f'{self._head}[{{"index":0,"delta":{{"role":"assistant","content":""}},'
            f'"logprobs":null,"finish_reason":null}}]}}'
        )

    def delta(self, text: str, finish_reason: FinishReason | None) -> str:
        delta = f'{{"content":{_dumps(text)}}}' if text or finish_reason is None else "{}"
        return (
            f'{self._head}[{{"index":0,"delta":{delta},"logprobs":null,'
            f'"finish_reason":{finish_reason_json(finish_reason)}}}]}}'
        )

    def usage(self, last: RequestOutput) -> str:
        return f'{self._head}[],"usage":{_dumps(usage_of(last))}}}'

    def full(self, text: str, last: RequestOutput) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": last.finish_reason.value if last.finish_reason else None,
                    "stop_reason": last.matched_stop,
                }
            ],
            "usage": usage_of(last),
        }
