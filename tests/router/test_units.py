"""Unit tests of the gateway's pure pieces: token estimate, prefix fingerprints, SSE tap,
admission queue, round-robin fallback, API-key checks."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from router import metrics as router_metrics
from router.access_log import RequestRecord, Stats
from router.auth import KeyChecker, bearer_token
from router.fairness import SHARED_FLOW, flow_of
from router.fallback import FallbackRouter, NoWorkerError
from router.metrics import RouterMetrics
from router.queue import AdmissionQueue, QueueDisplaced, QueueFull
from router.sessions import session_key
from router.sse import StreamTap, usage_of_body
from router.tokens import (
    PREFIX_CHUNK_CHARS,
    TokenCounter,
    estimate_tokens,
    max_tokens_of,
    prefix_hashes,
    render_prompt,
    schedule_request,
)
from scheduler import fair_share
from scheduler.fair_share import FlowLedger


def test_render_and_estimate_chat_and_completion():
    text, ids = render_prompt(
        {
            "messages": [
                {"role": "user", "content": "hello world"},
                {"role": "user", "content": [{"type": "text", "text": "abc"}]},
            ]
        }
    )
    assert "hello world" in text and "abc" in text and ids == 0
    assert estimate_tokens("a" * 40) == 10
    assert render_prompt({"prompt": [1, 2, 3]}) == ("", 3)
    assert render_prompt({"prompt": [[1, 2], [3]]}) == ("", 3)
    assert estimate_tokens(*render_prompt({"prompt": [1, 2, 3]})) == 3
    assert max_tokens_of({"max_tokens": 5}) == 5
    assert max_tokens_of({"max_completion_tokens": 7, "max_tokens": 5}) == 7
    assert max_tokens_of({"max_tokens": "x"}) is None and max_tokens_of({"max_tokens": True}) is None
    assert max_tokens_of({"max_tokens": 0, "echo": True}) == 1 and max_tokens_of({"max_tokens": -1}) is None


def test_prefix_hashes_share_prefix_and_are_stable():
    base = "x" * PREFIX_CHUNK_CHARS * 3
    a = prefix_hashes(base + "A" * PREFIX_CHUNK_CHARS)
    b = prefix_hashes(base + "B" * PREFIX_CHUNK_CHARS)
    assert len(a) == len(b) == 4
    assert a[:3] == b[:3] and a[3] != b[3]
    assert prefix_hashes("short") == []
    # Non-ASCII text is cut by characters, and the value does not depend on the process.
    u = prefix_hashes("é" * PREFIX_CHUNK_CHARS * 2)
    assert len(u) == 2 and u == prefix_hashes("é" * PREFIX_CHUNK_CHARS * 2)
    # chained: a different first chunk changes every later fingerprint
    c = prefix_hashes("y" + base[1:] + "A" * PREFIX_CHUNK_CHARS)
    assert all(x != y for x, y in zip(a, c, strict=True))
    # vLLM's cache_salt: another salt (or none) shares no cached block, and so no fingerprint.
    salted = prefix_hashes(base, cache_salt="tenant-a")
    assert salted == prefix_hashes(base, cache_salt="tenant-a")
    assert not set(salted) & set(prefix_hashes(base)) and not set(salted) & set(
        prefix_hashes(base, cache_salt="tenant-b"))


def _ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_stream_tap_strips_injected_usage_and_counts():
    tap = StreamTap(strip_usage=True)
    chunks = [_ev({"choices": [{"text": "a"}]}), _ev({"choices": [{"text": "b"}]})]
    usage = _ev({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}})
    out = tap.feed(chunks[0]) + tap.feed(chunks[1] + usage + b"data: [DONE]\n\n") + tap.flush()
    assert out == chunks[0] + chunks[1] + b"data: [DONE]\n\n"
    assert (tap.prompt_tokens, tap.completion_tokens) == (7, 2)


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
def test_stream_tap_strips_usage_from_a_whole_stream_in_one_read(sep):
    """A worker that writes a whole answer at once: every token event passes byte for byte,
    only the usage chunk the gateway asked for goes, in either framing, and a token whose
    text mentions "usage" is not taken for it."""
    tokens = [b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + sep
              for t in ("a", '"usage": {', "c")]
    counts = {"prompt_tokens": 5, "completion_tokens": 3}
    usage = b"data: " + json.dumps({"choices": [], "usage": counts}).encode()
    done = b"data: [DONE]" + sep
    tap = StreamTap(strip_usage=True)
    assert tap.feed(b"".join(tokens) + usage + sep + done) == b"".join(tokens) + done
    assert (tap.prompt_tokens, tap.completion_tokens) == (5, 3) and tap.content_events == 3


def test_stream_tap_keeps_usage_the_client_asked_for_and_joins_split_events():
    tap = StreamTap(strip_usage=False)
    usage = _ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    whole = _ev({"choices": [{"text": "a"}]}) + usage + b"data: [DONE]\n\n"
    out = b""
    for i in range(0, len(whole), 7):  # worst case: the worker's writes split events anywhere
        out += tap.feed(whole[i : i + 7])
    out += tap.flush()
    assert out == whole
    assert tap.completion_tokens == 1 and tap.content_events == 2


def test_stream_tap_counts_the_events_of_a_stream_cut_short():
    """Without usage, tokens are counted as events: less the [DONE] of a stream that ended,
    all of them for one whose client left or whose worker failed (no [DONE] came)."""
    events = [_ev({"choices": [{"text": "a"}]}) for _ in range(3)]
    cut = StreamTap(strip_usage=False)
    cut.feed(events[0] + events[1])
    cut.feed(events[2][:10])  # half an event, held back until it ends or the stream does
    cut.flush()
    assert cut.content_events == 3
    ended = StreamTap(strip_usage=False)
    ended.feed(b"".join(events))
    ended.feed(b"data: [DONE]\n\n")
    ended.flush()
    assert ended.content_events == 3


def test_usage_the_gateway_asks_for_never_turns_on_a_clients_continuous_usage():
    from router.request_checks import with_usage

    def sent(body: dict) -> dict:
        return json.loads(with_usage(json.dumps(body).encode(), body))["stream_options"]

    assert sent({"model": "m", "stream": True}) == {"include_usage": True}
    # continuous_usage_stats takes effect with include_usage only: the client asked for none.
    assert sent({"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": True}}) == {
        "include_usage": True, "continuous_usage_stats": False}
    assert sent({"model": "m", "stream": True, "stream_options": {"include_usage": False}}) == {
        "include_usage": True}


def test_usage_of_body():
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4}}).encode()
    assert usage_of_body(body) == (11, 4)
    assert usage_of_body(b'{"choices": []}') == (None, None)


FIXTURES = Path(__file__).parent / "fixtures"


def test_usage_of_a_responses_api_body_from_vllm():
    """Captured from vLLM 0.32 (SmolLM2): usage is input/output tokens, with *_details objects."""
    body = (FIXTURES / "vllm-0.32-responses.json").read_bytes()
    assert usage_of_body(body) == (32, 8)


@pytest.mark.parametrize("split", [1, 7, 64, 100_000])
def test_stream_tap_on_a_vllm_responses_stream_finds_usage_and_the_first_token(split):
    """vLLM's Responses stream sends response.created and response.in_progress before any token:
    the first-token callback (TTFT, the scheduler's prefill report) waits for the first delta,
    and the usage comes from the response.completed event. The bytes pass unchanged."""
    from router.streaming import FIRST_TOKEN_MARKERS

    whole = (FIXTURES / "vllm-0.32-responses-stream.txt").read_bytes()
    first_delta = whole.index(b"event: response.output_text.delta")
    seen: list[int] = []
    passed = b""
    tap = StreamTap(False, FIRST_TOKEN_MARKERS["/v1/responses"], lambda: seen.append(len(passed)))
    for i in range(0, len(whole), split):
        passed += tap.feed(whole[i : i + split])
    passed += tap.flush()
    assert passed == whole
    assert len(seen) == 1 and seen[0] <= first_delta  # called once, as that event passed
    assert b"response.output_text.delta" not in passed[: seen[0]]
    assert (tap.prompt_tokens, tap.completion_tokens) == (32, 4)


@pytest.mark.parametrize("split", [1, 7, 100_000])
def test_a_responses_stream_cut_short_counts_its_deltas_as_tokens(split):
    """No usage comes when the client leaves mid-stream: the tokens are counted as events, and
    the Responses API's opening events (created, in_progress, item and part added) are none."""
    from router.streaming import FIRST_TOKEN_MARKERS

    whole = (FIXTURES / "vllm-0.32-responses-stream.txt").read_bytes()
    cut = whole[: whole.index(b"event: response.output_text.done")]  # after the 4 deltas
    tap = StreamTap(False, FIRST_TOKEN_MARKERS["/v1/responses"], lambda: None)
    for i in range(0, len(cut), split):
        tap.feed(cut[i : i + split])
    tap.flush()
    assert tap.completion_tokens is None and tap.content_events == 4
    opening = StreamTap(False, FIRST_TOKEN_MARKERS["/v1/responses"], lambda: None)
    opening.feed(whole[: whole.index(b"event: response.output_text.delta")])
    assert opening.content_events == 0


def test_responses_bodies_render_as_their_chat_conversation():
    chat = {"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi"}]}
    as_string = {"instructions": "Be brief", "input": "hi"}
    parts = [{"type": "input_text", "text": "hi"}]
    as_items = {"instructions": "Be brief", "input": [{"type": "message", "role": "user", "content": parts}]}
    assert render_prompt(as_string, "/v1/responses") == render_prompt(chat)
    assert render_prompt(as_items, "/v1/responses") == render_prompt(chat)
    # A long conversation shares its prefix fingerprints with the same one sent as chat.
    history = [{"role": "user", "content": "x" * 2000}, {"role": "assistant", "content": "y" * 900}]
    sched, prompt, _ = schedule_request(TokenCounter(), "m", {"input": history, "max_output_tokens": 9},
                                        "/v1/responses")
    chat_sched, chat_prompt, _ = schedule_request(TokenCounter(), "m", {"messages": history, "max_tokens": 9})
    assert sched == chat_sched and prompt == chat_prompt > 700
    assert max_tokens_of({"max_output_tokens": 9}) == 9
    # Function calls and their outputs count toward the prompt too.
    call = [{"type": "function_call", "name": "f", "arguments": "a" * 40},
            {"type": "function_call_output", "call_id": "c", "output": "b" * 40}]
    assert estimate_tokens(*render_prompt({"input": call}, "/v1/responses")) > 20


