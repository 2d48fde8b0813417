"""A whole chat or completions answer sent as the event stream its client asked for.

Some engines answer `stream: true` with a plain JSON 200 (they ignore the flag, or take another
path for some requests). A streaming client reads only `data:` events: an OpenAI SDK iterating
such a body sees no chunk at all and its user an empty answer. The answer is re-sent here as one
chunk per answer (OpenAI's streaming shape: `chat.completion.chunk` with `delta`s, or
`text_completion` chunks), the usage chunk if the client asked for usage, then `[DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
_DONE = b"data: [DONE]\n\n"


def sse_of_whole(path: str, data: bytes, include_usage: bool) -> bytes | None:
    """The events of the whole answer `data` to `path`; None when it is no chat or completions
    answer this knows how to stream (then it is relayed as it came)."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return None
    try:
        answer = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return None
    if not all(isinstance(choice, dict) for choice in answer["choices"]):
        return None
    head = {k: v for k, v in answer.items() if k not in ("choices", "usage")}
    if path == CHAT_PATH:
        head["object"] = "chat.completion.chunk"
        choices = [_chat_choice(i, choice) for i, choice in enumerate(answer["choices"])]
    else:
        choices = answer["choices"]
    events = [_event({**head, "choices": choices})]
    if include_usage and isinstance(answer.get("usage"), dict):
        events.append(_event({**head, "choices": [], "usage": answer["usage"]}))
    return b"".join(events) + _DONE


def _chat_choice(i: int, choice: dict[str, Any]) -> dict[str, Any]:
    """A chat answer's choice as a stream's: its message becomes the delta."""
    message = choice.get("message")
    delta = dict(message) if isinstance(message, dict) else {}
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        # A streamed tool call says which call its pieces belong to (clients assemble by index).
        delta["tool_calls"] = [{"index": n, **call} if isinstance(call, dict) else call
                               for n, call in enumerate(calls)]
    return {"index": choice.get("index", i), "delta": delta, "logprobs": choice.get("logprobs"),
            "finish_reason": choice.get("finish_reason")}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
