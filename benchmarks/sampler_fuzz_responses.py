"""benchmarks/sampler_fuzz.py's Responses API cases (`POST /v1/responses`): the hostile sampling
values on that API's own fields (temperature, top_p, max_output_tokens, top_logprobs, text,
background, previous_response_id, ...) and on the vLLM extras it passes on to the chat request
it builds (top_k, min_p, penalties, seeds, stops, min_tokens, ...), streamed and whole, some in
the background (then polled until they end), some continuing a response stored before the run;
and what each must get back.

Where the case is invalid: a 4xx in the OpenAI shape. Where valid: a whole response `completed`
or `incomplete` (the latter only with `incomplete_details` saying max_output_tokens), one
assistant message, finite numbers, a usage that adds up and sits between min_tokens and
max_output_tokens; a stream of `event:` / `data:` pairs whose types agree, numbered 0, 1, ...,
starting with response.created, with no error event, ending with exactly one terminal event
(its response checked as a whole one) and deltas that add up to the text.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from benchmarks.sampler_fuzz_cases import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    VOCAB,
    Case,
    Mutation,
    _bias_on_every_token,
    _guided_cases,
    _non_finite,
    _penalties_at_edges,
    _thousands_of_stops,
    _values,
    apply_mutations,
    expectation,
    pick_mutations,
)

PATH = "/v1/responses"
# previous_response_id values the run fills in: responses it stored before the hostile ones.
STORED = ("@stored0", "@stored1")
STORED_SEEDS = [{"model": MODEL, "input": "Name a fruit.", "max_output_tokens": 4, "temperature": 0},
                {"model": MODEL, "input": "And another one?", "max_output_tokens": 4, "temperature": 0,
                 "previous_response_id": STORED[0]}]
# What the stored conversations, the input and the instructions may take of the context (the
# second stored one with the chat template: 73 tokens with a 4-token input, seed 6's case 363).
STORED_TOKENS = 96
# The chat request's sampling options a Responses body passes on as they are (vLLM's extras).
_SHARED = {"temperature", "top_p", "top_k", "min_p", "logit_bias", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "prompt_logprobs", "best_of", "stop", "stop_token_ids",
           "min_tokens", "ignore_eos", "include_stop_str_in_output", "guided_choice", "allowed_token_ids",
           "priority"}
_SHARED_MUTATIONS = (_bias_on_every_token, _thousands_of_stops, _penalties_at_edges, _guided_cases)
_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _responses_values(rng: random.Random) -> list[Mutation]:
    shared = [m for m in _values(rng, "chat") if m[0] in _SHARED or m[1] in _SHARED_MUTATIONS]
    return [
        *shared,
        ("max_output_tokens", rng.choice([1, None, MAX_MODEL_LEN // 2]), "ok"),
        ("max_output_tokens", rng.choice([0, -1, 1.5, "4", True, 2**31, 2**63, MAX_MODEL_LEN + 1]), "bad"),
        ("", _max_output_at_limit, "any"),
        ("", _min_tokens_cases, "ok"),
        ("top_logprobs", rng.choice([0, None]), "ok"),
        ("top_logprobs", rng.choice([1, 20, 21, -1]), "bad"),
        ("text", rng.choice([{"format": {"type": "text"}}, {}, None]), "ok"),
        ("text", rng.choice([{"format": {"type": "json_object"}}, "text",
                             {"format": {"type": "json_schema", "schema": {}}}]), "bad"),
        ("tools", [], "ok"),
        ("tools", [{"type": "function", "name": "f", "parameters": {}}], "bad"),
        ("include", [], "ok"),
        ("include", ["message.output_text.logprobs"], "bad"),
        ("truncation", rng.choice(["auto", "disabled", None]), "ok"),
        ("truncation", rng.choice(["middle", 1]), "bad"),
        ("reasoning", rng.choice([{"effort": "low"}, None, {"effort": 1e308}]), "ok"),
        # Options the response repeats: a NaN there is none of its JSON's business.
        ("", _non_finite_echoed, "bad"),
        ("metadata", rng.choice([{"k": "v"}, {}, {str(i): "x" * 10 for i in range(16)}]), "ok"),
        ("metadata", rng.choice([{"k": 1}, ["k"]]), "bad"),
        ("store", False, "ok"),
        ("background", True, "ok"),
        ("", _background_unstored, "bad"),
        ("previous_response_id", rng.choice(STORED), "ok"),
        ("previous_response_id", rng.choice(["resp_" + "0" * 32, "", 5, "x" * 5000]), "bad"),
        # Short: the stored conversation and these come before the input in a 128-token context.
        ("instructions", rng.choice(["Answer in one word.", "", "\u00e9\u4e2d\U0001f600" * 3, None]), "ok"),
        ("instructions", rng.choice([5, ["a"]]), "bad"),
        ("input", rng.choice([[{"role": "assistant", "content": "Sure, "}], "", " " * 3,
                              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                              [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "output_text", "text": "b"}]}]]), "ok"),
        ("input", rng.choice([[], [1, 2], [{"type": "function_call", "name": "f"}], [{"role": "tool"}],
                              [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                              None]), "bad"),
        ("stream", None, "ok"),
        # Chat fields a Responses body has no use for: dropped (responses_protocol._NOT_FOR_CHAT);
        # vLLM may refuse them instead.
        (*rng.choice([("n", rng.choice([2, 129, -1])), ("max_tokens", 2**31), ("echo", True),
                      ("logprobs", rng.choice([True, "yes", 21])), ("stream_options", {"x": 1}),
                      ("response_format", {"type": "json_object"})]), "any"),
    ]


def _max_output_at_limit(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    # A text prompt's length is the chat template's and the tokenizer's: expectation() says "any".
    body["max_output_tokens"] = MAX_MODEL_LEN - rng.choice([1, 20, 40])
    return f"max_output_tokens {body['max_output_tokens']} (near the context limit)", "any"


def _min_tokens_cases(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    mt = body.setdefault("max_output_tokens", 4) or 4
    case = rng.randrange(3)
    if case == 0:
        body.update(min_tokens=mt, max_output_tokens=mt)
        return "min_tokens = max_output_tokens", "ok"
    if case == 1:  # expectation() finds it invalid, unless a later mutation changes one of them
        body.update(min_tokens=mt + 1, max_output_tokens=mt)
        return "min_tokens > max_output_tokens", "ok"
    body.update(min_tokens=mt, max_output_tokens=mt, stop_token_ids=list(range(VOCAB)))
    return "min_tokens with every token a stop token id", "any"


def _non_finite_echoed(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    name, value = rng.choice([("text", {"verbosity": math.nan}), ("reasoning", {"effort": math.inf}),
                              ("text", {"format": {"type": "text", "x": [-math.inf]}})])
    body[name] = value
    return f"{name}={json.dumps(value)}", "bad"


def _background_unstored(rng: random.Random, body: dict, kind: str) -> tuple[str, str]:
    body.update(background=True, store=False)
    return "background without store", "bad"


def _base_body(rng: random.Random) -> dict[str, Any]:
    prompt = rng.choice(PROMPTS)
    shape = rng.random()
    inp: Any = (prompt if shape < 0.5 else [{"role": "user", "content": prompt}] if shape < 0.8 else
                [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}])
    return {"model": MODEL, "input": inp, "max_output_tokens": rng.randint(1, 6),
            "temperature": rng.choice([0, 0.7, 1.0, 1.5]), "stream": rng.random() < 0.4}


def responses_plan(seed: int, count: int, first_index: int) -> list[Case]:
    """`count` Responses cases, numbered from `first_index`, from an rng of their own (a seed's
    completions and chat cases stay what they were)."""
    rng = random.Random(f"responses-{seed}")
    cases = []
    for index in range(first_index, first_index + count):
        case = Case(index, "responses", _base_body(rng))
        picks = pick_mutations(rng, _responses_values(rng))
        # A quarter each in the background and continuing a stored response (besides the picks).
        if rng.random() < 0.25:
            picks.insert(0, ("background", True, "ok"))
        if rng.random() < 0.25:
            picks.insert(0, ("previous_response_id", rng.choice(STORED), "ok"))
        apply_mutations(rng, case, picks, "responses")
        cases.append(case)
    return cases


def encoded(case: Case, stored_ids: dict[str, str]) -> bytes:
    data = case.encoded()
    for placeholder, real in stored_ids.items():
        data = data.replace(json.dumps(placeholder).encode(), json.dumps(real).encode())
    return data


# ---- what a case must get ----------------------------------------------------------------------

def responses_expectation(case: Case) -> str:
    """The chat request the worker builds from the body, judged as a chat case (its cross-field
    rules: min_tokens against the output's length, prompt_logprobs in a stream, ...)."""
    b = case.body
    chat = {k: v for k, v in b.items() if k in _SHARED}
    chat.update(messages=[], max_tokens=b.get("max_output_tokens"), stream=bool(b.get("stream")))
    verdict = expectation(Case(case.index, "chat", chat, case.labels, case.verdicts))
    if b.get("background") is True and b.get("store") is False:
        return "bad"  # two mutations, each valid alone
    limit = b.get("max_output_tokens")
    if verdict == "ok" and b.get("previous_response_id") and isinstance(limit, int) and (
            limit > MAX_MODEL_LEN - STORED_TOKENS):
        return "any"  # the stored conversation's tokens come before the input's
    return verdict


def is_background(case: Case) -> bool:
    return case.body.get("background") is True and case.body.get("store") is not False


def response_problem(case: Case, obj: Any, live_ok: bool = False) -> str | None:
    """None when `obj` is a proper response object (`live_ok`: one still queued or running)."""
    if not isinstance(obj, dict) or obj.get("object") != "response":
        return f"not a response object: {json.dumps(obj)[:300]}"
    status = obj.get("status")
    if live_ok and status in ("queued", "in_progress"):
        return None
    if status not in ("completed", "incomplete"):
        return f"response {status}: {json.dumps(obj.get('error'))[:300]}"
    incomplete = obj.get("incomplete_details")
    if (status == "incomplete") != (incomplete == {"reason": "max_output_tokens"}):
        return f"status {status} with incomplete_details {incomplete}"
    output = obj.get("output")
    if (not isinstance(output, list) or len(output) != 1 or output[0].get("type") != "message"
            or output[0].get("role") != "assistant"
            or [p.get("type") for p in output[0].get("content", ())] != ["output_text"]
            or not isinstance(output[0]["content"][0].get("text"), str)):
        return f"output is not one assistant message with one text part: {json.dumps(output)[:300]}"
    usage = obj.get("usage") or {}
    counts = [usage.get(k) for k in ("input_tokens", "output_tokens", "total_tokens")]
    if (not all(isinstance(n, int) and n >= 0 for n in counts) or counts[0] + counts[1] != counts[2]
            or not counts[0]):
        return f"usage does not add up: {usage}"
    least, limit = case.body.get("min_tokens", 0), case.body.get("max_output_tokens")
    most = limit if isinstance(limit, int) else MAX_MODEL_LEN
    if not least <= counts[1] <= most:
        return f"{counts[1]} output tokens, min_tokens {least}, max_output_tokens {limit}"
    return None


def events_problem(case: Case, text: str) -> str | None:
    """None when `text` is a well-formed Responses event stream, from its first event."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    if not blocks:
        return "stream with no events"
    kinds, datas = [], []
    for i, block in enumerate(blocks):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" not in lines or "data" not in lines:
            return f"event {i} lacks its event or data line: {block[:200]!r}"
        if (problem := _non_finite(lines["data"])) is not None:
            return problem
        data = json.loads(lines["data"])
        if data.get("type") != lines["event"] or data.get("sequence_number") != i:
            return (f"event {i} ({lines['event']}) has type {data.get('type')} "
                    f"number {data.get('sequence_number')}")
        kinds.append(lines["event"])
        datas.append(data)
    if "error" in kinds:
        return f"error event in an accepted stream: {json.dumps(datas[kinds.index('error')])[:300]}"
    terminals = sum(k in _TERMINAL for k in kinds)
    if kinds[0] != "response.created" or terminals != 1 or kinds[-1] not in _TERMINAL:
        return f"events {kinds[:3]}...{kinds[-3:]}: not created first and one terminal event last"
    deltas = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    final = datas[-1].get("response")
    if (problem := response_problem(case, final)) is not None:
        return problem
    text = final["output"][0]["content"][0]["text"]
    if deltas != text:
        return f"the deltas {deltas[:100]!r} are not the final text {text[:100]!r}"
    return None