def test_anthropic_messages_render_as_their_chat_conversation_with_the_system_prompt():
    """The Anthropic Messages API (vLLM serves /v1/messages) puts the system prompt beside the
    messages: left out, an agent's long system prompt counted for nothing in the estimate and
    its prefix fingerprints (the part every turn shares) were the messages' only."""
    chat = {"messages": [{"role": "system", "content": "Be brief" * 100}, {"role": "user", "content": "hi"}]}
    blocks = [{"type": "text", "text": "Be brief" * 100}]
    for system in ("Be brief" * 100, blocks):
        user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        anthropic = {"system": system, "messages": [user], "max_tokens": 9}
        assert render_prompt(anthropic, "/v1/messages") == render_prompt(chat)
        sched, prompt, _ = schedule_request(TokenCounter(), "m", anthropic, "/v1/messages")
        assert prompt > 200 and sched["prefix_hashes"]
    assert render_prompt({"system": "", "messages": []}) == ("", 0)


def test_embeddings_inputs_are_estimated_like_prompts():
    assert render_prompt({"input": "hello"}) == ("hello", 0)
    assert render_prompt({"input": ["a", "b"]}) == ("a\x1eb", 0)
    assert render_prompt({"input": [1, 2, 3]}) == ("", 3)
    assert render_prompt({"input": [[1, 2], [3]]}) == ("", 3)


