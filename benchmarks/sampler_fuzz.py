"""Hostile sampling parameters against one real-model worker, with greedy canaries beside them.

    python -m benchmarks.sampler_fuzz --seed 1 --requests 300 --time-limit-s 600

Starts one `python -m inference_worker` (torch backend, SmolLM2 on CPU unless WORKER_TEST_MODEL /
WORKER_TEST_DEVICE say otherwise) on 127.0.0.1 with small limits (8 sequences, a 128-token
context, a small KV pool), so that its limits are reachable. Then sends N seeded requests, a few
at a time, each setting one to four sampling parameters to values at or past their edges
(temperatures of 0 and denormals, top_p / min_p that keep one token, top_k 0 / -1 / huge, a
logit bias on every token, penalties at their bounds or infinite, seeds at int64's ends,
thousands of stop strings, min_tokens against max_tokens, prompts and answers at the context
limit, n up to 128, echo with logprobs, guided-decoding options, out-of-vocabulary token ids,
NaN and Infinity literals, ...). Continuous batching puts them in the same forward and the same
sampler call as one another and as two greedy streaming "canary" requests (a completion and a
chat, temperature 0, a fixed prompt) that run all the while: their text must be the one they
gave alone before the run, every time.

Each hostile answer is checked: a 4xx in the OpenAI error shape where the request is invalid,
a proper answer (every choice ended by stop or length, numbers finite, streams ended by
[DONE] with no error event) where it is valid; never a 5xx or a hang. After the run: the worker
alive, a valid request answered, /metrics served, no traceback in its log. Every violation is
printed with a reproducer (`--replay I`: the same case alone, canaries beside it); the exit
status is 1 on any. Bounded: N requests, each under --client-timeout-s, dispatch stops at
--time-limit-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.fuzz_cases import Endpoint
from benchmarks.fuzz_checks import error_shape_problem, stream_problem
from benchmarks.fuzz_procs import Proc

MODEL = "smollm2"
VOCAB = 49152  # SmolLM2's (its random-weights copy for the GPU check has the same tokenizer)
EOS = 0  # <|endoftext|>
MAX_MODEL_LEN = 128
WORKER_FLAGS = ("--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-batched-tokens", "256")
KV_BLOCKS = 72  # 16 tokens each: 8 sequences of the whole context fit; fewer make preemptions
ENDPOINTS = {"completions": Endpoint("completions", "worker", "/v1/completions", "completions"),
             "chat": Endpoint("chat", "worker", "/v1/chat/completions", "chat")}
# Each well under 30 tokens; the canaries' own among them, so that hostile requests share their
# prompt's cached KV blocks.
PROMPTS = ["The three primary colors are", "hello there", "1, 2, 3,", "<|im_end|><|im_start|>user",
           "Once upon a time", " ", "def f(x):", "The capital of France is", "Name a fruit."]
TEXT_PROMPT_MAX_TOKENS = 30
BAD_SHARE = 0.12  # of the mutations, those that make a request invalid
CANARIES = {
    "completions": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True, "stream": True},
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12,
             "temperature": 0, "ignore_eos": True, "stream": True},
}


# ---- the plan ----------------------------------------------------------------------------------

@dataclass
class Case:
    index: int
    kind: str  # "completions" or "chat"
    body: dict[str, Any]
    labels: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)  # each mutation's: "ok", "bad" or "any"

    def encoded(self) -> bytes:
        # allow_nan: NaN and Infinity go out as the literals some JSON parsers take.
        return json.dumps(self.body, allow_nan=True).encode()


def _ids(rng: random.Random, n: int, top: int = VOCAB) -> list[int]:
    return [rng.randrange(top) for _ in range(n)]


# Each mutation changes the body and says whether the request stays valid ("ok"), is invalid
# ("bad") or may be either ("any": the worker may refuse what vLLM would take, or the reverse).
Mutation = tuple[str, Any, str]  # (field, value, verdict); field "" = a callable of the body

def _values(rng: random.Random, kind: str) -> list[Mutation]:
    chat = kind == "chat"
    return [
        ("temperature", rng.choice([0, -0.0, 5e-324, 1e-45, 1e-5, 9.99e-6, 1.0000001e-5, 2.0, 1.9999]), "ok"),
        ("temperature", rng.choice([-1e-300, 2.0000001, math.nan, math.inf, -math.inf, "0.5", True]), "bad"),
        ("top_p", rng.choice([5e-324, 1e-300, 1e-9, 0.5, 1.0]), "ok"),
        ("top_p", rng.choice([0, 0.0, -0.1, 1.0000001, math.nan, math.inf]), "bad"),
        ("top_k", rng.choice([0, -1, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**63 - 1, 10**30]), "ok"),
        ("top_k", rng.choice([-2, -(2**63), 1.0, "5"]), "bad"),
        ("min_p", rng.choice([0, 5e-324, 1e-300, 0.5, 0.999999, 1.0]), "ok"),
        ("min_p", rng.choice([-1e-9, 1.0000001, math.nan, math.inf]), "bad"),
        ("logit_bias", rng.choice([{str(EOS): 100.0}, {str(rng.randrange(VOCAB)): -100.0}, {},
                                   {str(VOCAB - 1): 100.0}, {"0": -100.0, "2": 100.0},
                                   {str(t): rng.choice([-100.0, 100.0]) for t in _ids(rng, 1000)}]), "ok"),
        ("", _bias_on_every_token, "ok"),
        ("logit_bias", rng.choice([{str(VOCAB): 1.0}, {"-1": 1.0}, {"1": 1e308}, {"1": math.inf},
                                   {"1": math.nan}, {"abc": 1.0}, {"1": "5"}, {str(2**70): 1.0}, [1],
                                   {"1" * 5000: 1.0}]),
         "bad"),
        ("presence_penalty", rng.choice([-2.0, 2.0, 0.0, -1.9999999]), "ok"),
        ("frequency_penalty", rng.choice([-2.0, 2.0, 0.0]), "ok"),
        ("presence_penalty", rng.choice([2.0000001, -1e308, math.nan, math.inf]), "bad"),
        ("frequency_penalty", rng.choice([-2.0000001, 1e308, math.nan]), "bad"),
        ("", _penalties_at_edges, "ok"),
        ("repetition_penalty", rng.choice([5e-324, 1e-39, 1e-3, 1e3, 1e308, math.inf, 1.0]), "ok"),
        ("repetition_penalty", rng.choice([0, 0.0, -1.0, math.nan, -math.inf]), "bad"),
        ("seed", rng.choice([0, -1, 2**63 - 1, -(2**63), 12345]), "ok"),
        ("seed", rng.choice([2**63, -(2**63) - 1, 2**64, 1.5, "1"]), "bad"),
        *((("logprobs", True, "ok"), ("top_logprobs", rng.choice([0, 1, 20]), "ok")) if chat else
          (("logprobs", rng.choice([0, 1, 5, 20]), "ok"),)),
        ("logprobs", rng.choice([21, -1, 10**9]) if not chat else rng.choice(["yes", 1]), "bad"),
        ("top_logprobs", 21, "bad") if chat else ("logprobs", 2**63, "bad"),
        ("prompt_logprobs", rng.choice([0, 1, 20]), "ok"),
        ("prompt_logprobs", rng.choice([21, -1]), "bad"),
        ("", _n_choices, "ok"),
        ("n", rng.choice([129, 0, -1, 2**31]), "bad"),
        ("best_of", rng.choice([2, 0, 5]), "bad"),
        ("best_of", 1, "ok"),
        ("", _thousands_of_stops, "ok"),
        ("stop", rng.choice(["", "e", ["e", "a", " ", "o"], ["\u00e9\u4e2d\U0001f600"] * 50, "x" * 100_000,
                            [" the", "\n"]]), "ok"),
        ("stop", rng.choice([[""], ["a", ""], 5, [None], [["a"]]]), "bad"),
        ("stop_token_ids", rng.choice([list(range(VOCAB)), [2**40], [-1], [VOCAB + 5], [EOS, 2], []]), "ok"),
        ("stop_token_ids", rng.choice([["1"], [1.5], 7]), "bad"),
        ("", _min_tokens_cases, "ok"),
        ("min_tokens", rng.choice([-1, 2**62, "3"]), "bad"),
        ("ignore_eos", True, "ok"),
        ("include_stop_str_in_output", True, "ok"),
        ("", _max_tokens_at_limit, "ok"),
        ("max_tokens", rng.choice([2**31, -1, MAX_MODEL_LEN + 1, 1.5]), "bad"),
        *(() if chat else (("", _prompt_cases, "ok"), ("", _echo_cases, "ok"))),
        ("response_format", rng.choice([{"type": "text"}, {}]), "ok"),
        ("response_format", rng.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {}},
                                        "text", {"type": None}]), "bad"),
        ("guided_choice", [], "ok"),
        ("allowed_token_ids", [], "ok"),
        ("", _guided_cases, "bad"),
        ("priority", rng.choice([2**63, -(2**70), 0]), "ok"),
        ("", _stream_options, "ok"),
        *((("", _assistant_prefill, "ok"),) if chat else ()),
    ]


# Mutations that set several fields together, or large values: f(rng, body, kind) -> (label, verdict).

def _bias_on_every_token(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    bias = rng.choice([-100.0, 100.0])
    body["logit_bias"] = dict.fromkeys(map(str, range(VOCAB)), bias)
    return f"logit_bias {bias} on every token", "ok"


def _thousands_of_stops(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    body["stop"] = ["".join(rng.choice("abcdefghij ,.") for _ in range(rng.randint(1, 4)))
                    for _ in range(3000)]
    return "3000 stop strings", "ok"


def _penalties_at_edges(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    body.update(presence_penalty=rng.choice([-2.0, 2.0]), frequency_penalty=rng.choice([-2.0, 2.0]),
                repetition_penalty=rng.choice([5e-324, math.inf, 1e308]))
    return "all three penalties at their edges", "ok"


def _n_choices(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    n = rng.choice([2, 4, 8, 16, 128])
    body["n"] = n
    body["max_tokens"] = min(body.get("max_tokens") or 2, 2 if n > 16 else 4)
    return f"n={n}", "ok"


def _min_tokens_cases(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    mt = body.setdefault("max_tokens", 4)
    case = rng.randrange(4)
    if case == 0:
        body["min_tokens"] = mt
        return "min_tokens = max_tokens", "ok"
    if case == 1:  # expectation() finds it invalid, unless a later mutation changes max_tokens
        body["min_tokens"] = mt + 1
        return "min_tokens > max_tokens", "ok"
    if case == 2:  # nothing may come out before min_tokens: every token is a stop token
        body.update(min_tokens=mt, stop_token_ids=list(range(VOCAB)))
        return "min_tokens with every token a stop token id", "any"
    body.update(min_tokens=mt, logit_bias={str(EOS): 100.0}, ignore_eos=False)
    return "min_tokens against a logit bias pushing EOS", "ok"


def _max_tokens_at_limit(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    if kind == "chat":
        body.pop("max_tokens", None)  # the context's rest
        return "chat with no max_tokens (up to the context limit)", "ok"
    plen = rng.choice([1, 8, MAX_MODEL_LEN // 2, MAX_MODEL_LEN - 2])
    body["prompt"] = _ids(rng, plen)
    over = rng.random() < 0.3
    body["max_tokens"] = MAX_MODEL_LEN - plen + (1 if over else 0)
    # One over: expectation() finds it (from the prompt's length and max_tokens as they end up).
    return f"max_tokens at the context limit ({plen}-token prompt{', one over' if over else ''})", "ok"


def _prompt_cases(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    cases: list[tuple[str, Any, str]] = [
        ("prompt of max_model_len - 1 ids", _ids(rng, MAX_MODEL_LEN - 1), "ok"),
        ("prompt of max_model_len ids", _ids(rng, MAX_MODEL_LEN), "bad"),
        ("prompt with an id == vocab", [1, 2, VOCAB], "bad"),
        ("prompt with an id 2**63", [1, 2**63], "bad"),
        ("prompt with an id -1", [1, -1, 2], "bad"),
        ("empty id list", [], "bad"),
        ("list of an empty list", [[]], "bad"),
        ("two id prompts", [[1, 2, 3], [EOS]], "ok"),
        ("four text prompts", PROMPTS[:4], "ok"),
        ("a text and an id prompt", ["a", [1]], "bad"),
        ("a text prompt past the context", "word " * 400, "bad"),
        ("EOS ids only", [EOS] * 20, "ok"),
        ("top ids", [VOCAB - 1] * 5, "ok"),
        ("prompt true", True, "bad"),
        # The most choices a request may start (prompts x n): 8 x 128, each one token.
        ("8 prompts x n=128", PROMPTS[:4] * 2, "ok"),
        ("9 prompts x n=128 (past 1024 choices)", PROMPTS[:3] * 3, "bad"),
        ("max_tokens null", None, "ok"),
    ]
    label, value, verdict = rng.choice(cases)
    if label == "max_tokens null":
        body["max_tokens"] = None  # the context's rest
        return label, verdict
    body["prompt"] = value
    if label == "prompt of max_model_len - 1 ids":
        body["max_tokens"] = 1
    if "n=128" in label:
        body.update(n=128, max_tokens=1)
    return label, verdict


def _echo_cases(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    body["echo"] = True
    body["logprobs"] = rng.choice([0, 5, 20])
    if rng.random() < 0.5:
        body["max_tokens"] = 0
        return "echo with logprobs, max_tokens 0", "ok"
    return "echo with logprobs", "ok"


def _guided_cases(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    name, value = rng.choice([("guided_json", {}), ("guided_choice", ["a"]), ("guided_regex", ""),
                              ("structured_outputs", {"json": {}}), ("allowed_token_ids", [1]),
                              ("bad_words", ["a"]), ("guided_grammar", "root ::= 'a'"),
                              ("logits_processors", ["x"]), ("use_beam_search", True)])
    body[name] = value
    return f"{name}={json.dumps(value)}", "bad"


def _stream_options(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return "stream_options with usage in every chunk", "ok"  # refused without stream: expectation()


def _assistant_prefill(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    body["messages"] = [*body["messages"], {"role": "assistant", "content": "Sure, "}]
    body.update(continue_final_message=True, add_generation_prompt=False, echo=True)
    return "assistant prefill with echo", "ok"


def base_body(rng: random.Random, kind: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(1, 6),
                            "temperature": rng.choice([0, 0.7, 1.0, 1.5]), "stream": rng.random() < 0.4}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    return body


_UNSET = object()


def plan(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        kind = rng.choice(["completions", "chat"])
        case = Case(index, kind, base_body(rng, kind))
        values = _values(rng, kind)
        good = [v for v in values if v[2] != "bad"]
        bad = [v for v in values if v[2] == "bad"]
        # Mostly values the worker takes (what the batch then carries), now and then one it refuses.
        picks = [rng.choice(bad if rng.random() < BAD_SHARE else good) for _ in range(rng.randint(1, 4))]
        touched: list[set[str]] = []
        for name, value, verdict in picks:
            before = dict(case.body)
            if name:
                case.body[name] = value
                label = f"{name}={_short(value)}"
            else:
                label, verdict = value(rng, case.body, kind)
            fields = {k for k in before.keys() | case.body.keys()
                      if before.get(k, _UNSET) is not case.body.get(k, _UNSET)}
            # A mutation whose every field a later one set again no longer says anything.
            for i, earlier in enumerate(touched):
                if earlier and earlier <= fields:
                    case.verdicts[i] = "ok"
            touched.append(fields)
            case.labels.append(label)
            case.verdicts.append(verdict)
        cases.append(case)
    return cases


def _short(value: Any) -> str:
    text = json.dumps(value, allow_nan=True)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} chars)"


# ---- what a case must get ----------------------------------------------------------------------

def expectation(case: Case) -> str:
    """"ok", "bad" or "any" for the whole body: a mutation's "bad" wins; otherwise the rules that
    tie fields together (they are what the worker checks across fields)."""
    if "bad" in case.verdicts:
        return "bad"
    b = case.body
    chat = case.kind == "chat"
    max_tokens = b.get("max_completion_tokens", b.get("max_tokens")) if chat else b.get("max_tokens", 16)
    if expected_choices(case) > 1024 and isinstance(b.get("n", 1), int):
        return "bad"
    echo_only = not chat and b.get("echo") and max_tokens == 0
    if b.get("stream") and b.get("prompt_logprobs") is not None:
        return "bad"  # no stream chunk carries them
    if chat and b.get("top_logprobs") and not b.get("logprobs"):
        return "bad"
    if b.get("stream_options") and not b.get("stream"):
        return "bad"
    if not chat and max_tokens == 0 and not b.get("echo"):
        return "bad"
    if b.get("best_of") == 1 and b.get("n", 1) > 1:
        return "any"  # vLLM refuses best_of < n; taken here as it changes nothing
    effective = 1 if echo_only else max_tokens
    if isinstance(effective, int) and b.get("min_tokens", 0) > effective:
        return "bad"
    prompt_len = _prompt_len(b) if not chat else None
    if isinstance(effective, int) and prompt_len is not None and prompt_len + effective > MAX_MODEL_LEN:
        return "bad"
    if isinstance(effective, int) and prompt_len is None and (
            effective > MAX_MODEL_LEN - TEXT_PROMPT_MAX_TOKENS):
        return "any"  # a text prompt's length is the tokenizer's
    return "any" if "any" in case.verdicts else "ok"


def _prompt_len(body: dict) -> int | None:
    """The longest prompt's token count where the prompt is ids, else None."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return len(p)
    if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        return max(len(x) for x in p)
    return None


