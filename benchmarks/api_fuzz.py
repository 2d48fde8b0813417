"""Adversarial inputs against the product's HTTP APIs, on real processes.

Starts two sim workers, a scheduler over them and a gateway on 127.0.0.1, then sends `--requests`
seeded requests, each a valid OpenAI (or scheduler wire) request with one to three things broken:
a field of the wrong JSON type, missing or unknown, an extreme number (negative, 0, 1e308, NaN,
Infinity, a 400-digit int), an empty, huge or unencodable string, deep nesting, bytes that are not
UTF-8, a body that is not JSON, a wrong Content-Type or Content-Encoding, odd chat messages and
content parts, odd stream / stream_options / n / best_of / logprobs / stop / logit_bias / seed /
response_format / tools values, odd headers (X-Request-Id, Expect, huge ones, many), odd paths
and methods; one in seven also goes framed oddly (FRAMINGS: gzip, deflate, a Content-Encoding
that lies, a gzip bomb, chunked in paced pieces). They go to the gateway's /v1/chat/completions,
/v1/completions, /v1/responses (and its stored responses), /v1/embeddings, /tokenize and
/detokenize, straight to one worker's same endpoints, and to the scheduler's request endpoints
(/v1/schedule, /v1/release, /v1/prefilled, /v1/renew, /v1/batch, /v1/workers/{id}/failure,
POST /v1/workers).

Each answer is checked:
- no 5xx, except 503 in the OpenAI error shape (a worker or gateway that is draining or out of
  room answers so by design, and clients retry it) and the scheduler's 503 `{"wait": true, ...}`
  on /v1/schedule and in /v1/batch (its wire protocol's "every worker is saturated":
  scheduler/protocol.py); every other status is allowed: 2xx, 404, 405, 408, 413, 417, ...;
- a 4xx body in the OpenAI error shape {"error": {"message", "type", "param", "code"}};
- a 2xx JSON body parses; a stream ends properly (`data: [DONE]`, or for /v1/responses a
  terminal event) or with an error event; /v1/batch's inner answers follow the same rules;
- an answer within `--client-timeout-s` (else: a hang), and no connection dropped unanswered.
  A drop is looked into before it counts (send_checked): a request answered on a new connection
  (its kept-alive one closed under it) or, sent in paced pieces, answered before its body ended
  (then the connection closed under the rest: a reset) is a note, not a violation.
After the run every process must be alive, a valid request to each endpoint must still get 200,
and no process log may hold a 'Traceback'. Prints counts per endpoint and status and each
violation with its request (method, URL, headers, body); exits 1 on any violation, and then keeps
the processes' logs.

`python -m benchmarks.api_fuzz --seed 1 --requests 2000 --time-limit-s 300`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "m"
REGISTRATION_TOKEN = "fuzz-registration-token"
# More than any answer here (9 MB of prompt tokenizes to 14 MB of ids): past it, not read on.
MAX_STREAM_BYTES = 64 << 20


# ---- the processes ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A child process, its output kept in a temp file (read for tracebacks at the end)."""

    name: str
    url: str
    p: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, name: str, module: str, *args: str) -> Proc:
        port = _free_port()
        log = Path(tempfile.mkstemp(prefix=f"fuzz-{name}-", suffix=".log")[1])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            p = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args], cwd=REPO,
                                 stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return cls(name, f"http://127.0.0.1:{port}", p, log)

    def alive(self) -> bool:
        return self.p.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited at start:\n{self.output()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code < 500:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.alive():
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


@dataclass
class Stack:
    workers: list[Proc]
    scheduler: Proc
    gateway: Proc

    @property
    def procs(self) -> list[Proc]:
        return [*self.workers, self.scheduler, self.gateway]


@contextlib.contextmanager
def sim_stack(start_timeout_s: float = 120.0, keep_logs: Callable[[], bool] = lambda: False
              ) -> Iterator[Stack]:
    """Two sim workers (tiny profile) serving MODEL, a scheduler over them, a gateway in front.
    Their logs are deleted after, unless keep_logs() says otherwise then."""
    procs: list[Proc] = []
    try:
        deadline = time.monotonic() + start_timeout_s
        workers = [Proc.start(f"worker{i}", "inference_worker", "--backend", "sim", "--sim-profile",
                              "tiny", "--served-model-name", MODEL) for i in range(2)]
        procs += workers
        for w in workers:
            w.wait_ready(deadline)
        sched = Proc.start("scheduler", "scheduler", "--workers", ",".join(w.url for w in workers),
                           "--scrape-interval-ms", "100", "--registration-token", REGISTRATION_TOKEN)
        procs.append(sched)
        sched.wait_ready(deadline)
        # Sessions by header and fair queueing on: their headers are read, and fuzzed too.
        gw = Proc.start("gateway", "router", "--scheduler", sched.url, "--session-header", "x-session-id",
                        "--fair-queueing")
        procs.append(gw)
        gw.wait_ready(deadline)
        yield Stack(workers, sched, gw)
    finally:
        for p in procs:
            p.stop()
        if keep_logs():
            print("process logs kept: " + ", ".join(f"{p.name} {p.log}" for p in procs))
        else:
            for p in procs:
                p.log.unlink(missing_ok=True)


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


# ---- checking the answers ------------------------------------------------------------------

@dataclass
class Outcome:
    status: int  # 0: no answer
    problem: str | None  # a violation, or None
    note: str | None = None  # worth a look, not a violation


def error_shape_problem(data: bytes) -> str | None:
    """None when `data` is an OpenAI error body."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return f"error body is not JSON: {data[:200]!r}"
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return f"error body has no error object: {data[:200]!r}"
    missing = [k for k in ("message", "type", "param", "code") if k not in err]
    if missing or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"error object lacks {missing or 'a string message/type'}: {data[:200]!r}"
    return None


def _status_problem(endpoint: Endpoint, status: int, data: bytes) -> str | None:
    if status == 503 and endpoint.kind == "schedule":
        with contextlib.suppress(ValueError):
            if json.loads(data).get("wait") is True:
                return None  # the scheduler's "every worker is saturated", by its protocol
    if status >= 500 and status != 503:
        return f"status {status}: {data[:300]!r}"
    if status >= 400:
        return error_shape_problem(data)
    return None


def _batch_problem(data: bytes) -> str | None:
    try:
        answers = json.loads(data)
    except ValueError:
        return f"batch answer is not JSON: {data[:200]!r}"
    for i, (status, body) in enumerate(answers):
        if status == 503 and isinstance(body, dict) and body.get("wait") is True:
            continue
        if status >= 500 and status != 503:
            return f"batch operation {i}: status {status}"
        if status >= 400 and error_shape_problem(json.dumps(body).encode()):
            return f"batch operation {i}: {error_shape_problem(json.dumps(body).encode())}"
    return None


_TERMINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed", "error")


def stream_problem(endpoint: Endpoint, text: str) -> str | None:
    """None when an event stream ended properly: `data: [DONE]` (chat, completions) or a terminal
    event (the Responses API), else with an error event."""
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    if not events:
        return "stream with no events"
    last = events[-1]
    if last == "[DONE]":
        return None
    try:
        obj = json.loads(last)
    except ValueError:
        return f"stream ends with an unparsable event: {last[:200]!r}"
    if isinstance(obj, dict) and ("error" in obj or obj.get("type") in _TERMINAL_RESPONSE_EVENTS):
        return None
    return f"stream ends without [DONE] or an error: {last[:200]!r}"


async def send(client: httpx.AsyncClient, base: str, case: Case, timeout_s: float,
               stored_id: str = "resp_none") -> Outcome:
    url = base + case.endpoint.path + case.path_suffix.replace(STORED_ID, stored_id)
    # Text that is not ASCII goes as its UTF-8 bytes (httpx encodes str headers as ASCII).
    headers = {k: v if isinstance(v, bytes) or v.isascii() else v.encode() for k, v in case.headers.items()}
    content: Any = case.body.replace(STORED_ID.encode(), stored_id.encode()) if case.method not in (
        "GET", "OPTIONS") else None
    if case.framing and content is not None:
        added, content = FRAMINGS[case.framing](content)
        headers.update(added)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(case.method, url, headers=headers, content=content) as r:
                chunks, size = [], 0
                async for chunk in r.aiter_raw():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_STREAM_BYTES:
                        return Outcome(r.status_code, f"answer over {MAX_STREAM_BYTES} bytes")
                data = b"".join(chunks)
                if r.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                status = r.status_code
                problem = _status_problem(case.endpoint, status, data)
                if problem is None and status < 300 and status != 204 and case.method != "OPTIONS":
                    if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                        problem = stream_problem(case.endpoint, data.decode(errors="replace"))
                    elif case.endpoint.kind == "batch":
                        problem = _batch_problem(data)
                    else:
                        try:
                            json.loads(data)
                        except ValueError:
                            problem = f"2xx body is not JSON: {data[:200]!r}"
                if status == 200 and case.endpoint.kind in ("schedule", "batch"):
                    await _release_leases(client, base, data)
                return Outcome(status, problem)
    except TimeoutError:
        return Outcome(0, f"no complete answer in {timeout_s} s (hang)")
    except httpx.LocalProtocolError as exc:
        return Outcome(-1, None if "header" in str(exc).lower() else f"client refused: {exc}")
    except httpx.HTTPError as exc:
        return Outcome(0, f"connection dropped without an answer: {type(exc).__name__}: {exc}")


async def send_checked(client: httpx.AsyncClient, base: str, case: Case, timeout_s: float,
                       stored_id: str) -> Outcome:
    """send(); a connection dropped unanswered is sent again once, on a new connection. A server
    may close a kept-alive connection between two requests (HTTP lets it), and a request sent
    on it as it closes is lost: clients retry then. The same request dropped on a fresh
    connection too is the violation; answered there, a note."""
    out = await send(client, base, case, timeout_s, stored_id)
    if out.status != 0 or out.problem is None or "dropped" not in out.problem:
        return out
    if case.framing.startswith("chunked") or (case.framing and len(case.body) > 1 << 20):
        return await _answered_mid_body(base, case, timeout_s, out)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as fresh:
        again = await send(fresh, base, case, timeout_s, stored_id)
    if again.problem is None:
        again.note = f"{out.problem}; on a new connection: {again.status}"
    return again


async def _answered_mid_body(base: str, case: Case, timeout_s: float, dropped: Outcome) -> Outcome:
    """A body sent in paced pieces (or a large one), the connection dropped: a server that
    refuses a request while its body still comes (a decoding error, a header it cannot parse)
    answers, then closes the connection, and the client's next bytes meet a reset, which may
    discard the answer before the client reads it. Sent again in three pieces, reading after
    each: a 4xx in the OpenAI shape there is a note (the answer was sent); anything else the
    violation."""
    host, port = base.removeprefix("http://").split(":")
    added, framed = FRAMINGS[case.framing](case.body)
    data = framed if isinstance(framed, bytes) else case.body  # a paced one: its pieces' bytes
    headers = {**case.headers, **added, "Host": host, "Transfer-Encoding": "chunked"}
    head = f"{case.method} {case.endpoint.path}{case.path_suffix} HTTP/1.1\r\n".encode()
    for k, v in headers.items():
        head += k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()) + b"\r\n"
    step = max(1, len(data) // 3)
    chunks = [b"%x\r\n%b\r\n" % (len(p), p) for p in
              (data[i:i + step] for i in range(0, len(data), step))] + [b"0\r\n\r\n"]
    chunks[0] = head + b"\r\n" + chunks[0]
    raw = b""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                for chunk in chunks:
                    writer.write(chunk)
                    try:
                        raw = await asyncio.wait_for(reader.read(1 << 20), 2.0)
                        break  # answered (or closed) before the next piece
                    except TimeoutError:
                        continue
                while raw and b"\r\n\r\n" in raw and not raw.rstrip().endswith(b"}"):
                    more = await reader.read(1 << 20)
                    if not more:
                        break
                    raw += more
            finally:
                writer.close()
    except (TimeoutError, OSError) as exc:
        return Outcome(0, f"{dropped.problem}; sent again piece by piece: {exc!r}")
    status_line, _, rest = raw.partition(b"\r\n")
    parts = status_line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    body = rest.partition(b"\r\n\r\n")[2]
    problem = _status_problem(case.endpoint, status, body) if status else "no answer"
    if status < 400 or problem:
        return Outcome(status, f"{dropped.problem}; sent again piece by piece: {status} {problem or ''}")
    return Outcome(status, None, f"answered {status} while the body still came, then the connection "
                                 "closed under the rest of the upload (a reset)")


async def _stored_response(gateway: str) -> str:
    """A response the worker stores, for the stored-response calls to name."""
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(gateway + "/v1/responses", json={**valid_body("responses"), "store": True})
        r.raise_for_status()
        return r.json()["id"]


async def _release_leases(client: httpx.AsyncClient, base: str, data: bytes) -> None:
    """Give back leases the fuzz took (schedule calls that got a worker): left, they would hold
    room until their TTL and the gateway's requests would queue behind them."""
    with contextlib.suppress(ValueError, httpx.HTTPError):
        obj = json.loads(data)
        bodies = [obj] if isinstance(obj, dict) else [b for _, b in obj if isinstance(b, dict)]
        for b in bodies:
            if "lease_id" in b:
                await client.post(base + "/v1/release", json={"lease_id": b["lease_id"], "ok": True})


# ---- the run ---------------------------------------------------------------------------------

@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)  # (endpoint, status)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sent: int = 0


