"""The worker's OpenAI API against a real `python -m inference_worker` (real model, 127.0.0.1),
driven by the official `openai` client, httpx for bad input and aiohttp for the WebSocket."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import socket

import aiohttp
import httpx
import openai
import pytest

from inference_worker.server.openai_api import MAX_DETOKENIZE_TOKENS
from tests.worker.conftest import wait_for
from tests.worker.model_under_test import RANDOM_WEIGHTS

pytestmark = pytest.mark.slow
MODEL = "smollm2"
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def worker(shared_torch_worker):
    return shared_torch_worker


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_completion(client) -> openai.types.Completion:
    return client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )


def test_completion_non_stream_and_stream_agree(client, greedy_completion) -> None:
    done = greedy_completion
    assert done.object == "text_completion" and done.model == MODEL
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    assert done.choices[0].text

    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_non_stream_and_stream_agree(client) -> None:
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert done.object == "chat.completion"
    message = done.choices[0].message
    assert message.role == "assistant" and message.content
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens <= 10

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    # Without include_usage there is no usage chunk.
    plain = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, stream=True
        )
    )
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_stop_string_ends_the_answer_before_it(client, greedy_completion) -> None:
    full = greedy_completion.choices[0].text
    # A stop string whose first occurrence is inside the answer, not at its start.
    k = next(
        i for i in range(1, len(full) - 1) if full[i : i + 2].strip() and full.find(full[i : i + 2]) == i
    )
    stop = full[k : k + 2]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:k]


def test_token_id_prompt_matches_text_prompt(worker, client, greedy_completion) -> None:
    tok = httpx.post(f"{worker.base_url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) == greedy_completion.usage.prompt_tokens
    assert tok["max_model_len"] == 2048
    out = client.completions.create(
        model=MODEL, prompt=tok["tokens"], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == greedy_completion.choices[0].text
    detok = httpx.post(f"{worker.base_url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == PROMPT


def test_tokenize_messages_counts_the_chat_prompt(worker, client) -> None:
    tok = httpx.post(f"{worker.base_url}/tokenize", json={"messages": MESSAGES}).json()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    assert tok["count"] == chat.usage.prompt_tokens


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_add_special_tokens_is_taken_and_smollm2_adds_none(worker, client, add_special_tokens) -> None:
    """vLLM's add_special_tokens, either way, on both endpoints: SmolLM2's tokenizer adds no
    special tokens, so the prompt is the same tokens (the sim's tokenizer adds a BOS: there the
    answers differ, tests/sim/test_sim_worker.py)."""
    extra = {"add_special_tokens": add_special_tokens}
    tok = httpx.post(f"{worker.base_url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert httpx.post(f"{worker.base_url}/tokenize",
                      json={"model": MODEL, "prompt": PROMPT, **extra}).json()["tokens"] == tok["tokens"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra)
    assert out.usage.prompt_tokens == tok["count"]
    chat_tok = httpx.post(f"{worker.base_url}/tokenize", json={"messages": MESSAGES, **extra}).json()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=extra)
    assert chat.usage.prompt_tokens == chat_tok["count"]
    default = httpx.post(f"{worker.base_url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat_tok["tokens"] == default["tokens"]


def test_seeded_sampling_is_reproducible(client) -> None:
    def sample() -> str:
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=1.0,
            top_p=0.9,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    assert sample() == sample()


def test_include_stop_str_in_output_and_min_p_are_applied_not_ignored(worker, greedy_completion) -> None:
    """vLLM's include_stop_str_in_output and min_p change the answer: honoured (they used to
    be accepted and silently ignored), stream and non-stream alike."""
    text = greedy_completion.choices[0].text
    stop = text[4:7]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "include_stop_str_in_output": True}
    done = httpx.post(worker.api_url + "/completions", json=body, timeout=60).json()["choices"][0]
    assert done["text"] == text[: text.index(stop) + len(stop)] and done["finish_reason"] == "stop"
    with httpx.stream("POST", worker.api_url + "/completions", json={**body, "stream": True},
                      timeout=60) as r:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"]
                           for line in r.iter_lines() if line.startswith("data: {"))
    assert streamed == done["text"]
    # min_p 1 keeps only the likeliest token: at any temperature the answer is the greedy one.
    hot = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 2.0, "min_p": 1.0,
           "ignore_eos": True, "seed": 5}
    answer = httpx.post(worker.api_url + "/completions", json=hot, timeout=60).json()
    assert answer["choices"][0]["text"] == text
    bad = httpx.post(worker.api_url + "/completions", json={**hot, "min_p": 1.5}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_p"


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_chat_logprobs_stream_and_non_stream_through_the_openai_client(worker, client) -> None:
    """OpenAI's chat shape: one entry per answer token with its bytes and N alternatives,
    likeliest first; the stream carries the same entries as the whole answer."""
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 6
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy took the likeliest
        assert entry.logprob == alternatives[0] <= 0
    assert "".join(e.token for e in content) == done.choices[0].message.content
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}
    events = _events(worker.api_url + "/chat/completions", body)
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk precedes every token
    streamed = [e for ev in events for e in (ev["choices"][0]["logprobs"] or {}).get("content", [])]
    # The same entries. Values only to float noise: the second request finds the first's prompt
    # in the prefix cache and computes a shorter prefill, which sums in another order (run
    # alone, this test saw differences of 1e-6).
    whole = [e.model_dump() for e in content]
    assert [_shape(e) for e in streamed] == [_shape(e) for e in whole]
    assert _values(streamed) == pytest.approx(_values(whole), abs=1e-4)
    # Without logprobs: none in the answer.
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def _shape(entry: dict) -> tuple:
    """A chat logprobs entry without its numbers: its token, bytes and alternatives."""
    return entry["token"], entry["bytes"], [(alt["token"], alt["bytes"]) for alt in entry["top_logprobs"]]


def _values(entries: list[dict]) -> list[float]:
    return [v for e in entries for v in (e["logprob"], *(alt["logprob"] for alt in e["top_logprobs"]))]


def test_completion_logprobs_legacy_shape(worker, greedy_completion) -> None:
    # A long stop string that never matches holds the text back for many steps: those steps' tokens
    # still send their logprobs.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "stop": ["#" * 40]}
    choice = httpx.post(worker.api_url + "/completions", json=body, timeout=60).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == greedy_completion.choices[0].text
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert "".join(lp["tokens"]) == text
    assert all(text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[token] == logprob == max(top.values())  # the sampled token is among them
        assert len(top) <= 3
    events = _events(worker.api_url + "/completions", body)
    parts = [e["choices"][0]["logprobs"] for e in events]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]  # offsets run on
    assert [t for p in parts for t in p["token_logprobs"]] == lp["token_logprobs"]


def test_completion_echo_puts_the_prompt_and_its_logprobs_first(worker, greedy_completion) -> None:
    """OpenAI's echo, as vLLM answers it: the prompt before the answer, its tokens' logprobs
    before the answer's (the first prompt token has none); max_tokens 0 with echo is the
    prompt alone (scoring a text); streamed, the prompt comes with the first chunk."""
    url = worker.api_url + "/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1}
    choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    n = httpx.post(worker.base_url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()["count"]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT + greedy_completion.choices[0].text
    assert len(lp["tokens"]) == n + 12 and "".join(lp["tokens"][:n]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and lp["text_offset"][n] == len(PROMPT)
    plain = httpx.post(url, json={**body, "echo": False}, timeout=60).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][n:] == plain["token_logprobs"]  # the answer's own, unchanged

    scored = httpx.post(url, json={**body, "max_tokens": 0}, timeout=60).json()
    assert scored["choices"][0]["text"] == PROMPT
    assert scored["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert scored["usage"]["completion_tokens"] == 1  # the engine's one token, as vLLM counts it

    events = _events(url, body)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    two = httpx.post(url, json={**body, "n": 2, "logprobs": None}, timeout=60).json()
    assert [c["text"] for c in two["choices"]] == [choice["text"]] * 2


def test_token_ids_are_echoed_and_detokenized_with_their_special_tokens(worker) -> None:
    """As vLLM: the echoed text of a token-id prompt, and /detokenize's, keep special tokens
    (a chat-rendered prompt opens with one), so each tokenizes back to the same ids, and the
    echo's text is what its logprob tokens spell."""
    base = worker.base_url
    ids = httpx.post(base + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    text = httpx.post(base + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert httpx.post(base + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"] == ids
    echoed = httpx.post(worker.api_url + "/completions", timeout=60, json={
        "model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()["choices"][0]
    assert echoed["text"] == text == "".join(echoed["logprobs"]["tokens"])


def test_detokenize_bounds_its_list_and_refuses_ids_outside_the_vocabulary(worker) -> None:
    """A large list is decoded in a thread, but the tokenizer holds the GIL as it decodes (the
    event loop with it): past MAX_DETOKENIZE_TOKENS ids it is a 400, not seconds of stopped
    streams. An id outside the vocabulary is a 400 too, at any length."""
    url = worker.base_url + "/detokenize"
    ids = httpx.post(worker.base_url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    k = MAX_DETOKENIZE_TOKENS // len(ids)
    r = httpx.post(url, json={"tokens": ids * k}, timeout=120)
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT * k}
    r = httpx.post(url, json={"tokens": ids * (k + 1)}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    assert f"at most {MAX_DETOKENIZE_TOKENS}" in r.json()["error"]["message"]
    for bad in ([ids[0], 10**9], [-1], [2**70], ids * k + [10**9]):
        r = httpx.post(url, json={"tokens": bad}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_an_assistant_prefill_is_continued(worker) -> None:
    """vLLM's chat rendering options: with add_generation_prompt false and
    continue_final_message true the answer goes on from a last assistant message (echo puts
    that message first); /tokenize renders the same prompt; template variables are taken."""
    prefill = [{"role": "user", "content": "Give me a JSON object with a name."},
               {"role": "assistant", "content": '{"name": "'}]
    body = {"model": MODEL, "messages": prefill, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    url = worker.api_url + "/chat/completions"
    went_on = httpx.post(url, json=body, timeout=60).json()
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=60).json()
    text = went_on["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == '{"name": "' + text
    # A closed assistant turn instead: another prompt, another answer.
    closed = httpx.post(url, json={**body, "add_generation_prompt": True, "continue_final_message": False},
                        timeout=60).json()
    assert closed["usage"]["prompt_tokens"] != went_on["usage"]["prompt_tokens"]
    rendered = httpx.post(worker.base_url + "/tokenize", timeout=60, json={
        "messages": prefill, "add_generation_prompt": False, "continue_final_message": True}).json()
    assert rendered["count"] == went_on["usage"]["prompt_tokens"]
    streamed = _events(url, {**body, "echo": True})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in streamed) == '{"name": "' + text
    # Template variables are taken; names of the renderer's own arguments are not (they would
    # turn the prompt into text, or fail the call).
    for variables in ({"enable_thinking": False}, {"tokenize": False, "add_generation_prompt": False},
                      {"messages": []}):
        r = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                  "chat_template_kwargs": variables}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(worker.base_url + "/tokenize", timeout=60,
                       json={"messages": MESSAGES, "chat_template_kwargs": variables})
        assert r.status_code == 200, r.text


def test_vllms_prompt_logprobs_shape(worker) -> None:
    """vLLM's prompt_logprobs: null, then per prompt token {id: {logprob, rank, decoded_token}}
    for the token and its alternatives: on each completions choice, at the top of a chat answer;
    the same numbers as echo's."""
    url = worker.api_url + "/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    done = httpx.post(url, json=body, timeout=60).json()
    shaped = done["choices"][0]["prompt_logprobs"]
    echoed = httpx.post(url, json={**body, "prompt_logprobs": None, "echo": True, "logprobs": 2},
                        timeout=60).json()["choices"][0]["logprobs"]
    n = done["usage"]["prompt_tokens"]
    assert shaped[0] is None and len(shaped) == n
    for position, entry in enumerate(shaped[1:], start=1):
        token = echoed["tokens"][position]
        own = next(v for v in entry.values() if v["decoded_token"] == token)
        assert own["logprob"] == echoed["token_logprobs"][position] and own["rank"] >= 1
        assert {v["rank"] for v in entry.values() if v is not own} <= {1, 2}  # the two likeliest
    assert done["choices"][0]["text"]  # the answer itself is unchanged by it
    chat = httpx.post(worker.api_url + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}).json()
    shaped = chat["prompt_logprobs"]
    assert shaped[0] is None and len(shaped) == chat["usage"]["prompt_tokens"]
    assert all(len(p) == 1 for p in shaped[1:])  # the token alone at 0


def test_penalties_logit_bias_and_min_tokens_change_the_answer(worker, greedy_completion) -> None:
    """Accepted and applied (they used to be refused): each changes the greedy answer."""
    url = worker.api_url + "/completions"
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    greedy_text = greedy_completion.choices[0].text

    def text(**extra) -> str:
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(frequency_penalty=2.0, presence_penalty=2.0) != greedy_text
    assert text(repetition_penalty=1.8) != greedy_text
    tokenized = httpx.post(worker.base_url + "/tokenize", json={"prompt": " banana"}, timeout=60)
    banana = tokenized.json()["tokens"]
    assert text(logit_bias={str(banana[0]): 100}) == " banana" * 12
    # A chat answer that ends early by itself does not end before min_tokens.
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0}
    free = httpx.post(worker.api_url + "/chat/completions", json=chat, timeout=60).json()
    held = httpx.post(worker.api_url + "/chat/completions", json={**chat, "min_tokens": 40},
                      timeout=60).json()
    if not RANDOM_WEIGHTS:  # random weights need not end an answer by themselves
        assert free["choices"][0]["finish_reason"] == "stop" and free["usage"]["completion_tokens"] < 40
    assert held["usage"]["completion_tokens"] >= 40


def test_n_choices_whole_and_streamed(worker, client) -> None:
    """n > 1: n choices, each its own seeded draw (seed + index, as vLLM), the prompt counted
    once in the usage; the stream's chunks name their choice and add up to the same answers;
    the n histogram counts the request once."""
    before = worker.metrics()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "n": 3, "seed": 11, "temperature": 1.0,
            "ignore_eos": True}
    done = client.chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                          extra_body={"ignore_eos": True})
    texts = [c.message.content for c in sorted(done.choices, key=lambda c: c.index)]
    assert [c.index for c in done.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert {c.finish_reason for c in done.choices} == {"length"}
    alone = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=11,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert alone.choices[0].message.content == texts[0]  # choice 0 draws with the request's seed
    assert done.usage.completion_tokens == 18 and done.usage.prompt_tokens == alone.usage.prompt_tokens
    after = worker.metrics()
    n_count = ("vllm:request_params_n_count", ())
    n_sum = ("vllm:request_params_n_sum", ())
    assert after[n_count] - before[n_count] == 2 and after[n_sum] - before[n_sum] == 4  # n=3, then n=1

    with_usage = {**body, "stream_options": {"include_usage": True}}
    events = _events(worker.api_url + "/chat/completions", with_usage)
    by_choice: dict[int, list[dict]] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == [0, 1, 2]
    for index, choices in by_choice.items():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}  # each choice opens
        assert [c["finish_reason"] for c in choices].count("length") == 1 and choices[-1]["finish_reason"]
        assert "".join(c["delta"].get("content", "") for c in choices) == texts[index]
    assert events[-1]["usage"]["completion_tokens"] == 18


def test_a_batch_of_prompts_answers_each_as_if_alone(worker) -> None:
    """Completions take a batch of prompts (strings or token ids), as OpenAI and vLLM do:
    choice i x n + j is choice j of prompt i, each the answer that prompt gets alone."""
    url = worker.api_url + "/completions"
    prompts = [PROMPT, "Two plus two is"]
    base = {"model": MODEL, "max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True}

    def texts(body: dict) -> list[str]:
        r = httpx.post(url, json={**base, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    alone = [texts({"prompt": p, "n": 2}) for p in prompts]
    done = httpx.post(url, json={**base, "prompt": prompts, "n": 2}, timeout=60).json()
    assert [c["index"] for c in done["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in done["choices"]] == alone[0] + alone[1]
    tokenize = worker.base_url + "/tokenize"
    counts = [httpx.post(tokenize, json={"prompt": p}, timeout=60).json() for p in prompts]
    assert done["usage"]["prompt_tokens"] == sum(c["count"] for c in counts)
    assert done["usage"]["completion_tokens"] == 4 * 5
    # Token ids, streamed, with echo: each choice opens with its own prompt.
    ids = [c["tokens"] for c in counts]
    events = _events(url, {**base, "prompt": ids, "echo": True})
    streamed: dict[int, str] = {}
    for event in events:
        (choice,) = event["choices"]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert streamed == {0: prompts[0] + alone[0][0], 1: prompts[1] + alone[1][0]}


def test_n_choices_all_abort_when_the_client_leaves(worker) -> None:
    """All three choices are freed (one was waiting: --max-num-seqs 2), none run to its 500
    tokens, and none is counted as finished, as in vLLM."""
    before = worker.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "n": 3, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", worker.api_url + "/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk
    def freed() -> dict | None:
        now = worker.metrics()
        running, waiting = (now[(f"vllm:num_requests_{s}", ())] for s in ("running", "waiting"))
        return now if running == waiting == 0 else None

    idle = wait_for(freed, 60, what="three choices aborted")
    assert idle[("vllm:kv_cache_usage_perc", ())] == 0
    for reason in ("abort", "length", "stop"):
        counted = ("vllm:request_success_total", (("finished_reason", reason),))
        assert idle[counted] == before[counted], reason


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(worker) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", worker.api_url + "/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in e for e in events)
    done = [e["usage"]["completion_tokens"] for e in events]
    assert done[0] == 0 and done == sorted(done) and done[-1] == 6  # the role chunk, ..., the usage chunk
    assert {e["usage"]["prompt_tokens"] for e in events} == {events[-1]["usage"]["prompt_tokens"]}
    # As in vLLM it needs include_usage (true unless said otherwise): without it, it adds nothing.
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    with httpx.stream("POST", worker.api_url + "/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and not any("usage" in e for e in events)


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_stream_options_without_include_usage_ask_for_the_usage_chunk(worker, path) -> None:
    """vLLM's StreamOptions.include_usage defaults to true: `stream_options: {}` gets the final
    usage chunk, and an explicit null does not (taken, not refused)."""
    prompt = {"messages": MESSAGES} if path == "/chat/completions" else {"prompt": PROMPT}
    body = {"model": MODEL, **prompt, "max_tokens": 3, "ignore_eos": True}
    events = _events(worker.api_url + path, {**body, "stream_options": {}})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert not any("usage" in e for e in events[:-1])
    events = _events(worker.api_url + path, {**body, "stream_options": {"include_usage": None}})
    assert events and all(e["choices"] for e in events) and not any(e.get("usage") for e in events)


def test_a_tool_choice_without_tools_is_a_400_as_in_vllm(worker) -> None:
    """vLLM refuses any tool_choice but "none" when no `tools` are sent ("auto" too); "none" is served."""
    url = worker.api_url + "/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        r = httpx.post(url, json={**body, "tool_choice": choice}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json() == {"error": {"message": "When using `tool_choice`, `tools` must be set.",
                                      "type": "invalid_request_error", "param": "tool_choice", "code": None}}
    r = httpx.post(url, json={**body, "tool_choice": "none"}, timeout=60)
    assert r.status_code == 200, r.text


def test_caller_request_id_names_the_request_as_in_vllm(worker) -> None:
    """X-Request-Id becomes the answer's id (`cmpl-<id>`, `chatcmpl-<id>`, every chunk too), so
    a gateway's log line and the client's answer name the same request; an id that is not a
    plain token (here one with a quote, which would break the chunks' JSON) is replaced."""
    url = worker.api_url
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(url + "/completions", json=body, headers={"X-Request-Id": "gw-7f3a.12"}, timeout=60)
    assert r.json()["id"] == "cmpl-gw-7f3a.12"
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", url + "/chat/completions", json=chat, headers={"X-Request-Id": "trace-1"},
                      timeout=60) as r:
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-trace-1"}
    r = httpx.post(url + "/completions", json=body, headers={"X-Request-Id": 'a"b'}, timeout=60)
    assert r.status_code == 200 and r.json()["id"].startswith("cmpl-") and '"' not in r.json()["id"]
    # vLLM's request_id body field, where no usable header gives one (the sim worker's tests
    # go through the other cases).
    r = httpx.post(url + "/completions", json={**body, "request_id": "body-1"}, timeout=60)
    assert r.json()["id"] == "cmpl-body-1"


@pytest.mark.parametrize("n", [1, 2])
async def test_a_caller_id_reused_while_in_flight_still_serves_both(worker, n) -> None:
    """Two requests with one X-Request-Id at once (a client that reuses its ids): the engine
    needs unique ids, but neither caller gets an error, and both answers carry the caller's
    (also when each has two choices, whose engine ids derive from it)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "n": n}
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*[
            c.post(worker.api_url + "/completions", json={**body, "ignore_eos": True},
                   headers={"X-Request-Id": "same-id"})
            for _ in range(2)
        ])
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    assert [r.json()["id"] for r in rs] == ["cmpl-same-id"] * 2
    assert [r.json()["usage"]["completion_tokens"] for r in rs] == [24 * n, 24 * n]
    assert [len(r.json()["choices"]) for r in rs] == [n, n]


def test_models_health_ping_and_version(worker, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{worker.base_url}/health").status_code == 200
    # vLLM's other two: /ping (GET or POST, as /health) and /version.
    assert [httpx.request(m, f"{worker.base_url}/ping").status_code for m in ("GET", "POST")] == [200, 200]
    served = httpx.get(f"{worker.base_url}/version").json()["version"]
    assert served == importlib.metadata.version("llm-router")


def test_openai_client_sees_typed_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)


LONG_PROMPT = "hello " * 2100  # > 2048 tokens
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def bad(name, path, body, status, param, method="POST"):
    return pytest.param(method, path, body, status, param, id=name)


BAD_INPUTS = [
    bad("invalid json", CMPL, b"{not json", 400, None),
    bad("body is a list", CMPL, b"[1, 2]", 400, None),
    bad("empty body", CHAT, b"", 400, None),
    bad("max_tokens string", CMPL, {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    bad("max_tokens zero", CMPL, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    bad("max_tokens negative", CHAT, {"messages": MESSAGES, "max_tokens": -3}, 400, "max_tokens"),
    bad(
        "max_completion_tokens zero",
        CHAT,
        {"messages": MESSAGES, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    bad("temperature string", CMPL, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    bad("temperature too high", CMPL, {"prompt": "a", "temperature": 9}, 400, "temperature"),
    bad("top_p zero", CMPL, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    bad("prompt too long", CMPL, {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "prompt"),
    bad(
        "chat prompt too long",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
        "messages",
    ),
    bad("max_tokens beyond context", CMPL, {"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
    bad("unknown model", CMPL, {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    bad("unknown model chat", CHAT, {"model": "gpt-9", "messages": MESSAGES}, 404, "model"),
    bad("n beyond 128", CMPL, {"prompt": "a", "n": 129}, 400, "n"),
    bad("n zero", CHAT, {"messages": MESSAGES, "n": 0}, 400, "n"),
    bad("logprobs beyond 20", CMPL, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    bad("prompt_logprobs beyond 20", CHAT, {"messages": MESSAGES, "prompt_logprobs": 21}, 400,
        "prompt_logprobs"),
    bad("top_logprobs without logprobs", CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400,
        "top_logprobs"),
    bad("top_logprobs beyond 20", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, 400,
        "top_logprobs"),
    bad("presence_penalty beyond 2", CMPL, {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    bad("frequency_penalty below -2", CHAT, {"messages": MESSAGES, "frequency_penalty": -2.5}, 400,
        "frequency_penalty"),
    bad("repetition_penalty zero", CMPL, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    bad("logit_bias key not an id", CMPL, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    bad("logit_bias key a superscript", CMPL, {"prompt": "a", "logit_bias": {"\u00b2": 1}}, 400,
        "logit_bias"),
    bad("logit_bias beyond 100", CMPL, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    bad("logit_bias id outside vocab", CMPL, {"prompt": "a", "logit_bias": {"999999999": 1}}, 400,
        "logit_bias"),
    bad("min_tokens beyond max_tokens", CMPL, {"prompt": "a", "max_tokens": 3, "min_tokens": 4}, 400,
        "min_tokens"),
    bad("missing prompt", CMPL, {"max_tokens": 3}, 400, "prompt"),
    bad("empty token list", CMPL, {"prompt": []}, 400, "prompt"),
    bad("mixed prompt list", CMPL, {"prompt": [1, "a"]}, 400, "prompt"),
    bad("batch of mixed prompts", CMPL, {"prompt": ["a", [1]]}, 400, "prompt"),
    bad("batch beyond 1024 answers", CMPL, {"prompt": ["a"] * 9, "n": 128}, 400, "prompt"),
    bad("token id outside vocab", CMPL, {"prompt": [1, 999_999_999]}, 400, "prompt"),
    bad("empty prompt", CMPL, {"prompt": ""}, 400, "prompt"),
    bad("no messages", CHAT, {"messages": []}, 400, "messages"),
    bad("continue_final_message with a generation prompt", CHAT,
        {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    bad("chat_template_kwargs not an object", CHAT, {"messages": MESSAGES, "chat_template_kwargs": 3}, 400,
        "chat_template_kwargs"),
    bad("missing messages", CHAT, {"max_tokens": 3}, 400, "messages"),
    bad("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    bad("content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    bad("image content for a text model", CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                   {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        400, "messages.0.content.1.type"),
    bad("tokenize audio content", "/tokenize",
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
        "messages.0.content.0.type"),
    bad(
        "stream_options without stream",
        CMPL,
        {"prompt": "a", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    bad("empty stop string", CMPL, {"prompt": "a", "stop": [""]}, 400, "stop"),
    bad("stream not a bool", CMPL, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    # Fields taken and not used (vLLM declares them): a wrong type was passed over, not refused.
    bad("user not a string", CMPL, {"prompt": "a", "user": {"id": 1}}, 400, "user"),
    bad("chat user not a string", CHAT, {"messages": MESSAGES, "user": 5}, 400, "user"),
    bad("parallel_tool_calls not a bool", CHAT, {"messages": MESSAGES, "parallel_tool_calls": "yes"}, 400,
        "parallel_tool_calls"),
    bad("length_penalty not a number", CMPL, {"prompt": "a", "length_penalty": "x"}, 400, "length_penalty"),
    bad("cache_salt not a string", CHAT, {"messages": MESSAGES, "cache_salt": 42}, 400, "cache_salt"),
    bad("documents not a list", CHAT, {"messages": MESSAGES, "documents": "doc"}, 400, "documents"),
    bad("assistant tool_calls not a list", CHAT,
        {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": "f()"}]}, 400, "messages.1.tool_calls"),
    bad("tokenize nothing", "/tokenize", {}, 400, "prompt"),
    bad("tokenize no messages", "/tokenize", {"messages": []}, 400, "messages"),
    bad("unknown route", "/v1/nothing", None, 404, None, method="GET"),
    bad("wrong method", CMPL, None, 405, None, method="GET"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_openai_error(worker, method, path, body, status, param) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    response = httpx.request(method, f"{worker.base_url}{path}", timeout=60, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param
    assert "Traceback" not in response.text


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd"])
def test_a_body_its_content_encoding_does_not_match_is_a_400(worker, encoding) -> None:
    """A body that says gzip (or zstd...) and is not: the client's error, not the server's."""
    r = httpx.post(f"{worker.base_url}{CMPL}", content=b'{"prompt": "x"}', timeout=60,
                   headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body"


def test_a_lying_content_encoding_on_a_route_that_reads_no_body_is_one_warning_line(worker) -> None:
    """The same body on routes that never read one: their answer was right, but aiohttp drained
    the body after it, met the decoding error and logged an ERROR "Unhandled exception" with
    three chained tracebacks."""
    seen = len(worker.output())
    for method, path, status in (("GET", "/health", 200), ("POST", "/ping", 200),
                                 ("POST", "/v1/responses/resp_x/cancel", 404),
                                 ("DELETE", "/v1/responses/resp_x", 404), ("POST", "/nowhere", 404),
                                 ("PUT", CMPL, 405)):
        for encoding in ("gzip", "zstd"):
            r = httpx.request(method, f"{worker.base_url}{path}", content=b"not compressed", timeout=60,
                              headers={"Content-Encoding": encoding})
            assert r.status_code == status, (method, path, r.text)
    assert httpx.get(f"{worker.base_url}/health", timeout=60).status_code == 200
    wait_for(lambda: worker.output().count("unreadable request body", seen) == 12, timeout_s=10,
             what="a WARNING line per request")
    log = worker.output()[seen:]
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
         "Invalid character in Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
         "Invalid character in chunk size"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Claims: " + b"a" * 40 * 1024 + b"\r\n\r\n",
         "Got more than 32768 bytes"),
    ],
    ids=["content-length", "chunk-size", "header-over-32KiB"],
)
def test_what_the_http_parser_refuses_is_a_400_in_the_openai_shape(worker, raw, reason) -> None:
    """aiohttp answers these itself, before any route or middleware: plain text and a logged
    traceback, unless the worker's runner steps in (the module's last test reads the log)."""
    port = int(worker.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        answer = b""
        while chunk := s.recv(65536):  # the worker closes after a request it could not parse
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400") and b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "malformed_http_request")
    assert error["message"].startswith(f"malformed HTTP request: {reason}"), error


def test_worker_survives_bad_inputs(worker, client) -> None:
    """After every bad input above, the worker still serves (nothing wedged or crashed)."""
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
    assert worker.process.poll() is None


async def _receive_until_end(ws: aiohttp.ClientWebSocketResponse) -> tuple[list[dict], dict]:
    """Chunks of one request and its terminal message (done or error)."""
    chunks = []
    while True:
        msg = await ws.receive(timeout=120)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        body = json.loads(msg.data)
        if body.get("type") == "done" or "error" in body:
            return chunks, body
        chunks.append(body)


async def test_websocket_streams_chunks_and_stays_usable_after_errors(worker, greedy_completion) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{worker.base_url}/v1/ws") as ws:
        # completions (explicit endpoint) with usage: same text as over HTTP
        await ws.send_str(
            json.dumps(
                {
                    "endpoint": "completions",
                    "model": MODEL,
                    "prompt": PROMPT,
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                }
            )
        )
        chunks, end = await _receive_until_end(ws)
        assert end["type"] == "done" and end["id"] == chunks[0]["id"]
        assert all(c["object"] == "text_completion" for c in chunks)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == greedy_completion.choices[0].text
        assert chunks[-1]["usage"]["completion_tokens"] == 12

        # continuous usage over the socket too
        counted = {"include_usage": True, "continuous_usage_stats": True}
        await ws.send_str(json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True,
                                      "stream_options": counted}))
        chunks, end = await _receive_until_end(ws)
        assert all("usage" in c for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 3

        # logprobs over the socket: one per token, as over SSE
        await ws.send_str(json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                      "ignore_eos": True, "logprobs": True, "top_logprobs": 1}))
        chunks, end = await _receive_until_end(ws)
        entries = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
        assert len(entries) == 4 and all(len(e["top_logprobs"]) == 1 for e in entries)

        # n = 2 over the socket: both choices, each ended once
        await ws.send_str(json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2,
                                      "ignore_eos": True}))
        chunks, end = await _receive_until_end(ws)
        ended = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
        assert ended == [0, 1] and end["type"] == "done"

        # a bad message: error object, socket stays open
        await ws.send_str("{oops")
        _, end = await _receive_until_end(ws)
        assert end["error"]["type"] == "invalid_request_error"
        await ws.send_str(json.dumps({"model": "nope", "messages": MESSAGES}))
        _, end = await _receive_until_end(ws)
        assert end["error"]["code"] == "model_not_found"
        await ws.send_str(json.dumps({"messages": MESSAGES, "max_tokens": 0}))
        _, end = await _receive_until_end(ws)
        assert end["error"]["param"] == "max_tokens"
        for endpoint in ("embeddings", ["chat"]):
            await ws.send_str(json.dumps({"messages": MESSAGES, "endpoint": endpoint}))
            _, end = await _receive_until_end(ws)
            assert (end["error"]["type"], end["error"]["param"]) == ("invalid_request_error", "endpoint")

        # chat inferred from "messages"
        await ws.send_str(json.dumps({"messages": MESSAGES, "max_tokens": 6, "temperature": 0}))
        chunks, end = await _receive_until_end(ws)
        assert end == {"type": "done", "id": chunks[0]["id"]}
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

        # cancel a long request after its first chunk
        await ws.send_str(json.dumps({"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}))
        first = json.loads((await ws.receive(timeout=120)).data)
        assert first["object"] == "text_completion"
        await ws.send_str(json.dumps({"type": "cancel"}))
        _, end = await _receive_until_end(ws)
        assert end == {"type": "done", "id": first["id"], "cancelled": True}

    # the cancelled request left the engine
    def idle() -> bool:
        text = worker.metrics_text()
        return 'vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0' in text

    wait_for(idle, timeout_s=60, what="the cancelled request to leave the engine")


async def test_websocket_a_lone_surrogate_is_invalid_json_as_over_http(worker) -> None:
    """A lone surrogate escape ("\\ud800") is no Unicode text: over HTTP a 400 `invalid_json`. The
    socket parsed its messages with json.loads, which takes it: in a prompt it reached the
    tokenizer ("'utf-8' codec can't encode character ...", no code), in a model name the lookup
    (a `model_not_found` for a name no client can have sent)."""
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{worker.base_url}/v1/ws") as ws:
        for text in ('{"prompt": "\\ud800", "max_tokens": 2}', '{"model": "\\udc00", "prompt": "x"}',
                     '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'):
            await ws.send_str(text)
            _, end = await _receive_until_end(ws)
            error = end["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json"), end
            assert error["message"].startswith("Invalid JSON message: "), end
        await ws.send_str(json.dumps({"prompt": PROMPT, "max_tokens": 2}))
        chunks, end = await _receive_until_end(ws)
        assert end == {"type": "done", "id": chunks[0]["id"]}


def test_nothing_above_hit_an_unexpected_error(worker) -> None:
    """Runs last in this module: no request above produced a 500 or an engine failure in the log."""
    log = worker.output()
    assert "unexpected error while serving a request" not in log
    assert "engine loop died" not in log
    assert "Traceback" not in log
