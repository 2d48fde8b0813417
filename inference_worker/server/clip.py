"""Client-chosen strings as an error message or a log line may show them: cut to a bounded
length. Echoed whole, a 100 KB model name made a 100 KB 404 and a validation error quoted a
100 KB field value. A twin of scheduler/clip.py (the worker imports nothing of the scheduler or
the gateway), kept alike by tests/scheduler/test_tls_reload.py.

A short value is shown as before (the texts that mirror vLLM's stay the same): only a long one
changes, to its first MAX_SHOWN_CHARS characters, an ellipsis and its length, e.g.
`'aaaa…' (100000 chars)`.
"""

from __future__ import annotations

# As many characters as router/tracing.py keeps of a client-chosen span attribute.
MAX_SHOWN_CHARS = 256


def clip(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """`text`, or its first `limit` characters, an ellipsis and its length when longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} chars)"


def clip_repr(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """repr(value) as clip() cuts it: a long string's repr is that of its head and an ellipsis
    (still one quoted string), then its length; any other value's repr is cut as text (a JSON
    value where a string was expected may be a list of a million items)."""
    if not isinstance(value, str):
        return clip(repr(value), limit)
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit] + '…'!r} ({len(value)} chars)"