async def test_queue_is_fifo_bounded_and_cancellation_frees_the_place():
    q = AdmissionQueue(max_size=3)
    order: list[int] = []
    release = asyncio.Event()

    async def waiter(i: int) -> None:
        async with q.place("m"):
            order.append(i)
            await release.wait()

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert q.size == 3 and order == [0]
    with pytest.raises(QueueFull):
        async with q.place("m"):
            pass
    tasks[1].cancel()  # a queued client goes away
    await asyncio.sleep(0.01)
    assert q.size == 2
    release.set()
    await asyncio.gather(tasks[0], tasks[2])
    assert order == [0, 2] and q.size == 0 and not q.has_waiters("m")


async def test_queue_can_put_short_prompts_first_without_starving_long_ones():
    async def drain(q: AdmissionQueue, prompts: list[int], gap_s: float = 0.0) -> list[int]:
        order: list[int] = []
        release = asyncio.Event()

        async def waiter(i: int) -> None:
            async with q.place("m", prompts[i]):
                order.append(i)
                await release.wait()

        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(waiter(i)))
            await asyncio.sleep(gap_s or 0.001)
        release.set()
        await asyncio.gather(*tasks)
        return order

    prompts = [50, 2000, 800, 10, 300]
    assert await drain(AdmissionQueue(10), prompts) == [0, 1, 2, 3, 4]  # FIFO by default
    # 1 ms per token: behind the head (0), the shortest prompts go first.
    assert await drain(AdmissionQueue(10, ms_per_prompt_token=1.0), prompts) == [0, 3, 4, 2, 1]
    # Aging: a 2,000-token prompt counts as 20 ms later, so a short one that arrives 30 ms
    # after it does not overtake it.
    assert await drain(AdmissionQueue(10, ms_per_prompt_token=0.01), [5, 2000, 5], gap_s=0.03) == [0, 1, 2]


async def test_queue_serves_lower_priority_values_first_then_by_arrival():
    """vLLM's `priority`: lower first. Behind the head (already asking), a priority -1 arrival
    overtakes the 0s, which overtake the 5, each class in arrival (or shortest-prompt) order."""
    q = AdmissionQueue(10)
    order: list[int] = []
    release = asyncio.Event()

    async def waiter(i: int, priority: int) -> None:
        async with q.place("m", 100, priority):
            order.append(i)
            await release.wait()

    tasks = []
    for i, priority in enumerate([0, 5, 0, -1, 0, -1]):
        tasks.append(asyncio.create_task(waiter(i, priority)))
        await asyncio.sleep(0.001)
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 3, 5, 2, 4, 1]


