"""Which session a request belongs to, for the scheduler's session affinity (scheduler/sessions.py).

Off unless the operator names the header (`--session-header`, as vLLM production-stack's
`--session-key` must be named). With it, a request's session is that header's value, or, when
the request carries none, the body's `prompt_cache_key`: OpenAI's own field for "requests of
this key share cached context, keep them together", which OpenAI SDK clients set without custom
headers. The body is forwarded unchanged either way.

The scheduler is sent a 63-bit digest of the value, never the value (it may be a user id or a
conversation id): stable across processes and restarts (blake2b, not Python's salted hash()),
so every gateway replica names a session by the same key. While the scheduler is away the
gateway places a session's requests itself by the same key (router/fallback.py: rendezvous
hashing over the workers it knows), so they still share a worker. The key is not scoped by
tenant: a session is only a placement hint, so two clients who pick the same value share a
worker preference and nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

# OpenAI's body field that names a cache-sharing group of requests.
BODY_FIELD = "prompt_cache_key"
# A longer value is no session (no digest of megabytes on the event loop for a body field); a
# header cannot be longer anyway (aiohttp's 8190-byte header line).
MAX_SESSION_CHARS = 8192


def session_key(value: str) -> int:
    """The scheduler's key for a session value: 63 bits of its blake2b digest. A header that
    was not UTF-8 (aiohttp's lone surrogates) or a JSON string's lone surrogate still hashes."""
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def session_of(headers: Mapping[str, str], body: Mapping[str, Any], header: str) -> int | None:
    """The request's session key: the header's value, else the body's prompt_cache_key; None when
    sessions are off (`header` empty) or the request names none."""
    if not header:
        return None
    value = headers.get(header)
    if not value:
        value = body.get(BODY_FIELD)
        if not isinstance(value, str):
            return None
    if not value or len(value) > MAX_SESSION_CHARS:
        return None
    return session_key(value)
