"""What the gateway reads of a client's request before placing it: the body, within the size
and time limits, and the few fields it acts on (model, stream, priority, stream_options),
read as the engines read them (router/lax_fields.py: `"stream": "true"` is a stream), each
refused with a 4xx in the OpenAI shape when the engine would refuse it too. The body itself is
not checked further: the worker answers for the rest, as it would without the gateway.

Hot path rules (router/proxy.py): the body is parsed once with json.loads, the fields read
by hand, no pydantic (but for a field that is not of its JSON type); the bytes sent on are the
client's own, or with stream_options spliced in.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.access_log import RequestRecord
from router.config import RouterConfig
from router.errors import error_response
from router.form_fields import MalformedForm, form_fields
from router.lax_fields import lax_bool, lax_int
from router.tokenizer_calls import TOKENIZER_PATHS
from scheduler.clip import clip
from scheduler.receive_timeout import RequestBodyTimeout, read_body_within

http_log = logging.getLogger("router.http")  # what clients send on the wire (router/http_errors.py)

STREAMABLE = frozenset({"/v1/completions", "/v1/chat/completions"})
# OpenAI endpoints that only take POST: another method gets 405 here instead of a confusing
# "'model' is required" (other /v1 paths pass through to the workers, which answer for them).
# vLLM's pooling endpoints at the root run the model as /v1/embeddings does: routed like it
# (a lease, the queue). Its /tokenize and /detokenize, also at the root, generate nothing and
# take no lease (router/tokenizer_calls.py).
POOLING_PATHS = frozenset({"/pooling", "/classify", "/score", "/rerank", "/v2/rerank"})
# The engines' native generation APIs, at the root: SGLang's /generate ({"text" or "input_ids",
# "sampling_params", "stream"}) and TGI's /generate and /generate_stream ({"inputs",
# "parameters"}; the second always streams). They name no model: a request goes to the pool's
# one model (router/default_model.py), leased and queued as a completion is.
NATIVE_GENERATE_PATHS = frozenset({"/generate", "/generate_stream"})
ROOT_PATHS = POOLING_PATHS | TOKENIZER_PATHS | NATIVE_GENERATE_PATHS  # served at the root
_POST_ONLY = STREAMABLE | {"/v1/embeddings", "/v1/responses"} | ROOT_PATHS
# Endpoints (of OpenAI and of the engines we front) whose request names a model. A request to
# any other /v1 path without a model is a wrong path, not a missing field: it gets a 404.
MODEL_ENDPOINTS = _POST_ONLY | {
    "/v1/rerank",
    "/v1/score",
    "/v1/moderations",
    "/v1/audio/speech",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/images/generations",
}
# OpenAI's audio endpoints take a multipart form (the file, and the options as text fields).
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
_INJECT_USAGE = b',"stream_options":{"include_usage":true}}'


def is_name(value: Any) -> bool:
    """A usable model name or response id: a non-empty string that is text. JSON's escapes can
    spell a lone surrogate ("\\ud800"), which no UTF-8 encoder takes: as a model it would fail the
    scheduler call and the /metrics page (a label) from then on, as an id the owner lookup."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


async def read_request_body(request: web.Request, path: str, cfg: RouterConfig) -> bytes | web.Response:
    """The request's body, or the answer that refuses it: a method the path does not take, a
    body over --max-body-bytes, one stalled for --request-receive-timeout-ms or too slow past
    it, one that cannot be decoded."""
    if path in _POST_ONLY and request.method != "POST":
        return error_response(
            405, f"{clip(request.method)} is not allowed on {path}: use POST",
            code="method_not_allowed", headers={"Allow": "POST"},
        )
    max_body = cfg.max_body_bytes
    if (request.content_length or 0) > max_body:
        return error_response(413, f"request body larger than {max_body} bytes", code="body_too_large")
    try:
        return await read_body_within(request, cfg.request_receive_timeout_ms / 1000, http_log)
    except RequestBodyTimeout as exc:  # a slow or stalled client (scheduler/receive_timeout.py)
        answer = error_response(408, str(exc), code="request_timeout")
        answer.force_close()
        return answer
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body larger than {max_body} bytes", code="body_too_large")
    except web.RequestPayloadError as exc:  # e.g. a Content-Encoding the body does not match
        # Marked read, or aiohttp reads the rest after the answer, meets the same error and
        # logs it with a traceback; and the connection closes (its framing is in doubt).
        request.content.feed_eof()
        answer = error_response(400, f"unreadable request body: {exc}", code="invalid_body")
        answer.force_close()
        return answer