async def test_queue_takes_flows_in_turn_within_a_priority():
    """A tenant that floods the queue (flow "a": six requests) does not keep a later tenant
    (flows "b", "c") behind all of them: the flows take turns, each in its own order;
    priorities still come first."""
    q = AdmissionQueue(20)
    order: list[str] = []
    release = asyncio.Event()

    async def waiter(name: str, flow: str, priority: int = 0) -> None:
        async with q.place("m", 100, priority, flow):
            order.append(name)
            await release.wait()

    arrivals = [("a0", "a"), ("a1", "a"), ("a2", "a"), ("a3", "a"), ("a4", "a"), ("a5", "a"),
                ("b0", "b"), ("c0", "c"), ("b1", "b"), ("c1", "c")]
    tasks = [asyncio.create_task(waiter(name, flow)) for name, flow in arrivals]
    await asyncio.sleep(0.001)
    tasks.append(asyncio.create_task(waiter("urgent", "a", priority=-1)))
    await asyncio.sleep(0.001)
    assert q.waiting_flows == 3  # what router_queued_flows shows
    release.set()
    await asyncio.gather(*tasks)
    # a0 was asking already (the head); then priority -1; then the flows' turns, A's after
    # the others' (it has just had two).
    assert order == ["a0", "urgent", "b0", "c0", "a1", "b1", "c1", "a2", "a3", "a4", "a5"]


async def test_a_full_queue_refuses_the_flooding_flows_last_waiter_not_a_newcomer():
    """max_size 4, filled by flow a (one asking, three waiting). A newcomer of flow b takes the
    place of a's last waiter (refused, QueueDisplaced); flows no bigger than the newcomer's own,
    and waiters of a better priority than the newcomer's, are not displaced: then the newcomer
    is refused."""
    q = AdmissionQueue(max_size=4)
    order: list[str] = []
    refused: list[str] = []
    release = asyncio.Event()

    async def waiter(name: str, flow: str, priority: int = 0) -> None:
        try:
            async with q.place("m", 100, priority, flow):
                order.append(name)
                await release.wait()
        except QueueFull as exc:
            refused.append(f"{name} {type(exc).__name__}")

    tasks = [asyncio.create_task(waiter(f"a{i}", "a", priority=5 if i == 2 else 0)) for i in range(4)]
    await asyncio.sleep(0.001)
    tasks.append(asyncio.create_task(waiter("b0", "b")))
    await asyncio.sleep(0.001)
    assert refused == ["a2 QueueDisplaced"]  # a's waiter of the worst priority goes first
    tasks.append(asyncio.create_task(waiter("b1", "b")))  # a has 2 waiting, b 1: no gain
    await asyncio.sleep(0.001)
    assert refused == ["a2 QueueDisplaced", "b1 QueueFull"]
    tasks.append(asyncio.create_task(waiter("d0", "d", priority=9)))  # a's waiters outrank it
    await asyncio.sleep(0.001)
    assert refused == ["a2 QueueDisplaced", "b1 QueueFull", "d0 QueueFull"]
    tasks.append(asyncio.create_task(waiter("c0", "c")))  # a 2, c 0: a's newest goes
    await asyncio.sleep(0.001)
    assert refused == ["a2 QueueDisplaced", "b1 QueueFull", "d0 QueueFull", "a3 QueueDisplaced"]
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["a0", "b0", "c0", "a1"] and q.size == 0


async def test_a_queue_full_of_batch_requests_takes_a_better_priority_one_in_place_of_the_last():
    """Priorities are strict in the line, yet a full queue (here of one flow's priority-5 batch
    requests, so no flow is owed a place) turned away an interactive priority-0 request that
    would have been next. It now takes the place of the last waiter of the worst priority,
    which is refused (QueueDisplaced, saying why); a newcomer no better than every waiter is
    still refused."""
    q = AdmissionQueue(max_size=4)
    order: list[str] = []
    refused: list[str] = []
    release = asyncio.Event()

    async def waiter(name: str, priority: int) -> None:
        try:
            async with q.place("m", 100, priority, "batch"):
                order.append(name)
                await release.wait()
        except QueueDisplaced as exc:
            refused.append(f"{name} displaced by {exc.by}")
        except QueueFull:
            refused.append(f"{name} full")

    tasks = [asyncio.create_task(waiter(f"b{i}", 5 if i != 2 else 7)) for i in range(4)]
    await asyncio.sleep(0.001)
    tasks.append(asyncio.create_task(waiter("same", 7)))  # no better than any waiter: refused
    await asyncio.sleep(0.001)
    assert refused == ["same full"]
    tasks.append(asyncio.create_task(waiter("urgent", 0)))
    await asyncio.sleep(0.001)
    assert refused == ["same full", "b2 displaced by a request of better priority"]  # the worst first
    tasks.append(asyncio.create_task(waiter("urgent2", 0)))
    await asyncio.sleep(0.001)
    assert refused[-1] == "b3 displaced by a request of better priority"  # then the newest of 5
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["b0", "urgent", "urgent2", "b1"] and q.size == 0