def expected_choices(case: Case) -> int:
    p = case.body.get("prompt")
    prompts = len(p) if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p) else 1
    return prompts * case.body.get("n", 1)


def _non_finite(text: str) -> str | None:
    """A NaN or Infinity literal in an answer (not JSON; a client's parser may choke)."""
    found: list[str] = []
    json.loads(text, parse_constant=found.append)
    return f"non-finite number in the answer: {found[0]}" if found else None


def answer_problem(case: Case, status: int, data: bytes, content_type: str) -> str | None:
    expect = expectation(case)
    if status >= 500 or status < 200:
        return f"status {status}: {data[:300]!r}"
    if status >= 400:
        if expect == "ok":
            return f"a valid request refused with {status}: {data[:300]!r}"
        return error_shape_problem(data)
    if expect == "bad":
        return f"an invalid request answered {status}"
    text = data.decode(errors="replace")
    if content_type.startswith("text/event-stream"):
        problem = stream_problem(ENDPOINTS[case.kind], text)
        if problem:
            return problem
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        finished: dict[int, str] = {}
        for event in events[:-1]:
            if (problem := _non_finite(event)) is not None:
                return problem
            obj = json.loads(event)
            if "error" in obj:
                return f"error event in an accepted stream: {event[:300]}"
            for choice in obj.get("choices") or ():
                if choice.get("finish_reason") is not None:
                    finished[choice["index"]] = choice["finish_reason"]
        reasons = [finished.get(i) for i in range(expected_choices(case))]
        usage = next((json.loads(e).get("usage") for e in reversed(events[:-1]) if '"usage"' in e), None)
    else:
        if (problem := _non_finite(text)) is not None:
            return problem
        obj = json.loads(text)
        reasons = [c.get("finish_reason") for c in obj.get("choices") or ()]
        if len(reasons) != expected_choices(case):
            return f"{len(reasons)} choices, expected {expected_choices(case)}"
        usage = obj.get("usage")
    if any(r not in ("stop", "length") for r in reasons):
        return f"choices ended with {reasons}"
    return _length_problem(case, usage)