@dataclass
class ModelRequest:
    """A request that names a model: its body as sent, parsed, and the model."""

    raw: bytes
    body: dict[str, Any]
    # None: the request names none (absent, null or ""), and is for the model the pool serves
    # (router/default_model.py), as the engine would serve it.
    model: str | None


def model_request(request: web.Request, path: str, raw: bytes) -> ModelRequest | web.Response | None:
    """The body parsed and its model (the `model` query parameter where the body has none; None
    where neither names one), or the 400 that refuses it; None when it names no model on a path
    that is not a model endpoint (a wrong path: the caller answers 404)."""
    body: dict[str, Any] = {}
    if raw and path in FORM_PATHS and request.content_type == "multipart/form-data":
        try:
            body = form_fields(request.headers.get("Content-Type", ""), raw)
        except MalformedForm as exc:
            return error_response(400, f"request body is not valid multipart/form-data: {exc}")
    elif raw:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        except RecursionError:  # nesting deeper than the parser's stack: no request does that
            return error_response(400, "request body is not valid JSON: nested too deeply")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
    model = body.get("model", request.query.get("model"))
    if model == "":
        model = None  # names no model, as vLLM reads it
    if model is None and path not in MODEL_ENDPOINTS:
        return None
    if not raw and request.method == "POST":
        return error_response(400, "request body is required")
    if model is None:
        return ModelRequest(raw, body, None)
    if not is_name(model):
        return error_response(400, "'model' must be a non-empty string", param="model")
    return ModelRequest(raw, body, model)


@dataclass
class Delivery:
    """How the answer goes back, and the request's place in the queue."""

    raw: bytes  # the bytes sent on: the client's, or with usage asked for (strip_usage)
    stream: bool
    priority: int
    strip_usage: bool  # usage asked of the worker for the gateway's counts, hidden from the client


def delivery(request: web.Request, path: str, req: ModelRequest,
             rec: RequestRecord) -> Delivery | web.Response:
    """The request's stream (noted in `rec` as soon as it is known: a stream refused for a later
    field is logged as one), priority and stream_options, or the 400 that refuses one."""
    body, raw = req.body, req.raw
    try:
        stream = engine_flag(body, "stream")
    except ValueError:
        return error_response(400, "'stream' must be a boolean", param="stream")
    # Any POST that asks for a stream is streamed through (chat, completions, the Responses
    # API, audio transcriptions, ...): a buffered answer would reach its client all at once.
    stream = (stream or path == "/generate_stream") and request.method == "POST"
    rec.stream = stream
    priority = body.get("priority")
    try:
        priority = 0 if priority is None else lax_int(priority)
    except ValueError:
        return error_response(400, "'priority' must be an integer (lower is served first)",
                              param="priority")
    strip_usage = False
    if stream and path in STREAMABLE:
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            return error_response(400, "'stream_options' must be an object", param="stream_options")
        flags: dict[str, bool] = {}
        for key in ("include_usage", "continuous_usage_stats"):
            # Checked here: with_usage below overwrites them, and would turn a value the
            # worker refuses (400) into one it takes, hiding usage from a client that asked.
            try:
                flags[key] = engine_flag(opts or {}, key)
            except ValueError:
                return error_response(400, f"'stream_options.{key}' must be a boolean",
                                      param=f"stream_options.{key}")
        if not flags["include_usage"]:
            strip_usage = True  # ask the worker for usage; hide it from the client
            raw = with_usage(raw, body)
    return Delivery(raw, stream, priority, strip_usage)


def engine_flag(body: dict, key: str) -> bool:
    """An optional boolean field as the engine reads it (router/lax_fields.py): absent or null
    is false; raises ValueError for a value the engine refuses."""
    value = body.get(key)
    return False if value is None else lax_bool(value)


def with_usage(raw: bytes, body: dict) -> bytes:
    """Ask the worker for usage. Splicing bytes avoids re-encoding the body."""
    if "stream_options" not in body:
        end = raw.rstrip()
        if end.endswith(b"}"):
            inner = end[:-1].rstrip()
            if inner.endswith(b"{"):  # "{}" cannot happen (model is set) but stay correct
                return inner + _INJECT_USAGE[1:]
            return inner + _INJECT_USAGE
    new = dict(body)
    opts = new["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if opts.get("continuous_usage_stats"):
        # It takes effect only with include_usage (vLLM): the usage asked for here must not
        # put usage into every chunk for a client that did not ask for usage at all.
        opts["continuous_usage_stats"] = False
    return json.dumps(new).encode()
