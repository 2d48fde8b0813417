"""What benchmarks/api_fuzz.py sends: each endpoint's valid request, and the seeded mutations
that break one to three things in it (fields, types, numbers, strings, headers, paths, framing)."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.fuzz_procs import MODEL, REGISTRATION_TOKEN

# ---- what is sent ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    name: str  # e.g. "gw chat"
    server: str  # "gateway", "worker" or "scheduler"
    path: str
    kind: str  # which valid body (VALID) and field list (FIELDS)


ENDPOINTS = [
    *(Endpoint(f"gw {k}", "gateway", p, k) for k, p in (
        ("chat", "/v1/chat/completions"), ("completions", "/v1/completions"),
        ("responses", "/v1/responses"), ("embeddings", "/v1/embeddings"),
        ("tokenize", "/tokenize"), ("detokenize", "/detokenize"), ("stored", "/v1/responses/"))),
    *(Endpoint(f"worker {k}", "worker", p, k) for k, p in (
        ("chat", "/v1/chat/completions"), ("completions", "/v1/completions"),
        ("responses", "/v1/responses"), ("tokenize", "/tokenize"), ("detokenize", "/detokenize"),
        ("stored", "/v1/responses/"))),
    *(Endpoint(f"sched {k}", "scheduler", p, k) for k, p in (
        ("schedule", "/v1/schedule"), ("release", "/v1/release"), ("prefilled", "/v1/prefilled"),
        ("renew", "/v1/renew"), ("batch", "/v1/batch"), ("failure", "/v1/workers/no-such-worker/failure"),
        ("register", "/v1/workers"))),
]


def valid_body(kind: str) -> Any:
    """A request each endpoint takes (answers stay short: a few tokens)."""
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hello there"}], "max_tokens": 4}
    return {
        "chat": chat,
        "completions": {"model": MODEL, "prompt": "hello there", "max_tokens": 4},
        "responses": {"model": MODEL, "input": "hello there", "max_output_tokens": 4, "store": False},
        "embeddings": {"model": MODEL, "input": "hello there"},
        "tokenize": {"model": MODEL, "prompt": "hello there"},
        "detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
        "stored": {},  # GET, cancel or DELETE of a stored response: the id is in the path
        "schedule": {"model": MODEL, "prompt_tokens": 10, "max_tokens": 4},
        "release": {"lease_id": "no-such-lease", "ok": True, "prompt_tokens": 3, "output_tokens": 4},
        "prefilled": {"lease_id": "no-such-lease"},
        "renew": {"lease_id": "no-such-lease"},
        "batch": [{"op": "schedule", "model": MODEL, "prompt_tokens": 10},
                  {"op": "release", "lease_id": "no-such-lease", "ok": True}],
        "failure": {"error": "connect", "refused": False},
        # Another model than MODEL: a registration the fuzz lets through takes no MODEL traffic.
        "register": {"url": "http://127.0.0.1:9", "models": ["fuzz-other-model"], "worker_id": "fuzz-reg"},
    }[kind]


_SAMPLING = ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "best_of", "logprobs",
             "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "priority", "user",
             "stream", "stream_options", "response_format", "tools", "tool_choice", "min_tokens",
             "stop_token_ids", "request_id", "cache_salt", "prompt_cache_key", "max_completion_tokens"]
FIELDS: dict[str, list[str]] = {
    "chat": ["model", "messages", "max_tokens", *_SAMPLING, "echo", "add_generation_prompt",
             "continue_final_message", "chat_template_kwargs", "parallel_tool_calls", "metadata", "store"],
    "completions": ["model", "prompt", "max_tokens", *_SAMPLING, "echo", "suffix", "prompt_logprobs",
                    "add_special_tokens"],
    "responses": ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                  "store", "background", "previous_response_id", "text", "tools", "metadata",
                  "truncation", "top_logprobs", "reasoning", "user", "tool_choice"],
    "embeddings": ["model", "input", "encoding_format", "dimensions", "user"],
    "tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                 "return_token_strs", "chat_template_kwargs"],
    "detokenize": ["model", "tokens"],
    "stored": ["model", "stream", "starting_after", "include"],
    "schedule": ["model", "prompt_tokens", "max_tokens", "prefix_hashes", "lora", "exclude", "wait_ms",
                 "reserved_only", "worker_id", "attach", "cached_tokens", "flow", "priority", "waited_ms",
                 "session"],
    "release": ["lease_id", "ok", "prompt_tokens", "output_tokens", "ttft_ms", "error", "handed_off"],
    "prefilled": ["lease_id"],
    "renew": ["lease_id"],
    "batch": ["op", "model", "prompt_tokens", "max_tokens", "lease_id", "ok", "wait_ms", "exclude"],
    "failure": ["error", "refused"],
    "register": ["url", "models", "engine", "worker_id", "max_running"],
}

TYPE_VALUES: list[Any] = ["text", "", 0, -1, 1.5, True, False, None, [], [1, "a", None], {}, {"a": 1},
                          [{"type": "text", "text": "x"}]]
EXTREMES: list[Any] = [-1, 0, 1, 1e308, -1e308, math.nan, math.inf, -math.inf, 10**30, -(10**30),
                       10**400, 2**63, 2**64, -(2**63) - 1, 5e-324, 0.5, -0.0]
STRINGS: list[Any] = ["", " ", "\x00", "\ud800", "\udfff x", "\u202e\u0000\n\r", "é" * 50, "😀" * 20,
                      "%s%n%x", "../../etc/passwd", "<script>", "a" * 70_000, "\n" * 1000]
ODD: dict[str, list[Any]] = {
    "n": [0, -1, 2, 128, 129, 10**9, 1.0, "2", None],
    "best_of": [0, 1, 2, 200, -1, None, 1.0],
    "logprobs": [True, False, 0, 5, 20, 21, -1, None, "yes"],
    "top_logprobs": [0, 5, 20, 21, -1, None, 1.5],
    "stop": ["", [], [""], ["a"] * 200, [1], "x" * 10_000, [None], {"a": 1}, ["\ud800"], None],
    "logit_bias": [{}, {"1": 100}, {"1": 101}, {"a": 1}, {"-1": 1}, {"99999999999": 1}, {"1": "x"},
                   {"1": math.nan}, [1], {"": 1}, {"²": 1}, {str(i): 1 for i in range(3000)}],
    "seed": [0, -1, 2**63, 2**64, -(2**63) - 1, 1.5, "1", None],
    "response_format": [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {}},
                        {}, "json", {"type": 5}, [], None],
    "tools": [[], [{}], [{"type": "function", "function": {"name": "f"}}], "x", [1], None],
    "tool_choice": ["none", "auto", "required", {}, 5, {"type": "function"}],
    "stream": [True, False, "true", 1, 0, None, [], {}],
    "stream_options": [None, {}, [], "x", {"include_usage": "yes"}, {"include_usage": None},
                       {"continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": 1},
                       {"junk": 1}, {"include_usage": True}],
    "max_tokens": [0, -1, 1, 511, 512, 100_000, 10**400, 1.0, "4", None],
    "temperature": [-0.1, 0, 2, 2.1, math.nan, math.inf, "1", None],
    "priority": [-(10**400), 10**30, -1, 1.5, "0", True],
    "stop_token_ids": [[], [-1], [10**30], ["a"], [0], None],
    "background": [True, False, "yes", None, 1],
    "store": [True, False, None, "no"],
    "previous_response_id": ["", "resp_nothere", "@STORED@", "\ud800", 5, None, "x" * 5000, "resp_/../x"],
    "text": [{"format": {"type": "json_schema"}}, {"format": "x"}, "x", {}, {"format": {"type": "text"}}],
    "prompt_cache_key": ["", "k", "\ud800", 5, "k" * 10_000],
}
ROLES: list[Any] = ["", "robot", "function", "tool", "USER", 5, None, [], "assistant", "developer"]
CONTENTS: list[Any] = [None, "", 5, [], [{}], [{"type": "text"}], [{"type": "text", "text": 5}],
                       [{"type": "image_url", "image_url": {"url": "x"}}], [{"type": 5}], [{"text": "a"}],
                       [{"type": "text", "text": "a"}] * 500, {"text": "a"}, ["a"], [None],
                       [{"type": "input_text", "text": "a"}], [{"type": "text", "text": "\ud800"}]]
MESSAGE_LISTS: list[Any] = [[], "hi", 5, None, {}, ["hi"], [None], [[]], [{}], [{"role": "user"}],
                            [{"content": "hi"}], [{"role": "assistant", "content": "hi"}],
                            [{"role": "tool", "content": "x"}],
                            [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}],
                            [{"role": "assistant", "tool_calls": "x"}],
                            [{"role": "user", "content": "hi", "name": 5}],
                            [{"role": "user", "content": "hi"}] * 2000]
PROMPTS: list[Any] = [[], [1, 2, 3], [[1, 2], [3]], [[]], [-1], [10**30], ["a", "b"], ["a", 1], [[1], "a"],
                      [1.5], [True], [[1, 2]] * 200, "", "x" * 3000]
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=latin-1", "application/xml", "", "application/json\x7f",
                 "*/*"]
NON_JSON: list[bytes] = [b"", b"{", b"}", b"null", b"[]", b"1", b'"s"', b"true", b"\xff\xfe{}",
                         b"{'model': 'm'}", b'{"model": "m"} trailing', b"\xef\xbb\xbf{\"model\": \"m\"}",
                         b'{"model": "m", /* c */ "prompt": "x"}', b'{"model": "m",}', b"\x00" * 64,
                         '{"model": "m"}'.encode("utf-16"), b"model=m&prompt=x", b"NaN", b"[" * 5000,
                         b'{"a":' * 3000, b"{\"model\": \"m\", \"prompt\": \"\\ud800\"}"]
REQUEST_IDS: list[str | bytes] = ["", " ", "a" * 10_000, "../../x", "id with spaces", "é", b"\xff\xfe",
                                  "dup-id", "x" * 129, "a,b", "\t"]
ANY_VALUES: list[Any] = [*TYPE_VALUES, *EXTREMES, *STRINGS, *(v for vs in ODD.values() for v in vs)]
# A stored response's id, known once the stack runs: send() puts it in the path.
STORED_ID = "@STORED@"
SCHEDULER_BODY_KINDS = {"schedule", "release", "prefilled", "renew", "batch", "failure", "register"}


@dataclass
class Case:
    """One request: what it is (mutation), and what goes on the wire."""

    endpoint: Endpoint
    mutation: str
    method: str = "POST"
    headers: dict[str, str | bytes] = field(default_factory=dict)
    body: bytes = b""
    path_suffix: str = ""
    # How the body goes (FRAMINGS): "" as it is, with its Content-Length.
    framing: str = ""

    def reproducer(self, base: str) -> str:
        body = self.body if len(self.body) <= 400 else self.body[:200] + b"..." + self.body[-100:]
        hdrs = {k: (v if len(v) <= 80 else f"{v[:40]!r}...({len(v)} chars)") for k, v in self.headers.items()}
        return (f"{self.method} {base}{self.endpoint.path}{self.path_suffix}  headers={hdrs}  "
                f"body({len(self.body)} bytes)={body!r}")


def _encode(body: Any) -> bytes:
    # allow_nan: NaN/Infinity literals on purpose; ensure_ascii keeps a lone surrogate as "\ud800".
    return json.dumps(body).encode()


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _set_path(body: Any, rnd: random.Random, kind: str, value: Any) -> tuple[Any, str]:
    """Set a field (one of FIELDS[kind], or a batch operation's) to `value`."""
    name = rnd.choice(FIELDS[kind])
    if kind == "batch":
        op = rnd.randrange(len(body))
        body[op][name] = value
        return body, f"[{op}].{name}"
    body[name] = value
    return body, name


def mutate(endpoint: Endpoint, rnd: random.Random) -> Case:
    """A valid request of `endpoint` with one thing broken (sometimes two)."""
    kind = endpoint.kind
    body = valid_body(kind)
    case = Case(endpoint, "")
    mutations: list[tuple[str, Callable[[], None]]] = []

    def field_type() -> None:
        nonlocal body
        pool = TYPE_VALUES if rnd.random() < 0.6 else ANY_VALUES
        body, where = _set_path(body, rnd, kind, v := rnd.choice(pool))
        case.mutation = f"type {where}={_short(v)}"

    def missing() -> None:
        target = body[rnd.randrange(len(body))] if kind == "batch" else body
        if not target:
            case.mutation = "missing (nothing left)"
            return
        name = rnd.choice(sorted(target))
        del target[name]
        case.mutation = f"missing {name}"

    def extra() -> None:
        name = rnd.choice(["junk", "x" * 300, "", "\ud800", "model ", "__proto__", "constructor"])
        target = body[rnd.randrange(len(body))] if kind == "batch" else body
        target[name] = rnd.choice(TYPE_VALUES + EXTREMES)
        case.mutation = f"extra {name[:20]!r}"

    def extreme() -> None:
        nonlocal body
        body, where = _set_path(body, rnd, kind, v := rnd.choice(EXTREMES))
        case.mutation = f"extreme {where}={_short(v)}"

    def string() -> None:
        nonlocal body
        body, where = _set_path(body, rnd, kind, v := rnd.choice(STRINGS))
        case.mutation = f"string {where}={_short(v)}"

    def odd_option() -> None:
        name = rnd.choice(sorted(ODD))
        v = rnd.choice(ODD[name])
        target = body[0] if kind == "batch" else body
        target[name] = v
        if name == "stream_options":
            target["stream"] = rnd.random() < 0.7
        case.mutation = f"odd {name}={_short(v)}"

    def messages() -> None:
        what = rnd.randrange(3)
        if what == 0:
            body["messages"] = [{"role": rnd.choice(ROLES), "content": "hi"}]
            case.mutation = f"role {_short(body['messages'][0]['role'])}"
        elif what == 1:
            body["messages"] = [{"role": "user", "content": rnd.choice(CONTENTS)}]
            case.mutation = f"content {_short(body['messages'][0]['content'])}"
        else:
            body["messages"] = rnd.choice(MESSAGE_LISTS)
            case.mutation = f"messages {_short(body['messages'])}"
        if kind == "responses":  # its messages are `input` items
            body["input"] = body.pop("messages")
        elif kind == "completions":
            body["prompt"] = rnd.choice(PROMPTS)
            del body["messages"]
            case.mutation = f"prompt {_short(body['prompt'])}"

    def raw_deep() -> None:
        name = rnd.choice(FIELDS[kind])
        depth = rnd.choice([50, 500, 5000, 100_000])
        target = body[0] if kind == "batch" else body
        target[name] = "@@DEEP@@"
        case.body = _encode(body).replace(b'"@@DEEP@@"', _deep(depth).encode())
        case.mutation = f"deep {name} depth={depth}"

    def non_utf8() -> None:
        raw = _encode(body)
        at = raw.find(b'"', raw.find(b":") + 1)  # inside the first value's string, if any
        bad = rnd.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"])
        case.body = raw[:at + 1] + bad + raw[at + 1:] if at > 0 else raw + bad
        case.mutation = f"non-utf8 {bad!r}"

    def non_json() -> None:
        case.body = rnd.choice(NON_JSON)
        case.mutation = f"non-json {_short(case.body)}"

    def content_type() -> None:
        ct = rnd.choice(CONTENT_TYPES)
        case.headers["Content-Type"] = ct
        if rnd.random() < 0.3:
            case.headers["Content-Encoding"] = rnd.choice(["gzip", "br", "deflate", "identity, gzip", "x"])
        case.mutation = f"content-type {ct!r} {case.headers.get('Content-Encoding', '')}"

    def header() -> None:
        what = rnd.randrange(5)
        if what == 0:
            rid = rnd.choice(REQUEST_IDS)
            case.headers["X-Request-Id"] = rid
            case.mutation = f"x-request-id {_short(rid)}"
        elif what == 1:
            case.headers["X-Junk"] = "a" * rnd.choice([8000, 9000, 70_000])
            case.mutation = f"huge header {len(case.headers['X-Junk'])}"
        elif what == 2:
            for i in range(rnd.choice([50, 150])):
                case.headers[f"X-H{i}"] = "v" * 60
            case.mutation = f"{len(case.headers)} headers"
        elif what == 3:
            name = rnd.choice(["Authorization", "traceparent", "tracestate", "X-Session-Id",
                               "x-gateway-inference-fairness-id", "Cookie", "Origin", "Range",
                               "X-Forwarded-For", "Accept", "Accept-Encoding", "Expect"])
            value = rnd.choice(["", "Bearer", "Basic ===", "00-zz-zz-00", "x" * 5000, b"\xff\xfe",
                                "text/event-stream", "100-continue", "1.2.3.4, ::1, junk"])
            case.headers[name] = value
            case.mutation = f"header {name}={_short(value)}"
        else:
            case.method = rnd.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
            case.mutation = f"method {case.method}"

    def path() -> None:
        case.path_suffix = rnd.choice(["/", "//", "?x=%ff", "?model=%00", "/../x", "%20", "?stream=true",
                                       "%0a", "/%0d%0aX-Y:%20z", "%ff", "/%2e%2e"])
        case.mutation = f"path suffix {case.path_suffix!r}"

    def huge_body() -> None:
        size = rnd.choice([200_000, 2_000_000, 9_000_000])
        name = "prompt" if kind in ("completions", "tokenize") else rnd.choice(FIELDS[kind])
        target = body[0] if kind == "batch" else body
        target[name] = "word " * (size // 5)
        case.mutation = f"huge {name} {size} bytes"

    def stored() -> None:
        case.method = rnd.choice(["GET", "GET", "POST", "DELETE"])
        rid = rnd.choice([STORED_ID, STORED_ID, "resp_nothere", "", "%ff", "resp_" + "a" * 5000, "%00",
                          "..", "resp_%C3%A9", "resp_%ED%A0%80", "resp_x%2Fy", "resp_%0d%0aX:%20y"])
        tail = "/cancel" if case.method == "POST" else rnd.choice(["", "", "/junk", "/input_items"])
        case.path_suffix = rid + tail
        if rnd.random() < 0.3:
            case.path_suffix += rnd.choice(["?stream=true", "?stream=1&starting_after=-1", "?include=x",
                                            "?starting_after=" + "9" * 400, "?stream=%ff"])
        case.mutation = f"stored {case.method} {_short(case.path_suffix)}"

    mutations = [("type", field_type), ("missing", missing), ("extra", extra), ("extreme", extreme),
                 ("string", string), ("deep", raw_deep), ("non-utf8", non_utf8), ("non-json", non_json),
                 ("content-type", content_type), ("header", header), ("path", path)]
    if kind not in SCHEDULER_BODY_KINDS:
        mutations += [("odd", odd_option)] * 3
    if kind in ("chat", "responses", "tokenize", "completions"):
        mutations += [("messages", messages)] * 2
    if rnd.random() < 0.03:
        mutations = [("huge", huge_body)]
    if kind == "stored":
        mutations = [("stored", stored)] * 6 + [("header", header), ("type", field_type)]
    # Mostly one thing broken; sometimes two or three (a later one may undo an earlier one's
    # body: then only the later counts).
    applied = []
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        name, apply = rnd.choice(mutations)
        if name in ("deep", "non-utf8", "non-json") and applied:
            continue  # they write the bytes: last only
        apply()
        applied.append(case.mutation)
        if name in ("deep", "non-utf8", "non-json"):
            break
    case.mutation = " + ".join(applied)
    if rnd.random() < 0.15 and case.method not in ("GET", "OPTIONS"):
        case.framing = rnd.choice(sorted(FRAMINGS))
        case.mutation += f" [{case.framing}]"
    if not case.body and "non-json" not in case.mutation:
        case.body = _encode(body)
    if "Content-Type" not in case.headers:
        case.headers["Content-Type"] = "application/json"
    if endpoint.kind == "register":
        case.headers.setdefault("Authorization", f"Bearer {REGISTRATION_TOKEN}")
    return case


def _pieces(data: bytes, pause_s: float) -> Callable[[], Any]:
    """The body in three pieces, `pause_s` apart (chunked transfer encoding): the server reads
    its head, then the body as it comes."""
    async def gen() -> Any:
        step = max(1, len(data) // 3)
        for i in range(0, len(data), step):
            yield data[i:i + step]
            await asyncio.sleep(pause_s)
    return gen


_BOMB: list[Any] = []  # the compressor past the whitespace, and its output so far (made once)


def _bomb(body: bytes) -> bytes:
    """40 MB of JSON whitespace, then the body, gzipped to ~40 KB: past every service's body
    limit once inflated."""
    if not _BOMB:
        co = zlib.compressobj(9, zlib.DEFLATED, 31)
        _BOMB.extend([co, co.compress(b" " * 40_000_000)])
    co = _BOMB[0].copy()
    return _BOMB[1] + co.compress(body) + co.flush()


# How a body may go on the wire: (headers added, the body as sent).
FRAMINGS: dict[str, Callable[[bytes], tuple[dict[str, str], Any]]] = {
    "gzip": lambda b: ({"Content-Encoding": "gzip"}, gzip.compress(b)),
    "deflate": lambda b: ({"Content-Encoding": "deflate"}, zlib.compress(b)),
    # Not compressed, though it says so: refused at once, or (deflate) only at its end.
    "gzip-lie": lambda b: ({"Content-Encoding": "gzip"}, b),
    "deflate-lie": lambda b: ({"Content-Encoding": "deflate"}, b),
    "gzip-bomb": lambda b: ({"Content-Encoding": "gzip"}, _bomb(b)),
    "chunked": lambda b: ({}, _pieces(b, 0.02)()),
    "chunked-deflate-lie": lambda b: ({"Content-Encoding": "deflate"}, _pieces(b, 0.05)()),
}


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else f"{s[:40]}...({len(s)} chars)"