def _length_problem(case: Case, usage: dict | None) -> str | None:
    """Every choice's tokens between min_tokens (nothing ends an answer before them, and the
    context holds them: the worker checked) and max_tokens, by the usage's total."""
    b = case.body
    if not usage or (case.kind == "completions" and b.get("echo")):
        return None  # no usage sent; echo counts the prompt's tokens in its own way
    choices, tokens = expected_choices(case), usage.get("completion_tokens", 0)
    least = b.get("min_tokens", 0) * choices
    limit = (b.get("max_completion_tokens", b.get("max_tokens")) if case.kind == "chat"
             else b.get("max_tokens", 16))
    most = limit * choices if isinstance(limit, int) else MAX_MODEL_LEN * choices
    if not least <= tokens <= most:
        return (f"{tokens} completion tokens for {choices} choices, min_tokens {b.get('min_tokens', 0)}, "
                f"max_tokens {limit}")
    return None


# ---- sending -----------------------------------------------------------------------------------

@dataclass
class Outcome:
    case: Case
    status: int
    problem: str | None


async def post(client: httpx.AsyncClient, url: str, content: bytes, timeout_s: float
               ) -> tuple[int, bytes, str]:
    async with asyncio.timeout(timeout_s):
        async with client.stream("POST", url, content=content,
                                 headers={"Content-Type": "application/json"}) as r:
            data = b"".join([chunk async for chunk in r.aiter_raw()])
            return r.status_code, data, r.headers.get("Content-Type", "")


