"""Watching a worker's SSE stream on its way through, at minimal cost.

The stream is forwarded event-complete: each piece read from the worker is cut at
its last blank line and only an unfinished trailing event is held back until its
end arrives (the client could not use half an event anyway; a worker that writes
whole events per write, as every OpenAI server does, sees zero delay).
Only events that carry a usage object are JSON-parsed. When the gateway itself
asked the worker for usage (the client did not), the usage-only final chunk
(`"choices": []`) is dropped so the client sees what it asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# Chat and completions count prompt/completion tokens; the Responses API input/output tokens.
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_MAX_CARRY = 1 << 20
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n")
# A chat stream's opening chunk of a choice: its role and no text (OpenAI, vLLM and our worker
# send one per choice before any token). It is no token: counted as one, a stream cut short
# without usage (its worker failed, its client left) counted n tokens too many.
ROLE_OPENING = re.compile(
    # The role first, then only empty fields: `"content": ""` (vLLM, our worker), `"refusal":
    # null` (OpenAI), `"reasoning_content": null, "tool_calls": null` (SGLang dumps its unset ones).
    rb'"delta"\s*:\s*\{\s*"role"\s*:\s*"[a-z]*"(?:\s*,\s*"[a-z_]+"\s*:\s*(?:""|null|\[\]))*\s*\}'
)


class StreamTap:
    __slots__ = (
        "awaiting", "carry", "completion_tokens", "events", "last", "on_first_token", "opening",
        "opening_roles", "passthrough", "prompt_tokens", "strip_usage",
    )

    def __init__(self, strip_usage: bool, first_token: bytes | None = None,
                 on_first_token: Callable[[], None] | None = None) -> None:
        """first_token: bytes that only the event of a stream's first generated token holds,
        for streams that send other events first (the Responses API's `response.created`);
        on_first_token is called when it passes. None: the first event is the first token."""
        self.strip_usage = strip_usage
        self.awaiting = first_token
        self.on_first_token = on_first_token
        self.carry = b""
        self.events = 0
        # Until the first event that is not a choice's role chunk: those are not counted.
        self.opening_roles = True
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.passthrough = False
        self.last = b""  # the last piece passed on: a stream that ended ends it with [DONE]
        # What passed before the first token, when it is watched for (the Responses API's
        # response.created: the response's id, which tells where it is stored).
        self.opening = b""

    def feed(self, piece: bytes) -> bytes:
        """Bytes to send to the client now (possibly empty)."""
        if self.awaiting is not None:
            return self._feed_before_first_token(piece)
        if self.passthrough:
            self._count(piece)
            if _USAGE.search(piece):
                self._scan_usage_bytes(piece)
            self.last = piece
            return piece
        if self.carry:
            piece = self.carry + piece
            self.carry = b""
        cut = piece.rfind(b"\n\n")
        if cut >= 0:
            cut += 2
        else:
            # CRLF framing (sse-starlette's default, so servers built on it): cut there too.
            # Forwarded as is, its usage chunk went to a client that had not asked for usage.
            # (A stream framed with LF, as nearly all are, never holds this, and skips it.)
            cut = piece.rfind(b"\r\n\r\n")
            if cut < 0:
                if len(piece) > _MAX_CARRY:
                    # A giant event: stop cutting, forward as is.
                    self.passthrough = True
                    return self.feed(piece)
                self.carry = piece
                return b""
            cut += 4
        if cut < len(piece):
            self.carry = piece[cut:]
            piece = piece[:cut]
        self._count(piece)
        self.last = piece
        found = _USAGE.search(piece)
        if found is not None:
            piece = self._take_usage(piece, _event_start(piece, found.start()))
        return piece

    def _count(self, piece: bytes) -> None:
        """Count a piece's events; the role chunks that open a chat stream are none (looked
        for only until the first other event, so a stream's tokens pay nothing for it)."""
        events = piece.count(b"data:")
        if self.opening_roles:
            roles = len(ROLE_OPENING.findall(piece))
            if events > roles:
                self.opening_roles = False
            events -= roles
        self.events += events

    def _feed_before_first_token(self, piece: bytes) -> bytes:
        """feed(), looking for the first token's marker in what it passes on: whole events,
        so a marker split between two reads is still found (the per-token path skips this)."""
        marker, self.awaiting = self.awaiting, None
        out = self.feed(piece)
        self.opening += out
        at = out.find(marker) if marker is not None else -1
        # Events before the first token are no tokens: a stream cut short without usage is
        # counted by its events (content_events), and the Responses API sends four first.
        # The first token's own `data:` comes before its marker.
        self.events -= out.count(b"data:", 0, at) - 1 if at >= 0 else out.count(b"data:")
        if at >= 0:
            if self.on_first_token is not None:
                self.on_first_token()
        else:
            self.awaiting = marker
        return out

    def flush(self) -> bytes:
        rest, self.carry = self.carry, b""
        if rest:
            self.events += rest.count(b"data:")
            self.last = rest
        return rest

    @property
    def content_events(self) -> int:
        """Events other than a final [DONE] (a stand-in for tokens when there is no usage).
        A stream cut short (its client left, its worker failed) has no [DONE] to discount."""
        return max(self.events - (b"[DONE]" in self.last), 0)

    def _take_usage(self, piece: bytes, start: int) -> bytes:
        """Take the usage out of the piece's events from `start` (the event holding the first
        usage match: the events before it pass as they are, unsplit, since a read that brings
        a whole stream's tokens at once holds its usage chunk only at the end)."""
        out: list[bytes] = [piece[:start]] if start else []
        for end in _EVENT_END.finditer(piece, start):
            event, separator, start = piece[start:end.start()], end.group(), end.end()
            if not event:
                continue
            if _USAGE.search(event) is not None:
                payload = event[event.find(b"data:") + 5 :] if b"data:" in event else b""
                try:
                    obj = json.loads(payload)
                except (ValueError, RecursionError):  # the last: nested deeper than the parser goes
                    obj = None
                usage = _usage_of_event(obj)
                if usage is not None:
                    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
                    completion = usage.get("completion_tokens", usage.get("output_tokens"))
                    # A count the worker got wrong (negative, or a boolean) is not taken: it would
                    # run the gateway's token counters backwards (a reset to Prometheus) and credit
                    # its tenant in the queue's token turns.
                    if _is_count(prompt):
                        self.prompt_tokens = prompt
                    if _is_count(completion):
                        self.completion_tokens = completion
                    if self.strip_usage and not obj.get("choices"):
                        self.events -= 1
                        continue
            out.append(event)
            out.append(separator)
        out.append(piece[start:])  # nothing: the piece was cut at an event's end
        return b"".join(out)

    def _scan_usage_bytes(self, piece: bytes) -> None:
        p, c = _PROMPT.search(piece), _COMPLETION.search(piece)
        if p:
            self.prompt_tokens = int(p.group(1))
        if c:
            self.completion_tokens = int(c.group(1))


def _event_start(piece: bytes, at: int) -> int:
    """Where the event holding offset `at` begins: after the last blank line before it, in
    either framing (0: the piece's first event)."""
    lf = piece.rfind(b"\n\n", 0, at)
    if lf >= 0:  # (in a stream of mixed framing a CRLF end may come later: starting early is as right)
        return lf + 2
    crlf = piece.rfind(b"\r\n\r\n", 0, at)
    return crlf + 4 if crlf >= 0 else 0


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _usage_of_event(obj: object) -> dict | None:
    """A chunk's usage; the Responses API's is in its `response.completed` event's response."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None and isinstance(obj.get("response"), dict):
        usage = obj["response"].get("usage")
    return usage if isinstance(usage, dict) else None


def usage_of_body(data: bytes) -> tuple[int | None, int | None]:
    """prompt/completion tokens of a non-stream answer, without parsing all of it."""
    i = data.rfind(b'"usage"')
    if i < 0:
        return None, None
    tail = data[i:]
    p, c = _PROMPT.search(tail), _COMPLETION.search(tail)
    return (int(p.group(1)) if p else None), (int(c.group(1)) if c else None)
