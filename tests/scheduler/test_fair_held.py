"""Held calls get freed room by priority, then in the order of their flows' token counters
(scheduler/service.py, scheduler/fair_share.py): over every gateway's traffic, the tenant served
least goes first."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler.policies import Request
from scheduler.protocol import LeaseRelease
from scheduler.service import Wait
from tests.scheduler.helpers import feed, make_service, worker

DOCS, CHAT = ("docs", 2000, 200), ("chat", 100, 20)  # flow, prompt tokens, output tokens


def one_at_a_time(config: dict | None = None, models: tuple[str, ...] = ("m",)):
    """One worker that runs one request at a time (max_running 1), already running one."""
    svc = make_service(n=1, config=config, max_running=1)
    w = worker(svc, "w0")
    if len(models) > 1:
        svc.registry.set_models(w, set(models))
    first = svc.decide(Request(models[0], 10, 10), 0.0)
    assert isinstance(first, dict)
    return svc, first["lease_id"]


async def placement_order(svc, blocker: str, calls: list[tuple]) -> list[str]:
    """Hold `calls` (name, flow, prompt, output[, priority]) in this order, then free the
    worker's one place again and again: the names in the order they got it. Each ends using
    what it said."""
    tasks: dict[asyncio.Task, tuple[str, str, int, int]] = {}
    for name, flow, prompt, output, *priority in calls:
        req = Request("m", prompt, 4 * output, flow=flow, priority=priority[0] if priority else 0)
        tasks[asyncio.create_task(svc.schedule(req, wait_ms=5000))] = (name, flow, prompt, output)
        await asyncio.sleep(0.002)
    assert not any(t.done() for t in tasks), "the worker was full: every call should wait"
    order, lease, used = [], blocker, (10, 10)
    while tasks:
        svc.release_reported(LeaseRelease(lease_id=lease, ok=True, prompt_tokens=used[0],
                                          output_tokens=used[1]))
        done, _ = await asyncio.wait(tasks, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "one place freed, one call placed"
        task = done.pop()
        name, _flow, prompt, output = tasks.pop(task)
        out = task.result()
        assert isinstance(out, dict), out
        order.append(name)
        lease, used = out["lease_id"], (prompt, output)
    return order


def interleaved(n: int = 3) -> list[tuple[str, str, int, int]]:
    calls = []
    for i in range(1, n + 1):
        calls += [(f"d{i}", *DOCS), (f"c{i}", *CHAT)]
    return calls


def test_freed_room_goes_to_the_flow_served_fewest_tokens_not_to_the_oldest_call():
    svc, blocker = one_at_a_time()
    order = asyncio.run(placement_order(svc, blocker, interleaved()))
    # d1 and c1 start level; after d1's 2000-token prompt the chat calls go until chat has
    # been served as much, then documents again.
    assert order == ["d1", "c1", "c2", "c3", "d2", "d3"]
    state = svc.fair_state()["m"]
    assert state["most_served"]["docs"] == pytest.approx(3 * (2000 + 2 * 200))
    assert state["most_served"]["chat"] == pytest.approx(3 * (100 + 2 * 20))


def test_with_fair_share_off_held_calls_go_in_arrival_order():
    svc, blocker = one_at_a_time(config={"fair_share": False})
    order = asyncio.run(placement_order(svc, blocker, interleaved()))
    assert order == ["d1", "c1", "d2", "c2", "d3", "c3"]
    assert svc.fair_state() == {}


def test_calls_without_a_flow_keep_their_place_in_arrival_order():
    svc, blocker = one_at_a_time()
    calls = [("d1", *DOCS), ("x1", None, 50, 5), ("c1", *CHAT), ("d2", *DOCS), ("x2", None, 50, 5),
             ("c2", *CHAT)]
    order = asyncio.run(placement_order(svc, blocker, calls))
    # The flow-less calls keep slots 2 and 5; the flows' calls fill the others in their order.
    assert order[1] == "x1" and order[4] == "x2"
    assert [n for n in order if not n.startswith("x")] == ["d1", "c1", "c2", "d2"]


def test_freed_room_goes_to_the_better_priority_first_then_to_the_flows_turns():
    """The gateway's askers (--queue-askers) and other replicas' heads are held side by side:
    a priority -1 call held last must get the next room before priority 0 and 5 calls held
    before it, whatever the flows' counters say; within a priority the counters decide."""
    svc, blocker = one_at_a_time()
    calls = [("late1", *CHAT, 5), ("now1", *CHAT, 0), ("d1", *DOCS, 0), ("late2", *DOCS, 5),
             ("urgent", *DOCS, -1), ("c2", *CHAT, 0)]
    order = asyncio.run(placement_order(svc, blocker, calls))
    assert order[0] == "urgent"
    # Priority 0: docs was served a 2000-token prompt (urgent's), so chat's two go first.
    assert order[1:4] == ["now1", "c2", "d1"]
    assert order[4:] == ["late1", "late2"]


