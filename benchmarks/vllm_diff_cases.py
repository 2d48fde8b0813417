"""What benchmarks/vllm_diff_fuzz.py sends: seeded variants of a valid request to each endpoint
that a real client could plausibly send (loose types, odd values of the options, missing and
extra fields, message and prompt shapes, Content-Types, encodings, query strings, trailing
slashes, methods). Answers stay short (a few tokens, temperature 0) so that a CPU vLLM serves
hundreds of them in minutes and the text of two answers can be compared."""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODEL = "smollm2"

ENDPOINTS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "models": "/v1/models",
}
# How often each endpoint is drawn: generation endpoints carry most of the options.
WEIGHTS = {"completions": 5, "chat": 5, "responses": 3, "embeddings": 1, "tokenize": 2,
           "detokenize": 1, "models": 1}


@dataclass
class Case:
    kind: str  # a key of ENDPOINTS
    mutation: str
    method: str = "POST"
    path_suffix: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    # The parsed body where it is JSON (None: raw bytes), to tell whether the text must match.
    parsed: dict | None = None

    @property
    def path(self) -> str:
        return ENDPOINTS[self.kind] + self.path_suffix

    def reproducer(self) -> str:
        body = self.body if len(self.body) <= 300 else self.body[:300] + b"..."
        return f"{self.method} {self.path} headers={self.headers} body={body!r}"


def valid_body(kind: str) -> dict[str, Any]:
    """A request each endpoint takes; temperature 0 so that both answers have the same text."""
    return {
        "completions": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                        "temperature": 0},
        "chat": {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                 "temperature": 0},
        "responses": {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0,
                      "store": False},
        "embeddings": {"model": MODEL, "input": "hello there"},
        "tokenize": {"model": MODEL, "prompt": "hello there"},
        "detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
        "models": {},
    }[kind]