async def _token_turns(q: AdmissionQueue, arrivals: list[tuple[str, str, int]]) -> list[str]:
    """Drain the queue the way the gateway does: each request, as it gets its worker, is
    charged before it leaves the line, and settled (it used its prompt and a 100-token answer)
    before the next one goes. Returns the order in which they got workers."""
    order: list[str] = []
    gate = asyncio.Event()

    async def waiter(name: str, flow: str, prompt: int) -> None:
        async with q.place("m", prompt, 0, flow):
            await gate.wait()
            charged = q.charge("m", flow, prompt, 100)
            order.append(name)
        q.settle("m", flow, charged, prompt, 100)

    tasks = [asyncio.create_task(waiter(*a)) for a in arrivals]
    await asyncio.sleep(0.001)
    gate.set()
    await asyncio.gather(*tasks)
    return order


async def test_token_turns_give_a_tenant_of_small_requests_more_turns():
    """--fair-share tokens: a tenant of 3,000-token prompts (flow "big") and one of 100-token
    prompts ("small"), both with a backlog. Turn by turn (requests) they alternate, and the big
    tenant gets ~92 % of the tokens; by tokens, the small tenant goes next until it has been
    served as many tokens as the big one (2 x 100 output tokens each: 3,200 against 300)."""
    arrivals = [(f"b{i}", "big", 3000) for i in range(4)] + [(f"s{i}", "small", 100) for i in range(12)]
    by_request = await _token_turns(AdmissionQueue(20), arrivals)
    assert by_request[:6] == ["b0", "s0", "b1", "s1", "b2", "s2"]
    by_tokens = await _token_turns(AdmissionQueue(20, fair_share="tokens"), arrivals)
    # b0 was the head (asking before the others queued). From then on: the small tenant until
    # its 300-token requests add up to b0's 3,200, then b1, then small again.
    assert by_tokens[:13] == ["b0"] + [f"s{i}" for i in range(11)] + ["b1"], by_tokens


def test_token_counters_lift_a_returning_tenant_and_learn_answer_lengths():
    ledger = FlowLedger(output_token_weight=2.0)
    # Estimates: the prompt, plus the flow's mean answer (none yet: 0) capped by max_tokens.
    assert ledger.charge("a", 500, None) == 500
    ledger.settle("a", 500, 500, 300)  # it answered 300 tokens
    assert ledger.served("a") == 1100
    assert ledger.charge("a", 500, None) == 500 + 2 * 300
    assert ledger.charge("a", 500, 50) == 500 + 2 * 50  # never above max_tokens
    ledger.settle("a", 600, 0, 0)  # a request refused by its worker: no charge, nothing learnt
    assert ledger.charge("a", 0, None) == 2 * 300
    # A flow first seen learns from everybody's answers, and starts where the last pick was.
    assert ledger.pick(["a"]) == "a" and ledger.level == ledger.served("a")
    assert ledger.served("new") == ledger.level
    assert ledger.charge("new", 0, None) == 2 * 300
    # A tenant idle while others were served (its counter far below) is lifted to the lowest
    # of those waiting when it comes back, so it does not take every turn until it catches up.
    ledger.settle("idle", 0, 0, 0)
    ledger._accounts["idle"].served = 0.0
    ledger.lift("idle", ["a", "new"])
    assert ledger.served("idle") == min(ledger.served("a"), ledger.served("new"))
    ledger.lift("a", [])  # nobody else waits: no lower than the last pick's counter
    assert ledger.served("a") >= ledger.level


def test_token_counters_forget_flows_past_the_bound(monkeypatch):
    """A client making up a fairness id per request cannot grow the gateway's memory."""
    monkeypatch.setattr(fair_share, "MAX_ACCOUNTS", 8)
    ledger = FlowLedger()
    for i in range(100):
        ledger.charge(f"f{i}", 10 + i, None)
    assert len(ledger) <= 8


def test_tenant_series_are_bounded_and_name_the_shared_flow(monkeypatch):
    monkeypatch.setattr(router_metrics, "MAX_TENANTS", 3)
    m = RouterMetrics()
    for flow in ("", "id:a", "key:0123", "id:made-up-1", "id:made-up-2", "id:a"):
        requests, prompt, _ = m.per_tenant(flow)
        requests.inc()
        prompt.inc(10)
    page = m.render().decode()
    assert 'router_tenant_requests_total{tenant="shared"} 1.0' in page
    assert 'router_tenant_requests_total{tenant="id:a"} 2.0' in page
    assert 'router_tenant_requests_total{tenant="other"} 2.0' in page  # past the bound
    assert 'router_tenant_tokens_total{kind="prompt",tenant="other"} 20.0' in page
    assert "made-up" not in page and len(m._tenant_children) == 4


def test_a_fairness_id_of_bytes_that_are_not_utf8_is_spelled_out():
    """aiohttp hands such bytes on as lone surrogates: as a metrics label the id would break
    the /metrics page."""
    header = "x-gateway-inference-fairness-id"
    flow = flow_of({header: "team-\udcff"}, header)
    assert flow.startswith("id:team-") and flow.encode()  # encodable: no surrogate left


