"""What a client sees of one answer (benchmarks/vllm_diff_fuzz.py), reduced to what must be the
same directly from vLLM and through the gateway, and the differences the gateway is meant to
make (ALLOWED, each with its reason)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from benchmarks.vllm_diff_cases import Case


@dataclass
class Seen:
    status: int
    form: str  # "json", "sse", "text" or "empty"
    error: tuple | None = None  # (OpenAI shape?, type, param) of an error answer
    summary: dict[str, Any] = field(default_factory=dict)  # a success's structure
    text: str | None = None  # the generated text (compared where the answer is deterministic)
    events: tuple[str, ...] = ()  # a stream's kinds of event, runs collapsed
    raw: bytes = b""  # the first bytes, for the report


def _choice_summary(choices: list) -> dict:
    return {"choices": len(choices),
            "finish": sorted(str(c.get("finish_reason")) for c in choices if isinstance(c, dict)),
            "logprobs": sorted(c.get("logprobs") is not None for c in choices if isinstance(c, dict))}


def _text_of(obj: dict) -> str | None:
    if isinstance(obj.get("choices"), list):
        parts = []
        for c in sorted(obj["choices"], key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0):
            msg = c.get("message") or {}
            parts.append(str(c.get("text") if "text" in c else msg.get("content")))
        return "|".join(parts)
    if obj.get("object") == "response":
        return json.dumps([o.get("content") for o in obj.get("output") or [] if isinstance(o, dict)])
    return None


def _whole(obj: Any) -> tuple[dict, str | None]:
    if not isinstance(obj, dict):
        return {"json": type(obj).__name__}, None
    summary: dict[str, Any] = {"keys": sorted(k for k in obj if k not in _VOLATILE_KEYS),
                               "object": obj.get("object")}
    if isinstance(obj.get("choices"), list):
        summary.update(_choice_summary(obj["choices"]))
    if "usage" in obj:
        summary["usage"] = obj["usage"] is not None
    if obj.get("object") == "response":
        summary["status"] = obj.get("status")
        summary["output"] = [o.get("type") for o in obj.get("output") or [] if isinstance(o, dict)]
    if obj.get("object") == "list" and isinstance(obj.get("data"), list):
        summary["data"] = len(obj["data"])
        summary["data_objects"] = sorted({str(d.get("object")) for d in obj["data"] if isinstance(d, dict)})
    for key in ("tokens", "count", "max_model_len", "prompt"):
        if key in obj:
            summary[key] = obj[key]
    return summary, _text_of(obj)


def _event_kind(data: str) -> tuple[str, list[tuple[int, str]]]:
    """(kind, the (choice index, text) pieces) of one SSE data line."""
    if data == "[DONE]":
        return "[DONE]", []
    try:
        obj = json.loads(data)
    except ValueError:
        return "unparsable", []
    if not isinstance(obj, dict):
        return "non-object", []
    if "error" in obj:
        return f"error:{(obj['error'] or {}).get('type') if isinstance(obj['error'], dict) else '?'}", []
    if "type" in obj and str(obj.get("type", "")).startswith("response."):  # the Responses API
        delta = obj.get("delta") if obj["type"] == "response.output_text.delta" else None
        return obj["type"], [(0, str(delta))] if delta else []
    choices = obj.get("choices")
    kind = []
    text: list[tuple[int, str]] = []
    if isinstance(choices, list):
        if not choices:
            kind.append("no-choices")
        for c in choices:
            delta = c.get("delta") or {}
            if delta.get("role"):
                kind.append("role")
            t = c.get("text") if "text" in c else delta.get("content")
            if t:
                kind.append("text")
                text.append((c.get("index", 0), t))
            if c.get("logprobs") is not None:
                kind.append("logprobs")
            if c.get("finish_reason") is not None:
                kind.append(f"finish:{c['finish_reason']}")
    if obj.get("usage") is not None:
        kind.append("usage")
    return "+".join(sorted(set(kind))) or "empty", text


def _events(body: bytes) -> tuple[tuple[str, ...], str]:
    kinds: list[str] = []
    texts: dict[int, str] = {}
    for line in body.decode(errors="replace").splitlines():
        if not line.startswith("data:"):
            continue
        kind, pieces = _event_kind(line[5:].strip())
        for index, text in pieces:
            texts[index] = texts.get(index, "") + text
        # Runs of one kind collapse: how many text chunks carry a text is tokenizer detail.
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    # Per choice: how the tokens are cut into chunks varies (vLLM sends two at once when the
    # client reads behind), what they spell does not.
    return tuple(kinds), "|".join(texts[i] for i in sorted(texts))


def seen(status: int, content_type: str, body: bytes) -> Seen:
    ct = content_type.split(";")[0].strip().lower()
    s = Seen(status, "empty" if not body else "text", raw=body[:300])
    if ct == "text/event-stream":
        s.form = "sse"
        s.events, s.text = _events(body)
        return s
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        return s
    if body:
        s.form = "json"
    if status >= 400:
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and "message" in err:
            s.error = (True, err.get("type"), err.get("param"))
        else:
            s.error = (False, None, None)
        return s
    s.summary, s.text = _whole(obj)
    return s


# Keys whose values differ between any two answers, not only between two routes.
_VOLATILE_KEYS = frozenset()


def deterministic(case: Case) -> bool:
    """Whether the two answers must have the same text: greedy sampling (temperature 0, as the
    valid bodies ask) and one answer per request or a fixed seed."""
    body = case.parsed
    if not isinstance(body, dict):
        return False
    t = body.get("temperature")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0


# The differences the gateway is meant to make: (name, test(case, direct, through), reason).
ALLOWED: list[tuple[str, Any, str]] = []


def allow(name: str, reason: str):
    def deco(fn):
        ALLOWED.append((name, fn, reason))
        return fn
    return deco


@allow("own 404/405 in the OpenAI shape",
       "vLLM (FastAPI) answers a wrong path or method {\"detail\": ...}; the gateway answers the "
       "same status in the OpenAI error shape, as every 4xx of the product must (DESIGN.md)")
def _own_404(case: Case, direct: Seen, through: Seen) -> bool:
    return (direct.status == through.status and direct.status in (404, 405)
            and direct.error == (False, None, None) and bool(through.error and through.error[0]))


@allow("the gateway's own 400 for a body it cannot place",
       "the gateway must read model and stream to place a request: a body that is not a JSON "
       "object or a model that is not a string gets its own 400 (type invalid_request_error, "
       "param 'model'), where vLLM's 400 for the same body says type 'Bad Request', param 'body.model'")
def _own_400(case: Case, direct: Seen, through: Seen) -> bool:
    return (direct.status == through.status == 400 and direct.error is not None
            and direct.error[1] == "Bad Request" and through.error is not None
            and through.error[:2] == (True, "invalid_request_error")
            and through.error[2] in (None, "model", "stream", "priority", "stream_options",
                                     "previous_response_id"))


@allow("a compressed body is decoded",
       "Content-Encoding is HTTP, not the API: the gateway (aiohttp) decodes a gzip or deflate body "
       "and serves it; vLLM (uvicorn) does not and answers 400 'There was an error parsing the "
       "body'. A client that works without the gateway works with it")
def _gzip(case: Case, direct: Seen, through: Seen) -> bool:
    return (case.headers.get("Content-Encoding") == "gzip" and direct.status == 400
            and direct.raw.startswith(b'{"detail":"There was an error parsing the body"'))


@allow("a model no worker serves",
       "the gateway cannot place a request for a model no worker serves: its own 404 says type "
       "invalid_request_error, code model_not_found (as api.openai.com does), where vLLM says type "
       "NotFoundError")
def _unserved_model(case: Case, direct: Seen, through: Seen) -> bool:
    # vLLM validates the body before it looks the model up: for a body it refuses too, its 400.
    return (through.status == 404 and b"model_not_found" in through.raw and direct.error is not None
            and ((direct.status == 404 and direct.error[1] == "NotFoundError") or direct.status == 400))


@allow("a stored response not found names previous_response_id",
       "the gateway looks up which worker stores the response it continues, and answers for one "
       "none stores with vLLM's own 404 message, but with param previous_response_id (the field "
       "the client sent, as OpenAI names it) where vLLM says response_id")
def _previous_not_found(case: Case, direct: Seen, through: Seen) -> bool:
    return (direct.status == through.status == 404 and direct.error == (True, "invalid_request_error",
                                                                       "response_id")
            and through.error == (True, "invalid_request_error", "previous_response_id"))


@allow("405 on a POST-only OpenAI endpoint vLLM does not serve",
       "another method than POST on /v1/embeddings (and the other POST-only endpoints) is the "
       "gateway's 405 naming POST: the pool may serve it; this vLLM (a generation model) has no such "
       "route at all and says 404")
def _post_only(case: Case, direct: Seen, through: Seen) -> bool:
    return direct.status == 404 and through.status == 405 and case.method != "POST"


@allow("an endpoint this vLLM does not serve, with a body the gateway cannot place",
       "vLLM (a generation model) has no /v1/embeddings route: 404 whatever the body; the gateway "
       "reads the body before it can place the request on a worker, and refuses an unreadable one "
       "(not JSON, model not a string) with its own 400")
def _unserved_endpoint(case: Case, direct: Seen, through: Seen) -> bool:
    return (direct.status == 404 and direct.error == (False, None, None) and through.status == 400
            and through.error is not None and through.error[0])


@allow("HEAD on a GET route",
       "the gateway (aiohttp) answers HEAD wherever it answers GET (/v1/models), as HTTP asks "
       "(RFC 9110 9.3.2); vLLM (FastAPI) answers 405")
def _head(case: Case, direct: Seen, through: Seen) -> bool:
    return case.method == "HEAD" and direct.status == 405 and through.status == 200


@allow("the gateway's model list",
       "GET /v1/models lists the models of the whole pool from the scheduler (owned_by llm-router), "
       "not one engine's own card (root, max_model_len, permission)")
def _models(case: Case, direct: Seen, through: Seen) -> bool:
    if case.kind != "models" or direct.status != 200 or through.status != 200:
        return False
    a, b = direct.summary, through.summary
    return (a.get("object"), a.get("data"), a.get("data_objects")) == (
        b.get("object"), b.get("data"), b.get("data_objects"))


@allow("a JSON body under another Content-Type",
       "vLLM refuses a chat or completions body whose Content-Type is not application/json (400 "
       "'Unsupported Media Type'), even one that is JSON; the gateway parses the body it is sent and "
       "serves it (its hot path sends the worker application/json): more lenient, never less, so a "
       "client that works without the gateway works with it (curl -d without -H included)")
def _content_type(case: Case, direct: Seen, through: Seen) -> bool:
    return (case.kind in ("chat", "completions") and direct.status == 400
            and b"Unsupported Media Type" in direct.raw and b"Unsupported Media Type" not in through.raw)


# Differences the gateway should not make, found by this fuzz and left open (their code is
# outside what this fuzz's author could change): counted under "known_open", not failures.
# Fix one, and remove it here: the fuzz then fails where it comes back.
KNOWN: list[tuple[str, Any, str]] = []


def known(name: str, reason: str):
    def deco(fn):
        KNOWN.append((name, fn, reason))
        return fn
    return deco


def _unfinished(s: Seen) -> Seen:
    """`s` without why its choices finished (stop or length): its events then collapse again
    (a last text chunk that also finished joins the run of text before it)."""
    summary = {k: v for k, v in s.summary.items() if k != "finish"}
    events = tuple(e for e in (_no_finish(e) for e in s.events) if e)
    collapsed = tuple(e for i, e in enumerate(events) if i == 0 or events[i - 1] != e)
    return Seen(s.status, s.form, s.error, summary, s.text, collapsed, s.raw)


def _no_finish(kind: str) -> str:
    return "+".join(p for p in kind.split("+") if not p.startswith("finish:"))


def differences(case: Case, direct: Seen, through: Seen) -> list[str]:
    """What a client would see differently through the gateway (empty: the same)."""
    out: list[str] = []
    if direct.status != through.status:
        out.append(f"status {direct.status} vs {through.status}")
    if direct.form != through.form:
        out.append(f"form {direct.form} vs {through.form}")
    if direct.error != through.error:
        a, b = direct.error or (None, None, None), through.error or (None, None, None)
        if a[0] != b[0]:
            out.append(f"error shape {a[0]} vs {b[0]}")
        elif a[1] != b[1]:
            out.append(f"error type {a[1]} vs {b[1]}")
        elif a[2] is not None and a[2] != b[2]:
            out.append(f"error param {a[2]} vs {b[2]}")
    sampled = not deterministic(case)
    if sampled:  # where sampling is random, an answer may stop early in one and not the other
        direct, through = _unfinished(direct), _unfinished(through)
    if direct.summary != through.summary:
        keys = sorted(set(direct.summary) | set(through.summary))
        diff = [k for k in keys if direct.summary.get(k) != through.summary.get(k)]
        out.append("answer " + ", ".join(f"{k}: {direct.summary.get(k)!r} vs {through.summary.get(k)!r}"
                                          for k in diff))
    if direct.events != through.events:
        out.append(f"events {direct.events} vs {through.events}")
    if not sampled and direct.status == 200 and direct.text != through.text:
        out.append(f"text {direct.text!r} vs {through.text!r}")
    return out


def known_by(case: Case, direct: Seen, through: Seen) -> str | None:
    for name, test, _reason in KNOWN:
        if test(case, direct, through):
            return name
    return None


def allowed_by(case: Case, direct: Seen, through: Seen) -> str | None:
    for name, test, _reason in ALLOWED:
        if test(case, direct, through):
            return name
    return None
