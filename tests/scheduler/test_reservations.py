"""Follow-up reservations: a finished turn's room is held for the conversation's next turn.

The real decision core in process with synthetic scrapes (tests/scheduler/helpers.py)."""

from __future__ import annotations

import asyncio
import time

from scheduler.config import SchedulerConfig
from scheduler.policies import Request
from scheduler.registry import WorkerState
from scheduler.service import SchedulerService, Wait
from tests.scheduler.helpers import feed, worker

HISTORY = [11, 12, 13]  # the first turn's prefix fingerprints
FOLLOW_UP = [*HISTORY, 14, 15]  # the next turn's prompt: history, answer, new message


def service(hold_ms: float = 5000.0, n: int = 2) -> SchedulerService:
    # visibility_lag_ms 0: a lease issued before a scrape counts as seen by it.
    cfg = SchedulerConfig(policy="llm_aware", followup_hold_ms=hold_ms, visibility_lag_ms=0,
                          policy_params={"output_fraction": 0.0})
    svc = SchedulerService(cfg)
    for i in range(n):
        w = svc.add_worker(WorkerState(f"http://127.0.0.1:{9000 + i}", worker_id=f"w{i}", models=["m"]))
        w.health.on_success(time.monotonic(), 1)
        feed(svc, w, kv=0.5)
    return svc


def req(hashes=(), prompt: int = 800, reserved_only: bool = False) -> Request:
    return Request("m", prompt, 100, prefix_hashes=list(hashes), reserved_only=reserved_only)


def finish_first_turn_on_full_cluster(svc: SchedulerService) -> str:
    """A first turn runs on some worker; then the cluster fills (every worker past
    max_kv_usage) and the turn ends, freeing 10 % of its worker's KV. Returns that worker."""
    out = svc.decide(req(HISTORY), time.monotonic())
    time.sleep(0.002)
    for w in svc.registry.workers.values():
        feed(svc, w, running=30, kv=0.96)
    # 16,000-token pools: 1,600 tokens is 10 %, enough to bring the worker under 0.95.
    assert svc.release(out["lease_id"], True, used_tokens=1600)
    return out["worker_id"]


async def test_freed_room_waits_for_the_follow_up_and_not_for_others():
    svc = service()
    home = finish_first_turn_on_full_cluster(svc)
    assert worker(svc, home).reserved_tokens == 1600
    # Without the hold, the freed room would go to whoever asks first.
    assert isinstance(svc.decide(req([99, 98]), time.monotonic()), Wait)
    assert isinstance(svc.decide(req(), time.monotonic()), Wait)
    out = svc.decide(req(FOLLOW_UP), time.monotonic())
    assert out["worker_id"] == home
    assert out["reason"]["followup"] is True
    assert out["reason"]["prefix_match"] == len(HISTORY)
    assert worker(svc, home).reserved_tokens == 0
    assert svc.reservations.claimed == 1


async def test_without_the_hold_the_room_goes_to_the_next_asker():
    svc = service(hold_ms=0)
    home = finish_first_turn_on_full_cluster(svc)
    out = svc.decide(req([99, 98]), time.monotonic())
    assert out["worker_id"] == home
    assert worker(svc, home).reserved_tokens == 0


async def test_reserved_only_passes_the_queue_into_its_own_reservation_only():
    svc = service()
    home = finish_first_turn_on_full_cluster(svc)
    stranger = svc.decide(req([99, 98], reserved_only=True), time.monotonic())
    assert isinstance(stranger, Wait) and stranger.reason == "no_reservation"
    out = svc.decide(req(FOLLOW_UP, reserved_only=True), time.monotonic())
    assert out["worker_id"] == home
    # Nothing is held any more: a reserved_only call waits even with room about.
    for w in svc.registry.workers.values():
        feed(svc, w, kv=0.1)
    again = svc.decide(req(FOLLOW_UP, reserved_only=True), time.monotonic())
    assert isinstance(again, Wait) and again.reason == "no_reservation"


async def test_reserved_only_without_holds_says_so():
    svc = service(hold_ms=0)
    finish_first_turn_on_full_cluster(svc)
    out = svc.decide(req(FOLLOW_UP, reserved_only=True), time.monotonic())
    assert isinstance(out, Wait) and out.reason == "holds_off"  # the gateway stops asking


async def test_an_unclaimed_hold_expires_and_wakes_a_held_request():
    svc = service(hold_ms=40)
    home = finish_first_turn_on_full_cluster(svc)
    t0 = time.monotonic()
    out = await svc.schedule(req([99, 98]), wait_ms=2000)
    waited = time.monotonic() - t0
    assert isinstance(out, dict) and out["worker_id"] == home
    # Woken by the expiry itself, not by a timeout or a new scrape.
    assert 0.02 <= waited < 1.0
    assert svc.reservations.expired == 1 and worker(svc, home).reserved_tokens == 0