async def send_case(client: httpx.AsyncClient, base: str, case: Case, timeout_s: float) -> Outcome:
    try:
        status, data, ctype = await post(client, base + ENDPOINTS[case.kind].path, case.encoded(), timeout_s)
    except TimeoutError:
        return Outcome(case, 0, f"no complete answer in {timeout_s} s (hang)")
    except httpx.HTTPError as exc:
        return Outcome(case, 0, f"connection dropped: {type(exc).__name__}: {exc}")
    try:
        return Outcome(case, status, answer_problem(case, status, data, ctype))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # an answer not in its shape
        return Outcome(case, status, f"unparsable answer ({type(exc).__name__}: {exc}): {data[:300]!r}")


async def canary_text(client: httpx.AsyncClient, base: str, kind: str, timeout_s: float) -> str:
    """The streamed text of a canary; raises ValueError on any problem with its answer."""
    status, data, _ = await post(client, base + ENDPOINTS[kind].path, json.dumps(CANARIES[kind]).encode(),
                                 timeout_s)
    text = data.decode(errors="replace")
    if status != 200 or stream_problem(ENDPOINTS[kind], text):
        raise ValueError(f"status {status}: {text[-300:]!r}")
    parts, reasons = [], []
    for line in text.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        obj = json.loads(line[5:])
        if "error" in obj:
            raise ValueError(f"error event: {line[:300]}")
        for choice in obj["choices"]:
            delta = choice.get("text") if kind == "completions" else choice["delta"].get("content")
            parts.append(delta or "")
            reasons.append(choice.get("finish_reason"))
    if reasons[-1:] != ["length"]:
        raise ValueError(f"ended with {reasons[-1:]}, not length (ignore_eos, 12 tokens)")
    return "".join(p or "" for p in parts)