def plan(seed: int, n: int) -> list[Case]:
    rnd = random.Random(seed)
    return [mutate(rnd.choice(ENDPOINTS), rnd) for _ in range(n)]


async def fuzz(stack: Stack, cases: list[Case], time_limit_s: float, timeout_s: float,
               concurrency: int) -> Report:
    report = Report()
    stored_id = await _stored_response(stack.gateway.url)
    bases = {"gateway": stack.gateway.url, "worker": stack.workers[0].url, "scheduler": stack.scheduler.url}
    deadline = time.monotonic() + time_limit_s
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for c in cases:
        queue.put_nowait(c)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        async def runner() -> None:
            while not queue.empty() and time.monotonic() < deadline:
                case = queue.get_nowait()
                base = bases[case.endpoint.server]
                out = await send_checked(client, base, case, timeout_s, stored_id)
                report.sent += 1
                report.counts[(case.endpoint.name, out.status)] += 1
                if out.note:
                    report.notes.append(f"[{case.endpoint.name}] {case.mutation}: {out.note}")
                if out.problem:
                    report.violations.append(f"[{case.endpoint.name}] {case.mutation}: {out.problem}\n"
                                             f"    reproduce: {case.reproducer(base)}")
        await asyncio.gather(*(runner() for _ in range(concurrency)))
    return report