def test_a_requests_flow_is_its_fairness_header_else_its_api_key():
    header = "x-gateway-inference-fairness-id"
    assert flow_of({header: "team-a", "Authorization": "Bearer k1"}, header) == "id:team-a"
    by_key = flow_of({"Authorization": "Bearer k1"}, header)
    assert by_key.startswith("key:") and "k1" not in by_key  # a digest, not the key
    assert flow_of({"Authorization": "Bearer k2"}, header) not in (by_key, "")
    # With the header switched off (clients could pick their flow with it), keys alone count.
    assert flow_of({header: "team-a", "Authorization": "Bearer k1"}, "") == by_key
    assert flow_of({}, header) == SHARED_FLOW


async def test_queue_lets_the_best_k_ask_at_once_and_reports_their_wait():
    q = AdmissionQueue(max_size=10, ms_per_prompt_token=1.0, askers=2)
    asking: list[int] = []
    done = {i: asyncio.Event() for i in range(5)}

    async def waiter(i: int, prompt: int) -> None:
        async with q.place("m", prompt):
            asking.append(i)
            await done[i].wait()

    assert q.oldest_asker_wait_s("m") == 0.0
    tasks = []
    for i, prompt in enumerate([500, 400, 900, 10, 300]):
        tasks.append(asyncio.create_task(waiter(i, prompt)))
        await asyncio.sleep(0.005)
    # The first two ask at once; the rest wait in shortest-first order.
    assert asking == [0, 1] and q.size == 5
    assert 0.015 <= q.oldest_asker_wait_s("m") < 1.0
    done[1].set()  # the second asker is placed first (the head's prompt fit nowhere yet)
    await asyncio.sleep(0.01)
    assert asking == [0, 1, 3]  # the shortest waiter takes its place; the head still asks
    done[0].set()
    await asyncio.sleep(0.01)
    assert asking == [0, 1, 3, 4]
    for ev in done.values():
        ev.set()
    await asyncio.gather(*tasks)
    assert asking == [0, 1, 3, 4, 2] and q.size == 0 and not q.has_waiters("m")


async def test_queue_lines_are_per_model():
    q = AdmissionQueue(max_size=10)
    hold = asyncio.Event()

    async def hold_head() -> None:
        async with q.place("a"):
            await hold.wait()

    t = asyncio.create_task(hold_head())
    await asyncio.sleep(0.01)
    async with q.place("b"):  # not behind model a's head
        pass
    hold.set()
    await t


def test_fallback_round_robin_passive_health_and_models():
    fb = FallbackRouter(["http://s1"], cooldown_s=60)
    fb.update_from_scheduler([("w1", "http://a", ["m"]), ("w2", "http://b", ["m", "n"])])
    picks = [fb.pick("m", []).worker_id for _ in range(6)]
    assert set(picks) == {"w1", "w2", "http://s1"} and picks[:3] != picks[1:4]
    assert {fb.pick("n", []).worker_id for _ in range(4)} == {"w2", "http://s1"}
    fb.mark_failed("http://a")
    assert "w1" not in {fb.pick("m", []).worker_id for _ in range(6)}
    assert (
        fb.pick("m", ["w2", "http://s1"]).worker_id == "w1"
    )  # everyone else excluded: try the resting one
    assert fb.models() == {"m", "n"}
    with pytest.raises(NoWorkerError):
        FallbackRouter([], 1).pick("m", [])
    with pytest.raises(NoWorkerError) as e:
        fb.pick("unknown", [])
    assert e.value.unknown_model
    with pytest.raises(NoWorkerError) as e:
        fb.pick("n", ["w2", "http://s1"])  # served, but every server of it already failed
    assert not e.value.unknown_model


def test_fallback_round_robin_skips_workers_the_scheduler_listed_cordoned():
    """An operator's cordon holds while the scheduler is away; the worker stays known (stored
    responses are looked up there) and still counts as serving its model (a 503, not a 404)."""
    fb = FallbackRouter([], cooldown_s=60)
    fb.update_from_scheduler([("w1", "http://a", ["m"]), ("w2", "http://b", ["m"])], frozenset({"w1"}))
    assert {fb.pick("m", []).worker_id for _ in range(4)} == {"w2"}
    assert [w.worker_id for w in fb.workers] == ["w1", "w2"] and fb.models() == {"m"}
    fb.update_from_scheduler([("w1", "http://a", ["m"]), ("w2", "http://b", ["m"])], frozenset({"w1", "w2"}))
    with pytest.raises(NoWorkerError) as e:
        fb.pick("m", [])
    assert not e.value.unknown_model and "cordoned" in str(e.value)
    fb.update_from_scheduler([("w1", "http://a", ["m"]), ("w2", "http://b", ["m"])])
    assert {fb.pick("m", []).worker_id for _ in range(4)} == {"w1", "w2"}


