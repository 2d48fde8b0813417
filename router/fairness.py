"""Which flow (tenant) a request belongs to: the admission queue gives the flows of one
priority turns (router/queue.py), so that one tenant's flood does not queue everybody else
behind it.

A flow is named by the Gateway API Inference Extension's fairness header
(`x-gateway-inference-fairness-id` by default), else by the client's API key (a digest: the key
itself is not kept), else it is the one shared flow: with neither, the queue orders as without
flows. The header is the client's word: a client that can set it can spread its requests over
many flows. Where clients reach the gateway directly, a trusted proxy in front should set it,
or each client gets its own API key and the header is switched off (`--fairness-header ''`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from router.auth import bearer_token

DEFAULT_FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
MAX_ID_CHARS = 128
SHARED_FLOW = ""


def flow_of(headers: Mapping[str, str], fairness_header: str) -> str:
    value = headers.get(fairness_header) if fairness_header else None
    if value and value.strip():
        # aiohttp hands header bytes that are not UTF-8 on as lone surrogates, which no UTF-8
        # encoder takes (the id is a metrics label and an /admin/state key): spelled out instead.
        value = value.strip()[:MAX_ID_CHARS].encode("utf-8", "backslashreplace").decode()
        return "id:" + value
    token = bearer_token(headers.get("Authorization"))
    if token is not None:
        return "key:" + hashlib.blake2b(token, digest_size=8).hexdigest()
    return SHARED_FLOW
