"""benchmarks/sampler_fuzz.py's plan: the worker's limits, the seeded hostile cases (sampling
parameters at or past their edges), and what each case must get back."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from benchmarks.fuzz_cases import Endpoint
from benchmarks.fuzz_checks import error_shape_problem, stream_problem

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
    return [make_case(rng, index) for index in range(count)]


def make_case(rng: random.Random, index: int) -> Case:
    """One completions or chat case (the HTTP plan's, and the WebSocket's bodies)."""
    kind = rng.choice(["completions", "chat"])
    case = Case(index, kind, base_body(rng, kind))
    values = _values(rng, kind)
    apply_mutations(rng, case, pick_mutations(rng, values), kind)
    _keep_affordable(case)
    return case


# The most tokens a valid case may ask for (choices x max_tokens). With FCFS, a request's choices
# all go before anything sent after it: seed 2's case 226 (n=128, then max_tokens 120 for its
# 8-token prompt) held every seat of this CPU worker for over 3 minutes, and the canaries and
# cases behind it met their client timeout (vLLM queues the same way: slow, not wrong).
TOKEN_BUDGET = 2048


def _keep_affordable(case: Case) -> None:
    """Cut max_tokens of a valid case past TOKEN_BUDGET (2 of the 3,900 HTTP cases of seeds 1-13)."""
    b = case.body
    if expectation(case) == "bad" or not isinstance(b.get("n", 1), int) or b.get("echo"):
        return
    name = "max_completion_tokens" if case.kind == "chat" and "max_completion_tokens" in b else "max_tokens"
    limit = b.get(name, 16 if case.kind == "completions" else None)
    limit = limit if isinstance(limit, int) and limit > 0 else MAX_MODEL_LEN  # None: the context's rest
    choices = expected_choices(case)
    if choices * limit > TOKEN_BUDGET:
        least = b.get("min_tokens", 0)
        b[name] = max(1, TOKEN_BUDGET // choices, least if isinstance(least, int) else 0)
        case.labels.append(f"{name} cut to {b[name]} (the fuzz's token budget)")


def pick_mutations(rng: random.Random, values: list[Mutation]) -> list[Mutation]:
    """One to four of `values`: mostly ones the worker takes (what the batch then carries), now
    and then one it refuses."""
    good = [v for v in values if v[2] != "bad"]
    bad = [v for v in values if v[2] == "bad"]
    return [rng.choice(bad if rng.random() < BAD_SHARE else good) for _ in range(rng.randint(1, 4))]


def apply_mutations(rng: random.Random, case: Case, picks: list[Mutation], kind: str) -> None:
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