# Values a client might send for each option: the lax spellings vLLM takes and the mistakes it
# refuses. Token counts stay small: vLLM runs on two CPU cores.
ODD: dict[str, list[Any]] = {
    "stream": [True, False, "true", "false", "True", 1, 0, 1.0, None, "yes", "maybe", [], {}],
    "stream_options": [None, {}, {"include_usage": True}, {"include_usage": False},
                       {"include_usage": "true"}, {"include_usage": 1}, {"include_usage": None},
                       {"include_usage": True, "continuous_usage_stats": True},
                       {"continuous_usage_stats": True}, {"include_usage": "yes"}, "x", [], {"junk": 1}],
    "n": [1, 2, 3, "2", 2.0, 0, -1, None, "x", 1.5],
    "max_tokens": [1, 2, 8, "4", 4.0, 0, -1, None, 100_000, 2047, "x", 1.5],
    "max_completion_tokens": [2, "2", 0, None],
    "priority": [0, 1, -1, "1", "0", 1.0, 1.5, "x", None, True, 10**20],
    "model": [MODEL, "", None, "other-model", 5, [MODEL], MODEL.upper(), f" {MODEL}", True],
    "logprobs": [True, False, 0, 1, 5, 20, 21, -1, None, "true", "yes"],
    "top_logprobs": [0, 1, 5, 20, 21, -1, None, "2"],
    "echo": [True, False, "true", 1, None],
    "temperature": [0, 0.0, "0", 1, 2, 2.5, -0.1, None, "hot"],
    "top_p": [1, 0.5, 0, 1.5, None, "1"],
    "seed": [0, 1, -1, "1", 1.5, None, 2**64],
    "stop": ["", ".", ["."], [], None, 5, [5], "x" * 40],
    "response_format": [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                        {}, "json", {"type": "xml"}, None],
    "tools": [[], None, [{"type": "function", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              [{}], "x"],
    "tool_choice": ["none", "auto", "required", None, {"type": "function", "function": {"name": "f"}}, 5],
    "user": ["u1", "", None, 5],
    "presence_penalty": [0, 2, 2.5, -2.5, "1"],
    "logit_bias": [{}, {"1": 1}, {"1": 101}, {"x": 1}, None],
    "min_tokens": [0, 1, 2, -1, 10],
    "ignore_eos": [True, False, "true"],
    "suffix": ["", "end", None],
    "best_of": [1, 2, None, 0],
    "prompt_logprobs": [0, 1, None, -1],
    "add_special_tokens": [True, False, "false"],
    "return_token_strs": [True, False, None],
    "add_generation_prompt": [True, False, None],
    "encoding_format": ["float", "base64", "x", None],
    "dimensions": [None, 8, 0],
    "store": [True, False, None, "false"],
    "background": [False, None, "false"],
    "instructions": ["Be brief.", "", None, 5],
    "max_output_tokens": [1, 4, "4", 0, -1, None, 100_000],
    "text": [{"format": {"type": "text"}}, {}, None, "x"],
    "truncation": ["auto", "disabled", "x", None],
    "metadata": [{}, {"a": "b"}, None, "x"],
    "previous_response_id": [None, "", "resp_nothere"],
    "chat_template_kwargs": [{}, None, {"x": 1}, "x"],
    "tokens": [[], [1], [1, 2, 3], [-1], ["a"], [1.5], "1", None, [10**9]],
}
FIELDS: dict[str, list[str]] = {
    "completions": ["stream", "stream_options", "n", "max_tokens", "priority", "model", "logprobs",
                    "echo", "temperature", "top_p", "seed", "stop", "response_format", "user",
                    "presence_penalty", "logit_bias", "min_tokens", "ignore_eos", "suffix", "best_of",
                    "prompt_logprobs", "add_special_tokens"],
    "chat": ["stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "priority", "model",
             "logprobs", "top_logprobs", "echo", "temperature", "top_p", "seed", "stop", "response_format",
             "tools", "tool_choice", "user", "presence_penalty", "logit_bias", "min_tokens", "ignore_eos",
             "add_generation_prompt", "chat_template_kwargs"],
    "responses": ["stream", "model", "priority", "temperature", "top_p", "store", "background",
                  "instructions", "max_output_tokens", "text", "truncation", "metadata", "user",
                  "previous_response_id", "tools", "tool_choice", "top_logprobs"],
    "embeddings": ["model", "encoding_format", "dimensions", "user", "priority"],
    "tokenize": ["model", "add_special_tokens", "return_token_strs", "add_generation_prompt", "priority"],
    "detokenize": ["model", "tokens", "priority"],
    "models": [],
}
TYPE_VALUES: list[Any] = ["text", "", 0, 1, 1.5, True, False, None, [], {}, [1]]
MESSAGE_LISTS: list[Any] = [
    [], "hi", None, [{"role": "user"}], [{"content": "hi"}], [{"role": "system", "content": "Be brief."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": None}],
    [{"role": "user", "content": ""}], [{"role": "robot", "content": "hi"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi", "name": "bob"}], [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
]
PROMPTS: list[Any] = ["", "hi", ["hi", "there"], [1, 2, 3], [[1, 2], [3]], [], [[]], ["a", 1], None, 5,
                      [-1], "é" * 10]
INPUTS: list[Any] = ["", "hi", [], None, 5, [{"role": "user", "content": "hi"}],
                     [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                     [{"role": "user"}], ["hi"], ["a", "b"], [1, 2, 3]]
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=utf-8",
                 "application/json; charset=latin-1", "", "application/vnd.api+json", "*/*",
                 "APPLICATION/JSON"]
NON_JSON: list[bytes] = [b"", b"{", b"[]", b"null", b'"s"', b"1", b"{'model': 'x'}", b'{"a": 1,}',
                         b"\xef\xbb\xbf{}", b'{"model": "smollm2"} x', b"model=smollm2"]
QUERIES = ["?stream=true", "?model=smollm2", "?x=1", "?api-version=2024-02-01", "?", "?stream=false"]
METHODS = ["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 50 else s[:40] + f"...({len(s)} chars)"


def make_case(rnd: random.Random) -> Case:
    """One valid request with one to two things changed."""
    kind = rnd.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    body: dict[str, Any] = valid_body(kind)
    case = Case(kind, "", method="GET" if kind == "models" else "POST")
    raw: bytes | None = None
    changes: list[str] = []

    def odd() -> None:
        name = rnd.choice(FIELDS[kind])
        v = body[name] = rnd.choice(ODD[name])
        if name == "stream_options" and rnd.random() < 0.8:
            body["stream"] = True
        if name in ("logprobs", "top_logprobs") and kind == "chat" and rnd.random() < 0.5:
            body["logprobs" if name == "top_logprobs" else "top_logprobs"] = 2
        changes.append(f"{name}={_short(v)}")

    def type_swap() -> None:
        name = rnd.choice(FIELDS[kind] + [k for k in body if k != "model"])
        v = body[name] = rnd.choice(TYPE_VALUES)
        changes.append(f"type {name}={_short(v)}")

    def missing() -> None:
        if body:
            name = rnd.choice(sorted(body))
            del body[name]
            changes.append(f"no {name}")

    def extra() -> None:
        name = rnd.choice(["junk", "frequency", "mode", "extra_body", "request_id", "cache_salt"])
        v = body[name] = rnd.choice(["x", 1, None, {"a": 1}, True])
        changes.append(f"extra {name}={_short(v)}")

    def shape() -> None:
        if kind == "chat":
            v = body["messages"] = rnd.choice(MESSAGE_LISTS)
            changes.append(f"messages={_short(v)}")
        elif kind in ("completions", "tokenize"):
            v = body["prompt"] = rnd.choice(PROMPTS)
            changes.append(f"prompt={_short(v)}")
        elif kind in ("responses", "embeddings"):
            v = body["input"] = rnd.choice(INPUTS)
            changes.append(f"input={_short(v)}")
        elif kind == "detokenize":
            v = body["tokens"] = rnd.choice(ODD["tokens"])
            changes.append(f"tokens={_short(v)}")

    def stream_on() -> None:  # a stream, with or without usage, the most common client
        if kind not in ("completions", "chat", "responses"):
            return
        body["stream"] = True
        what = ["stream"]
        if kind != "responses":
            if rnd.random() < 0.5:
                body["stream_options"] = {"include_usage": True,
                                          "continuous_usage_stats": rnd.random() < 0.3}
                what.append(f"usage {body['stream_options']}")
            if rnd.random() < 0.3:
                body["n"] = 2
                what.append("n=2")
            if rnd.random() < 0.3:
                body.update({"logprobs": 1} if kind == "completions"
                            else {"logprobs": True, "top_logprobs": 1})
                what.append("logprobs")
            if kind == "completions" and rnd.random() < 0.2:
                body["echo"] = True
                what.append("echo")
        changes.append(" ".join(what))

    def content_type() -> None:
        ct = case.headers["Content-Type"] = rnd.choice(CONTENT_TYPES)
        changes.append(f"content-type {ct!r}")

    def query() -> None:
        case.path_suffix += rnd.choice(QUERIES)
        changes.append(f"query {case.path_suffix!r}")

    def slash() -> None:
        case.path_suffix = "/" + case.path_suffix
        changes.append("trailing slash")

    def method() -> None:
        case.method = rnd.choice(METHODS + (["POST"] if kind == "models" else []))
        changes.append(f"method {case.method}")

    def non_json() -> None:
        nonlocal raw
        raw = rnd.choice(NON_JSON)
        changes.append(f"body {_short(raw)}")

    def gzipped() -> None:
        case.headers["Content-Encoding"] = "gzip"
        changes.append("gzip")

    def request_id() -> None:
        rid = case.headers["X-Request-Id"] = rnd.choice(["abc", "id-1", "x" * 100, "a b"])
        changes.append(f"x-request-id {_short(rid)}")

    pool: list[Callable[[], None]] = [type_swap, missing, extra, content_type, query, slash, method,
                                      non_json, gzipped, request_id]
    if FIELDS[kind]:
        pool += [odd] * 8
    if kind != "models":
        pool += [shape] * 3 + [stream_on] * 2
    if kind == "models":
        pool = [query, slash, method, request_id, extra]
    for _ in range(rnd.choice([1, 1, 1, 2])):
        rnd.choice(pool)()
    case.mutation = " + ".join(changes) or "valid"
    if kind == "models" and case.method not in ("POST", "PUT", "PATCH"):
        body = {}
    if raw is None:
        case.parsed = body
        raw = json.dumps(body).encode() if body or case.method != "GET" else b""
    if case.headers.get("Content-Encoding") == "gzip":
        raw = gzip.compress(raw)
    case.body = raw
    if raw:
        case.headers.setdefault("Content-Type", "application/json")
    return case


def cases(seed: int, n: int) -> list[Case]:
    rnd = random.Random(seed)
    return [make_case(rnd) for _ in range(n)]