CANARY_PROBLEMS_KEPT = 6


@dataclass
class CanaryLog:
    runs: int = 0
    beside: int = 0  # runs that started with hostile requests in flight
    problems: list[str] = field(default_factory=list)


async def canary_loop(client: httpx.AsyncClient, base: str, kind: str, reference: str, stop: asyncio.Event,
                      log: CanaryLog, timeout_s: float, in_flight: list[int]) -> None:
    while not stop.is_set():
        beside = sorted(in_flight)
        log.beside += bool(beside)
        try:
            text = await canary_text(client, base, kind, timeout_s)
        except (ValueError, TimeoutError, httpx.HTTPError) as exc:
            log.problems.append(f"{kind} canary failed beside cases {beside}: {type(exc).__name__}: {exc}")
            if len(log.problems) >= CANARY_PROBLEMS_KEPT:
                return  # a dead engine fails each at once: the loop would spin
            continue
        finally:
            log.runs += 1
        if text != reference:
            log.problems.append(f"{kind} canary beside cases {beside} gave {text!r}, alone {reference!r}")


async def run_cases(base: str, cases: list[Case], concurrency: int, time_limit_s: float,
                    timeout_s: float) -> tuple[list[Outcome], CanaryLog, dict[str, str]]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        references = {}
        for kind in CANARIES:  # alone, twice: greedy must already agree with itself
            first, second = [await canary_text(client, base, kind, timeout_s) for _ in range(2)]
            if first != second:
                raise RuntimeError(f"the {kind} canary is not deterministic alone: {first!r} vs {second!r}")
            references[kind] = first
        stop, log, in_flight = asyncio.Event(), CanaryLog(), []
        canaries = [asyncio.create_task(canary_loop(client, base, kind, ref, stop, log, timeout_s, in_flight))
                    for kind, ref in references.items()]
        gate = asyncio.Semaphore(concurrency)
        deadline = time.monotonic() + time_limit_s

        async def one(case: Case) -> Outcome | None:
            async with gate:
                if time.monotonic() > deadline:
                    return None
                in_flight.append(case.index)
                try:
                    return await send_case(client, base, case, timeout_s)
                finally:
                    in_flight.remove(case.index)

        try:
            outcomes = [o for o in await asyncio.gather(*(one(c) for c in cases)) if o is not None]
        finally:
            stop.set()
            await asyncio.gather(*canaries)
        return outcomes, log, references