def final_checks(stack: Stack, timeout_s: float) -> list[str]:
    """Every process alive, a valid request to each endpoint answered, no traceback logged."""
    problems = [f"{p.name} is dead (exit {p.p.returncode})" for p in stack.procs if not p.alive()]
    with httpx.Client(timeout=timeout_s) as client:
        for ep in ENDPOINTS:
            if ep.kind in ("embeddings", "release", "prefilled", "renew", "failure", "register", "stored"):
                continue  # no valid call answers 200 here (no embeddings model; made-up leases)
            base = {"gateway": stack.gateway.url, "worker": stack.workers[0].url,
                    "scheduler": stack.scheduler.url}[ep.server]
            body = valid_body(ep.kind)
            try:
                r = client.post(base + ep.path, json=body)
                status = r.status_code
            except httpx.HTTPError as exc:
                problems.append(f"[{ep.name}] a valid request failed after the run: {exc!r}")
                continue
            if status != 200:
                problems.append(f"[{ep.name}] a valid request got {status} after the run: {r.text[:300]}")
            elif ep.kind in ("schedule", "batch"):
                asyncio.run(_release_after(base, r.content))
            if ep.kind == "chat" and status == 200:  # and a stream
                with client.stream("POST", base + ep.path, json={**body, "stream": True}) as s:
                    problem = stream_problem(ep, s.read().decode(errors="replace"))
                if problem:
                    problems.append(f"[{ep.name}] a valid stream after the run: {problem}")
        try:  # a response stored now is there to read (through the gateway: it finds its worker)
            rid = asyncio.run(_stored_response(stack.gateway.url))
            r = client.get(f"{stack.gateway.url}/v1/responses/{rid}")
            if r.status_code != 200:
                problems.append(f"[gw stored] reading a stored response got {r.status_code}: {r.text[:300]}")
        except httpx.HTTPError as exc:
            problems.append(f"[gw stored] storing or reading a response failed after the run: {exc!r}")
    for p in stack.procs:
        out = p.output()
        at = out.find("Traceback")
        if at >= 0:
            problems.append(f"{p.name}'s log holds a Traceback:\n{out[max(0, at - 500):at + 3000]}")
    return problems