def test_with_fair_share_off_each_priority_keeps_its_arrival_order():
    svc, blocker = one_at_a_time(config={"fair_share": False})
    calls = [("b1", *CHAT, 3), ("a1", *DOCS, 0), ("b2", *DOCS, 3), ("a2", *CHAT, 0), ("x", None, 10, 5, -2)]
    order = asyncio.run(placement_order(svc, blocker, calls))
    assert order == ["x", "a1", "a2", "b1", "b2"]


def test_a_request_asking_again_goes_ahead_of_calls_held_since_it_arrived():
    """A gateway's long poll runs out and it asks again, saying how long its request has
    waited: the call goes in at its request's arrival, not behind every call held since."""
    svc, blocker = one_at_a_time(config={"fair_share": False})

    async def scenario() -> list[str]:
        names = {}
        for name, waited_ms in (("new1", 0), ("new2", 0), ("old", 5000)):
            task = asyncio.create_task(svc.schedule(Request("m", 10, 10), 5000, waited_ms))
            names[task] = name
            await asyncio.sleep(0.005)
        order, lease = [], blocker
        while names:
            svc.release(lease, True)
            done, _ = await asyncio.wait(names, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
            task = done.pop()
            order.append(names.pop(task))
            lease = task.result()["lease_id"]
        return order

    assert asyncio.run(scenario()) == ["old", "new1", "new2"]


def test_a_flow_asking_again_after_its_poll_ran_out_is_not_lifted():
    """A flow's held call runs out unplaced and its gateway asks again for the same request:
    the flow is still waiting, not arriving, so it keeps the counter that makes it next (a
    lift to the lowest counter beside it gave the room to a heavier tenant's call)."""
    svc, blocker = one_at_a_time()
    ledger = svc._ledger_of(Request("m", flow="chat"))

    async def scenario() -> tuple[bool, bool, float, float]:
        def ask(flow: str, wait_ms: int = 5000, waited_ms: int = 0) -> asyncio.Task:
            return asyncio.create_task(svc.schedule(Request("m", 10, 5, flow=flow), wait_ms, waited_ms))
        docs1, docs2 = ask("docs"), ask("docs")
        await asyncio.sleep(0.005)
        started = time.monotonic()
        chat = ask("chat", wait_ms=200)
        await asyncio.sleep(0.01)
        svc.release(blocker, True)  # docs1 held first (a tie): its flow is charged
        placed = (await asyncio.wait_for(docs1, 2.0))["lease_id"]
        assert isinstance(await chat, Wait)  # its poll ran out: the gateway asks again
        before = ledger.served("chat")
        chat = ask("chat", waited_ms=int((time.monotonic() - started) * 1000))
        await asyncio.sleep(0.01)
        after = ledger.served("chat")
        svc.release(placed, True)
        await asyncio.wait([chat, docs2], timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        result = (chat.done(), docs2.done(), before, after)
        for task in (chat, docs2):
            task.cancel()
        await asyncio.gather(chat, docs2, return_exceptions=True)
        return result

    chat_placed, docs_placed, before, after = asyncio.run(scenario())
    assert after == before < ledger.served("docs")
    assert chat_placed and not docs_placed


def test_counters_of_different_models_do_not_reorder_their_calls():
    svc, blocker = one_at_a_time(models=("m", "n"))

    async def scenario() -> list[str]:
        # docs on model m has been served a lot; a fresh flow on model n arrives after it.
        heavy = svc._ledger_of(Request("m", flow="docs"))
        heavy.charge("docs", 100_000, None)
        tasks = {asyncio.create_task(svc.schedule(Request("m", 100, 10, flow="docs"), wait_ms=5000)): "m",
                 asyncio.create_task(svc.schedule(Request("n", 100, 10, flow="new"), wait_ms=5000)): "n"}
        await asyncio.sleep(0.01)
        svc.release(blocker, True)
        done, _ = await asyncio.wait(tasks, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        return [tasks[t] for t in done]

    assert asyncio.run(scenario()) == ["m"]


def test_a_call_that_times_out_or_is_cancelled_leaves_the_held_list():
    svc, _blocker = one_at_a_time()

    async def scenario() -> None:
        out = await svc.schedule(Request("m", 10, 10, flow="a"), wait_ms=20)
        assert isinstance(out, Wait)
        task = asyncio.create_task(svc.schedule(Request("m", 10, 10, flow="b"), wait_ms=5000))
        await asyncio.sleep(0.01)
        assert len(svc.held) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(svc.held) == 0

    asyncio.run(scenario())


def test_a_handed_off_request_keeps_its_estimate_and_a_refused_one_gives_it_back():
    svc = make_service(n=1)
    out = svc.decide(Request("m", 300, 50, flow="t"), 0.0)
    ledger = svc._ledger_of(Request("m", flow="t"))
    charged = ledger.served("t")
    assert charged >= 300  # the prompt, and no answer length learnt yet
    svc.release_reported(LeaseRelease(lease_id=out["lease_id"], ok=True, prompt_tokens=0, output_tokens=0,
                                      handed_off=True))
    assert ledger.served("t") == pytest.approx(charged)
    refused = svc.decide(Request("m", 300, 50, flow="t"), 0.0)
    svc.release_reported(LeaseRelease(lease_id=refused["lease_id"], ok=False, prompt_tokens=0,
                                      output_tokens=0))
    assert ledger.served("t") == pytest.approx(charged)


def test_a_flow_with_requests_running_is_not_lifted_when_its_next_request_waits():
    """Each gateway asks for its queue's head only, so a busy tenant's next request asks anew
    after each placement. Lifting it then to the counter of the heavy tenant held beside it
    would undo the turn it just had; a tenant that was away is lifted (no credit banked)."""
    svc = make_service(n=1, max_running=2)
    ledger = svc._ledger_of(Request("m", flow="chat"))
    chat = svc.decide(Request("m", 10, 5, flow="chat"), 0.0)  # chat has a request running
    assert isinstance(chat, dict)
    ledger.charge("docs", 50_000, None)  # docs has been served far more
    svc.decide(Request("m", 10, 5, flow="docs"), 0.0)  # the worker is full now

    async def scenario() -> tuple[float, float]:
        held = [asyncio.create_task(svc.schedule(Request("m", 3000, 10, flow="docs"), wait_ms=5000))]
        await asyncio.sleep(0.01)
        before = ledger.served("chat")
        held.append(asyncio.create_task(svc.schedule(Request("m", 10, 5, flow="chat"), wait_ms=5000)))
        await asyncio.sleep(0.01)
        busy = ledger.served("chat") - before
        svc.release(chat["lease_id"], True)  # chat's request ends; its held one takes the place
        await asyncio.wait(held, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        assert held[1].done() and not held[0].done()
        # A tenant seen before but idle now arrives while docs waits: lifted to docs' counter.
        ledger.charge("away", 1, None)
        held.append(asyncio.create_task(svc.schedule(Request("m", 10, 5, flow="away"), wait_ms=5000)))
        await asyncio.sleep(0.01)
        away = ledger.served("away")
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        return busy, away

    busy, away = asyncio.run(scenario())
    assert busy == 0
    assert away == pytest.approx(ledger.served("docs"))
    assert svc._open_flows[ledger, "chat"] == 1  # the held one, now running


def test_a_snapshot_of_a_worker_still_full_does_not_wake_the_held_calls():
    """Every scrape of every worker woke every held call, and each decided again over every
    worker: held calls x workers decisions per scrape, all for the same wait while the pool stays
    full. A snapshot that leaves its worker full (here: its running cap) wakes nobody; one that
    shows room does."""
    svc, blocker = one_at_a_time()
    w = svc.registry.workers["w0"]
    decisions = []
    decide = svc.decide

    def counted(req, now, arrival=None):
        decisions.append(now)
        return decide(req, now, arrival)

    svc.decide = counted

    async def scenario() -> tuple[int, bool, bool]:
        held = asyncio.create_task(svc.schedule(Request("m", 10, 10), wait_ms=5000))
        await asyncio.sleep(0.01)
        before = len(decisions)
        for _ in range(5):
            feed(svc, w, running=1)  # the blocker still runs: full
            await asyncio.sleep(0.001)
        woken = len(decisions) - before
        still_held = not held.done()
        svc.release(blocker, True)  # room: the held call is placed
        out = await asyncio.wait_for(held, 2.0)
        return woken, still_held, isinstance(out, dict)

    woken, still_held, placed = asyncio.run(scenario())
    assert still_held and placed
    assert woken == 0