def preemptions(worker: Proc) -> str:
    """The worker's vllm:num_preemptions_total, for the summary (the run is harder with some)."""
    try:
        text = httpx.get(worker.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return "?"
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:num_preemptions_total")]
    return lines[0].rsplit(" ", 1)[-1] if lines else "?"


def after_run_problems(worker: Proc, timeout_s: float) -> list[str]:
    problems = []
    if not worker.alive():
        return [f"worker exited with {worker.p.returncode}"]
    try:
        r = httpx.post(worker.url + "/v1/completions", timeout=timeout_s,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0})
        if r.status_code != 200 or len(r.json()["choices"]) != 1:
            problems.append(f"a valid request after the run: {r.status_code} {r.text[:200]}")
        m = httpx.get(worker.url + "/metrics", timeout=timeout_s)
        if m.status_code != 200 or "vllm:num_requests_running" not in m.text:
            problems.append(f"/metrics after the run: {m.status_code}")
        h = httpx.get(worker.url + "/health", timeout=timeout_s)
        if h.status_code != 200:
            problems.append(f"/health after the run: {h.status_code}")
    except httpx.HTTPError as exc:
        problems.append(f"after the run: {type(exc).__name__}: {exc}")
    output = worker.output()
    if "Traceback" in output:
        at = output.index("Traceback")
        problems.append(f"traceback in the worker's log:\n{output[max(0, at - 500):at + 3000]}")
    return problems