async def test_holds_become_rare_when_no_follow_up_ever_claims_them():
    svc = service(hold_ms=1)
    table = svc.reservations
    w = worker(svc, "w0")
    for i in range(80):  # single-turn traffic: every hold expires unclaimed
        table.hold(1000 + i, w, 100.0)
        await asyncio.sleep(0.003)
    assert table.claim_rate < table.min_claim_rate
    made_before = table.claimed + table.expired
    for i in range(4 * table.probe_every):
        table.hold(5000 + i, w, 100.0)
    await asyncio.sleep(0.01)
    # Only the probes are held: about one release in probe_every.
    assert table.claimed + table.expired - made_before == 4
    assert w.reserved_tokens == 0


async def test_a_hold_on_a_worker_that_started_queueing_is_not_used():
    svc = service()
    home = finish_first_turn_on_full_cluster(svc)
    feed(svc, worker(svc, home), running=30, waiting=2, kv=0.96)  # its engine queues now
    out = svc.decide(req(FOLLOW_UP), time.monotonic())
    assert isinstance(out, Wait)  # held in the gateway, not sent behind that queue
    assert not svc.reservations.by_key and worker(svc, home).reserved_tokens == 0


async def test_a_removed_worker_takes_its_holds_along():
    svc = service()
    home = finish_first_turn_on_full_cluster(svc)
    assert svc.remove_worker(home)
    assert not svc.reservations.by_key
    out = svc.decide(req(FOLLOW_UP), time.monotonic())
    assert not isinstance(out, dict) or out["worker_id"] != home



def attached(hashes: list[int], prompt: int = 800) -> Request:
    """A WebSocket's request on w0, the worker its socket is connected to."""
    return Request("m", prompt, 100, prefix_hashes=hashes, pin="w0", attach=True)


async def finish_on(svc: SchedulerService, first: Request) -> None:
    out = svc.decide(first, time.monotonic())
    await asyncio.sleep(0.002)
    for w in svc.registry.workers.values():
        feed(svc, w, running=1, kv=0.6)
    assert svc.release(out["lease_id"], True, used_tokens=900)


async def test_a_websocket_requests_hold_goes_to_the_sockets_next_request():
    """A socket's requests are attached to its worker, never chosen: the room a finished one's
    release holds is claimed by the socket's next request, not left held for nobody (counted
    twice until it expired, and lowering the claim rate that decides whether chat traffic gets
    holds at all)."""
    svc = service()
    await finish_on(svc, attached(HISTORY))
    assert worker(svc, "w0").reserved_tokens == 900
    nxt = svc.decide(attached(FOLLOW_UP, 1000), time.monotonic())
    assert nxt["worker_id"] == "w0" and nxt["reason"]["prefix_match"] == len(HISTORY)
    assert svc.reservations.claimed == 1 and worker(svc, "w0").reserved_tokens == 0


async def test_a_websocket_request_takes_no_hold_on_another_worker():
    svc = service()
    await finish_on(svc, Request("m", 800, 100, prefix_hashes=HISTORY, pin="w1"))
    assert svc.decide(attached(FOLLOW_UP, 1000), time.monotonic())["worker_id"] == "w0"
    assert svc.reservations.claimed == 0 and worker(svc, "w1").reserved_tokens == 900


async def test_a_hold_is_claimed_by_the_same_adapters_follow_up_only():
    """Engines cache per adapter: room held for a conversation's next turn under one adapter
    (or the base model) must not go to the same text under another, whose cache it is not."""
    svc = service()
    home = finish_first_turn_on_full_cluster(svc)
    other = Request("m", 800, 100, prefix_hashes=list(FOLLOW_UP), lora="adapter-b")
    assert isinstance(svc.decide(other, time.monotonic()), Wait)
    out = svc.decide(req(FOLLOW_UP), time.monotonic())
    assert out["worker_id"] == home and out["reason"]["followup"] is True


def test_adapter_scopes_past_the_bound_keep_their_keys_without_being_kept():
    from scheduler.policies.prefix_index import MAX_SCOPES, PrefixIndex

    index = PrefixIndex()
    assert index.keys([1, 2], ("m", None)) == [1, 2]  # the first scope pays nothing
    for i in range(MAX_SCOPES + 50):
        index.keys([1], ("m", f"made-up-{i}"))
    assert len(index._salts) == MAX_SCOPES
    late = ("m", f"made-up-{MAX_SCOPES + 10}")
    assert index.keys([1, 2], late) == index.keys([1, 2], late) != [1, 2]  # stable, and scoped