def test_fallback_places_a_session_by_rendezvous_hashing():
    """With a session key the fallback picks by rendezvous hashing of (key, worker URL): the same
    worker each time and in another replica, sessions spread, and when a worker rests, is
    excluded, cordoned or leaves, only its own sessions move (to several workers, not one)."""
    views = [(f"w{i}", f"http://10.0.0.{i}:8000", ["m"]) for i in range(5)]
    fb = FallbackRouter(["http://static:8000"], cooldown_s=60)
    fb.update_from_scheduler(views)
    keys = [session_key(f"conversation-{i}") for i in range(600)]
    home = {k: fb.pick("m", [], k).url for k in keys}
    for k in keys[:60]:  # round-robin picks in between turn the rotation, not a session's pick
        fb.pick("m", [])
        assert fb.pick("m", [], k).url == home[k]
    # A replica that knows the same workers only as --workers, listed in another order.
    replica = FallbackRouter(["http://static:8000", *reversed([u for _, u, _ in views])], cooldown_s=60)
    assert {k: replica.pick("m", [], k).url for k in keys} == home
    counts = Counter(home.values())  # 100 each on average
    assert len(counts) == 6 and min(counts.values()) >= 60, counts

    w2 = "http://10.0.0.2:8000"
    orphans = [k for k in keys if home[k] == w2]

    def placed(exclude: list[str] | None = None) -> dict[int, str]:
        out = {k: fb.pick("m", exclude or [], k).url for k in keys}
        assert all(out[k] == home[k] for k in keys if home[k] != w2)  # the others stay
        assert w2 not in out.values() and len({out[k] for k in orphans}) >= 3
        return out

    fb.mark_failed(w2)
    moved = placed()
    fb.mark_ok(w2)
    assert {k: fb.pick("m", [], k).url for k in keys} == home  # back from its rest
    assert placed(["w2"]) == moved  # a failed attempt's retry goes where a rest sends it
    fb.update_from_scheduler(views, frozenset({"w2"}))
    assert placed() == moved
    fb.update_from_scheduler([v for v in views if v[0] != "w2"])
    assert placed() == moved
    # A model only some workers serve (the static one, whose models are unknown, may): among
    # those, by the same scores.
    fb.update_from_scheduler([(wid, url, ["m", "n"] if wid in ("w0", "w1") else ["m"])
                              for wid, url, _ in views])
    serving = {views[0][1], views[1][1], "http://static:8000"}
    assert {fb.pick("n", [], k).url for k in keys} == serving
    assert all(fb.pick("n", [], k).url == home[k] for k in keys if home[k] in serving)


def test_api_keys():
    kc = KeyChecker([b"k1", b"k2"])
    assert kc.allows("Bearer k2") and kc.allows("bearer k1")
    assert not kc.allows("Bearer k3") and not kc.allows(None) and not kc.allows("Basic k1")
    assert KeyChecker([]).allows(None)
    assert bearer_token("Bearer  abc ") == b"abc"
    # A header byte that is not UTF-8 (aiohttp hands it on as a lone surrogate): a key that
    # does not match, not an exception; the fair queue keys a flow by it.
    raw = b"Bearer k1\xff".decode("utf-8", "surrogateescape")
    assert bearer_token(raw) == b"k1\xff" and not kc.allows(raw)
    assert flow_of({"Authorization": raw}, "").startswith("key:")