def start_worker(start_timeout_s: float, kv_blocks: int = KV_BLOCKS) -> Proc:
    model = os.environ.get("WORKER_TEST_MODEL", MODEL)
    device = ("--device", os.environ["WORKER_TEST_DEVICE"]) if "WORKER_TEST_DEVICE" in os.environ else ()
    worker = Proc.start("worker", "inference_worker", "--model", model, "--served-model-name", MODEL,
                        "--host", "127.0.0.1", *WORKER_FLAGS, "--num-kv-blocks", str(kv_blocks), *device)
    try:
        worker.wait_ready(time.monotonic() + start_timeout_s)
    except BaseException:
        worker.stop()
        raise
    return worker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--time-limit-s", type=float, default=600.0, help="no case is sent after it")
    ap.add_argument("--concurrency", type=int, default=3, help="hostile requests at a time (2-4)")
    ap.add_argument("--client-timeout-s", type=float, default=180.0)
    ap.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help="the worker's KV pool (16-token blocks)")
    ap.add_argument("--replay", type=int, action="append", default=[],
                    help="send only the plan's case I (repeatable), canaries beside it")
    args = ap.parse_args(argv)
    cases = plan(args.seed, args.requests)
    if args.replay:
        cases = [cases[i] for i in args.replay]
    started = time.monotonic()
    worker = start_worker(180.0, args.kv_blocks)
    failed = True
    try:
        outcomes, canaries, references = asyncio.run(run_cases(
            worker.url, cases, args.concurrency, args.time_limit_s, args.client_timeout_s))
        after = after_run_problems(worker, args.client_timeout_s)
        preempted = preemptions(worker)
        violations = [o for o in outcomes if o.problem]
        failed = bool(violations or canaries.problems or after)
    finally:
        worker.stop()
        if failed:
            print(f"worker log kept: {worker.log}")
        else:
            worker.log.unlink(missing_ok=True)
    by_status: dict[int, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    print(f"sent {len(outcomes)} requests in {time.monotonic() - started:.0f} s (seed {args.seed}, "
          f"{args.concurrency} at a time, {args.kv_blocks} KV blocks, {preempted} preemptions); "
          f"statuses: {dict(sorted(by_status.items()))}")
    print(f"canaries: {canaries.runs} runs, {canaries.beside} started beside hostile requests; "
          f"references {references}")
    for o in violations:
        c = o.case
        print(f"\nVIOLATION case {c.index} ({c.kind}; {'; '.join(c.labels)}): {o.problem}\n"
              f"  reproduce: python -m benchmarks.sampler_fuzz --seed {args.seed} --requests {args.requests} "
              f"--replay {c.index}\n  body: {c.encoded()[:400].decode(errors='replace')}")
    for p in canaries.problems:
        print(f"\nVIOLATION canary: {p}")
    for p in after:
        print(f"\nVIOLATION after the run: {p}")
    print(f"\nviolations: {len(violations)} in answers, {len(canaries.problems)} canary, "
          f"{len(after)} after the run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