async def _release_after(base: str, data: bytes) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        await _release_leases(client, base, data)


def print_report(report: Report, problems: list[str], elapsed_s: float) -> None:
    print(f"sent {report.sent} requests in {elapsed_s:.1f} s")
    by_endpoint: dict[str, Counter] = {}
    for (name, status), count in report.counts.items():
        by_endpoint.setdefault(name, Counter())[status] = count
    print(f"{'endpoint':<20} answers by status (0: none, -1: the client would not send it)")
    for name in sorted(by_endpoint):
        statuses = ", ".join(f"{s}: {c}" for s, c in sorted(by_endpoint[name].items()))
        print(f"{name:<20} {statuses}")
    print(f"violations: {len(report.violations)} in answers, {len(problems)} after the run")
    for v in report.violations:
        print("  " + v)
    for p in problems:
        print("  " + p)
    if report.notes:
        print(f"notes (not violations): {len(report.notes)}")
        for n in report.notes:
            print("  " + n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--time-limit-s", type=float, default=300.0, help="no request is sent past it")
    ap.add_argument("--client-timeout-s", type=float, default=20.0, help="past it, an answer is a hang")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args(argv)
    cases = plan(args.seed, args.requests)
    t0 = time.monotonic()
    failed = False
    with sim_stack(keep_logs=lambda: failed) as stack:
        report = asyncio.run(fuzz(stack, cases, args.time_limit_s, args.client_timeout_s, args.concurrency))
        elapsed = time.monotonic() - t0
        problems = final_checks(stack, args.client_timeout_s)
        failed = bool(report.violations or problems)
    print_report(report, problems, elapsed)
    return 1 if report.violations or problems else 0


if __name__ == "__main__":
    sys.exit(main())