def test_fast_metrics_export_standard_families():
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import RouterMetrics

    m = RouterMetrics()
    for v in (0.0005, 0.001, 0.003, 7.0, 1000.0):
        m.per_model("m")[2].observe(v)  # ttft
    m.request_done("m", 200, "w1")
    m.request_done("m", 200, "w1")
    m.in_flight.inc()
    m.fallback_requests.inc(3)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    req = fams["router_requests"].samples[0]
    assert req.labels == {"model": "m", "status": "200", "worker": "w1"} and req.value == 2
    assert fams["router_requests_in_flight"].samples[0].value == 1
    assert fams["router_fallback_requests"].samples[0].value == 3
    buckets = {
        s.labels["le"]: s.value
        for s in fams["router_time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert (
        buckets["0.001"] == 2 and buckets["0.005"] == 3 and buckets["10.0"] == 4 and buckets["+Inf"] == 5
    )
    total = next(
        s for s in fams["router_time_to_first_token_seconds"].samples if s.name.endswith("_sum")
    )
    assert abs(total.value - 1007.0045) < 1e-9


def test_token_counter_with_a_local_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from router.tokens import TokenCounter

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the cat sat on the mat"], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    exact = TokenCounter(str(tmp_path))  # a directory holding tokenizer.json
    assert exact.exact and exact.count("the cat sat on the mat") == 6
    assert exact.count("the dog", 3) == 5  # unknown words still count; ids given directly add up
    rough = TokenCounter(None)
    assert not rough.exact and rough.count("the cat sat on the mat") == estimate_tokens(
        "the cat sat on the mat"
    )
    with pytest.raises(SystemExit):
        TokenCounter(str(tmp_path / "missing.json"))


def test_a_request_for_n_choices_is_planned_as_n_sequences():
    """vLLM fans n out into n engine requests: n prompts to prefill, n answers' KV."""
    counter = TokenCounter(None)
    body = {"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 50}
    one, prompt, choices = schedule_request(counter, "m", body)
    assert (choices, one["prompt_tokens"], one["max_tokens"]) == (1, prompt, 50) and prompt > 200
    four, prompt4, choices4 = schedule_request(counter, "m", {**body, "n": 4})
    assert (choices4, prompt4) == (4, prompt)  # the prompt estimate itself (for the log) is unchanged
    assert (four["prompt_tokens"], four["max_tokens"]) == (4 * prompt, 200)
    assert four["prefix_hashes"] == one["prefix_hashes"]
    # Older vLLM's best_of generates best_of sequences; junk and absurd values do not count.
    assert schedule_request(counter, "m", {**body, "n": 2, "best_of": 3})[2] == 3
    # What vLLM's lax pydantic takes for 4 is 4 (router/lax_fields.py).
    assert schedule_request(counter, "m", {**body, "n": "4"})[2] == 4
    assert schedule_request(counter, "m", {**body, "n": 4.0})[2] == 4
    for junk in ("x", 1.5, True, 0, -2, None):
        assert schedule_request(counter, "m", {**body, "n": junk})[2] == 1
    assert schedule_request(counter, "m", {**body, "n": 10**9})[2] == 128
    # A batch of three prompts: each answer's KV counts (the prompts' sizes add up already).
    batch = {"prompt": ["x" * 400, "y" * 400, "z" * 400], "max_tokens": 50, "n": 2}
    sched, prompt, _ = schedule_request(counter, "m", batch)
    assert prompt >= 300 and sched["prompt_tokens"] == 2 * prompt and sched["max_tokens"] == 300


def test_access_log_quotes_and_cuts_client_chosen_fields():
    """A model name is the client's to choose: a newline in it must not forge a second log
    line, nor 5,000 characters flood the log; ordinary names stay bare."""
    import io

    from router.access_log import MAX_FIELD_CHARS, AccessLog, RequestRecord

    out = io.StringIO()
    log = AccessLog(stream=out)
    for model in ("smollm2", "x\n2026-01-01 00:00:00,000 INFO router.access: id=forged", "a" * 5000):
        rec = RequestRecord("r1", "POST", "/v1/completions")
        rec.model = model
        log.add(rec)
    log.flush()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and not any("id=forged" in line.split(" model=")[0] for line in lines)
    assert " model=smollm2 " in lines[0]
    assert ' model="x\\n2026-01-01' in lines[1]
    assert len(lines[2]) < MAX_FIELD_CHARS + 300 and lines[2].count("a") >= MAX_FIELD_CHARS


def test_stats_line_counts_tokens_of_served_requests_only():
    stats = Stats()
    refused = RequestRecord("r1", "POST", "/v1/completions")
    refused.model, refused.status, refused.prompt_tokens = "m", 429, 100  # a full queue's 429
    served = RequestRecord("r2", "POST", "/v1/completions")
    served.model, served.worker, served.status = "m", "w1", 200
    served.prompt_tokens, served.output_tokens, served.ttft_ms = 7, 3, 12.0
    left = RequestRecord("r3", "POST", "/v1/completions")  # its client left mid-stream
    left.model, left.worker, left.status, left.output_tokens = "m", "w1", 499, 5
    for rec in (refused, served, left):
        stats.add(rec)
    assert (stats.done, stats.errors) == (3, 2)
    assert (stats.prompt_tokens, stats.output_tokens, stats.ttft_n) == (7, 8, 1)


async def test_an_idle_gateway_logs_one_stats_line_of_zeros_then_none(caplog):
    """It logged `req/s=0.0 errors=0 ...` every 5 s forever; the workers stay quiet when idle."""
    from router.access_log import stats_loop

    stats, gauges = Stats(), {"in_flight": 0, "queued": 0, "fallback": False}
    loop = asyncio.create_task(stats_loop(
        stats, lambda: (gauges["in_flight"], gauges["queued"], gauges["fallback"]), 0.02))

    async def lines_after(step) -> list[str]:
        caplog.clear()
        step()
        await asyncio.sleep(0.2)  # ten intervals
        return [r.getMessage() for r in caplog.records if r.name == "router.stats"]

    try:
        with caplog.at_level("INFO", logger="router.stats"):
            assert await lines_after(lambda: None) == []  # just started, nothing happened
            stats.add(RequestRecord("a", "POST", "/v1/completions"))
            busy = await lines_after(lambda: gauges.update(in_flight=1))
            assert len(busy) >= 3 and all("in_flight=1" in line for line in busy)
            idle = await lines_after(lambda: gauges.update(in_flight=0))
            assert len(idle) == 1 and "req/s=0.0" in idle[0] and "in_flight=0" in idle[0], idle
            assert await lines_after(lambda: None) == []
            fallback = await lines_after(lambda: gauges.update(fallback=True))  # a mode change
            assert len(fallback) == 1 and "mode=fallback" in fallback[0], fallback
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
