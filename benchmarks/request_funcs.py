"""One streaming OpenAI request, timed the way `vllm bench serve` times it.

- st is taken just before the POST; TTFT = first token chunk - st; each later
  token chunk adds one ITL sample (a chunk may carry several tokens);
  latency = last token chunk - st.
- Output tokens come from the usage report (`stream_options.include_usage`);
  when the server sends none the caller re-tokenizes `generated_text`.
- A chunk counts as a token chunk when it has a non-empty `choices` list,
  except a chat chunk that only announces the assistant role.

Per-chunk work is kept minimal because one process drives hundreds of
streams: a token chunk is classified by a few byte searches and its raw
payload is kept; JSON is parsed only for the rare chunks that carry usage, an
error or a role, and the kept payloads are parsed for their text only when the
server never reported usage (see benchmarks/RESULTS.md for the measured
difference).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.bench_metrics import RequestResult

_MAX_ERROR_CHARS = 500


@dataclass
class RequestInput:
    """What to send. `prompt` is text for /v1/completions; `messages` a chat history for chat."""

    api_url: str
    model: str
    prompt_len: int
    max_tokens: int
    prompt: str = ""
    messages: list[dict[str, str]] | None = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    headers: dict[str, str] | None = None  # sent besides x-request-id (e.g. a session header)


def is_chat_url(api_url: str) -> bool:
    return api_url.rstrip("/").endswith("chat/completions")


def build_payload(inp: RequestInput) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": inp.model, "stream": True, "stream_options": {"include_usage": True}}
    if is_chat_url(inp.api_url):
        payload["messages"] = inp.messages if inp.messages is not None else [
            {"role": "user", "content": inp.prompt}
        ]
        # Both names: OpenAI's newer field and the one older servers know.
        payload["max_completion_tokens"] = inp.max_tokens
        payload["max_tokens"] = inp.max_tokens
    else:
        payload["prompt"] = inp.prompt
        payload["max_tokens"] = inp.max_tokens
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    # Greedy by default, as vLLM's benchmark does; extra_body may override.
    payload["temperature"] = 0.0
    payload.update(inp.extra_body)
    return payload


def _choice_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


def _is_role_only(data: dict[str, Any]) -> bool:
    choices = data.get("choices") or []
    if not choices:
        return False
    delta = choices[0].get("delta")
    return isinstance(delta, dict) and "role" in delta and not delta.get("content")


def _error_text(data: dict[str, Any]) -> str:
    err = data.get("error", data)
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


class _StreamState:
    """Timing and bookkeeping of one response stream."""

    __slots__ = ("error", "itl", "last", "payloads", "st", "ttft", "usage_tokens")

    def __init__(self, st: float) -> None:
        self.st = st
        self.last = st
        self.ttft = 0.0
        self.itl: list[float] = []
        self.payloads: list[bytes] = []
        self.usage_tokens = 0
        self.error = ""

    def token_chunk(self, now: float, payload: bytes) -> None:
        if not self.payloads:
            self.ttft = now - self.st
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.payloads.append(payload)

    def handle(self, payload: bytes, chat: bool) -> None:
        now = time.perf_counter()
        # Fast path: an ordinary token chunk carries neither usage numbers,
        # an error, a role announcement nor an empty choices list.
        if (
            b'"completion_tokens"' not in payload
            and b'"error"' not in payload
            and not (chat and b'"role"' in payload)
            and b'"choices":[]' not in payload
            and b'"choices": []' not in payload
        ):
            self.token_chunk(now, payload)
            return
        data = json.loads(payload)
        if not isinstance(data, dict):
            return
        if "error" in data or data.get("object") == "error":
            self.error = _error_text(data)[:_MAX_ERROR_CHARS]
            return
        if data.get("choices") and not (chat and _is_role_only(data)):
            self.token_chunk(now, payload)
        usage = data.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens"):
            self.usage_tokens = int(usage["completion_tokens"])

    def generated_text(self) -> str:
        return "".join(_choice_text(json.loads(p)) for p in self.payloads)


async def _read_error_body(response: aiohttp.ClientResponse) -> str:
    try:
        body = await response.text()
    except (aiohttp.ClientError, UnicodeDecodeError) as exc:
        body = f"<unreadable body: {exc}>"
    try:
        message = _error_text(json.loads(body))
    except (ValueError, AttributeError):
        message = body
    return f"HTTP {response.status}: {message}"[:_MAX_ERROR_CHARS]


async def stream_request(
    session: aiohttp.ClientSession,
    inp: RequestInput,
    timeout_s: float | None = None,
    want_text: bool = False,
) -> RequestResult:
    """POST one streaming request and time it (wall-clock seconds; the caller rescales).

    `want_text` decodes the generated text even when usage was reported
    (vLLM's `generated_texts`); otherwise it is decoded only as the fallback
    token count's input. Never raises for transport or HTTP errors: they end
    up in `RequestResult.error` with success False. Cancellation propagates.
    """
    chat = is_chat_url(inp.api_url)
    headers = {"x-request-id": inp.request_id} if inp.request_id else None
    if inp.headers:
        headers = {**(headers or {}), **inp.headers}
    result = RequestResult(prompt_len=inp.prompt_len)
    timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else aiohttp.ClientTimeout(total=None)
    st = time.perf_counter()
    # Set before anything can return: a request refused with an HTTP error was sent too, and
    # its start time must be on the run's clock (reports take min(start_times) as the start).
    result.start_time = st
    state = _StreamState(st)
    try:
        payload = build_payload(inp)
        async with session.post(inp.api_url, json=payload, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                result.error = await _read_error_body(resp)
                return result
            async for raw_line in resp.content:
                # SSE: `data: <json>` lines separated by blank lines; `:` lines are comments.
                if not raw_line.startswith(b"data:"):
                    continue
                payload = raw_line[5:].strip()
                if payload == b"[DONE]":
                    break
                if payload:
                    state.handle(payload, chat)
                    if state.error:
                        break
    except TimeoutError:
        state.error = f"timeout: no complete response within {timeout_s} s"
    except aiohttp.ClientError as exc:
        state.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    except (ValueError, UnicodeDecodeError) as exc:
        state.error = f"malformed stream chunk: {exc}"[:_MAX_ERROR_CHARS]

    result.ttft = state.ttft
    result.itl = state.itl
    result.latency = state.last - st
    result.output_tokens = state.usage_tokens
    if state.error:
        result.error = state.error
    elif not state.payloads:
        result.error = "stream ended without any token chunk"
    else:
        result.success = True
        if want_text or not state.usage_tokens:
            try:
                result.generated_text = state.generated_text()
            except ValueError as exc:
                result.success = False
                result.error = f"malformed stream chunk: {exc}"[:_MAX_ERROR_CHARS]
    return result
