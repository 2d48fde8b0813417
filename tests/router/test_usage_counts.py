"""Usage counts the gateway takes from a worker's stream: only counts. A negative one (or a
boolean, which JSON's true is to Python's int check) ran the token counters backwards, which
Prometheus reads as a counter reset, and credited the tenant in the queue's token turns."""

from __future__ import annotations

import json

import pytest

from router.sse import StreamTap


@pytest.mark.parametrize("bad", [-5, True, 1.5, "7"])
def test_a_stream_usage_that_is_no_count_is_not_taken(bad):
    usage = {"prompt_tokens": bad, "completion_tokens": bad}
    tap = StreamTap(strip_usage=True)
    tap.feed(b"data: " + json.dumps({"choices": [{"text": "a"}]}).encode() + b"\n\n")
    tap.feed(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
    tap.flush()
    assert (tap.prompt_tokens, tap.completion_tokens) == (None, None)
    assert tap.content_events == 1  # the stand-in the gateway counts instead


def test_a_zero_count_is_a_count():
    tap = StreamTap(strip_usage=False)
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    tap.feed(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
    assert (tap.prompt_tokens, tap.completion_tokens) == (0, 0)


def test_a_usage_event_nested_too_deeply_to_parse_is_passed_on_uncounted():
    """json.loads meets it with a RecursionError, which escaped the stream's relay: the client's
    stream broke off with a 500 and the lease stayed open until it expired."""
    tap = StreamTap(strip_usage=True)
    deep = b'data: {"choices": [], "usage": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}\n\n"
    assert tap.feed(deep) == deep
    assert (tap.prompt_tokens, tap.completion_tokens) == (None, None)


def _event(delta: dict) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"


@pytest.mark.parametrize(
    "opening",
    [
        {"role": "assistant", "content": ""},  # vLLM, our worker
        {"role": "assistant", "content": "", "refusal": None},  # OpenAI
        {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": None},  # SGLang
    ],
    ids=["vllm", "openai", "sglang"],
)
def test_a_cut_chat_stream_counts_its_tokens_not_its_role_chunk(opening):
    """A stream cut short has no usage: its events stand in for tokens. The role chunk that
    opens a chat stream, as each server spells it, is none of them."""
    tap = StreamTap(strip_usage=True)
    tap.feed(_event(opening))
    for word in ("a", "b", "c"):
        tap.feed(_event({"content": word}))
    assert tap.content_events == 3
