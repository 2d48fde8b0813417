"""A worker's answer that says it drains: it takes no new request and finishes those it took.

A worker that gets SIGTERM answers new requests 503 while it finishes the ones it holds: ours
(inference_worker/server/errors.py) with an OpenAI error whose code is `shutting_down`, from its
signal until its port closes (and on kept-alive connections after); vLLM started with
`--shutdown-mode drain` with `{"error": "Server is unavailable. Please try again later."}` for
its whole drain (its ServiceUnavailableMiddleware; its port stays open, its /metrics answers).
A gateway in front of another says `shutting_down` as ours does.

Such an answer is retried on another worker like any 5xx before the first byte, but its
failure kind (router/streaming.py's RetryElsewhere.answered), which the scheduler is told, is
"draining" (scheduler/protocol.py's DRAINING), not "http_503": the scheduler takes the worker
out of rotation at once with that down cause, which the gateways' down-watch
(router/down_watch.py) leaves alone, so the answers the worker is finishing are not given up
and generated again elsewhere. As "http_503", three in a row made
it a failing worker, whose answers every gateway then moved.
"""

from __future__ import annotations

import json
import re

SHUTTING_DOWN = "shutting_down"  # the OpenAI error code ours (and this gateway) answer with
VLLM_DRAINING = "Server is unavailable. Please try again later."
# The same in a body cut short (a retried answer's detail is its first 200 bytes), or in one
# that is not strict JSON.
_SAYS_DRAINING = re.compile(
    r'"(?:code|type)"\s*:\s*"shutting_down"|"error"\s*:\s*"Server is unavailable\. Please try again later\."'
)


def says_draining(status: int, body: str) -> bool:
    """Whether a worker's error answer (`body`: its text, or its start) says it drains."""
    if status != 503:
        return False
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return _SAYS_DRAINING.search(body) is not None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return SHUTTING_DOWN in (err.get("code"), err.get("type"))
    return err == VLLM_DRAINING

