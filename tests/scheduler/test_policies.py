"""Policy and decision-core unit tests (in process; no HTTP)."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from scheduler.health import DOWN, HALF_OPEN, UP
from scheduler.policies import POLICIES, Request
from scheduler.protocol import CLIENT_LEFT, LeaseRelease
from scheduler.registry import WorkerState
from scheduler.service import UNKNOWN_MODEL, Wait
from tests.scheduler.helpers import feed, make_service, worker


def decide(svc, **kw):
    kw.setdefault("prompt_tokens", 100)
    kw.setdefault("max_tokens", 100)
    return svc.decide(Request(kw.pop("model", "m"), **kw), time.monotonic())


def test_saturated_worker_not_chosen_while_another_has_headroom():
    svc = make_service()
    feed(svc, worker(svc, "w0"), running=1, waiting=3)  # queueing: saturated
    feed(svc, worker(svc, "w1"), running=1, kv=0.97)  # KV almost full: saturated
    feed(svc, worker(svc, "w2"), running=20)  # busy but admits more
    for _ in range(5):
        out = decide(svc)
        assert out["worker_id"] == "w2"
        svc.release(out["lease_id"], True)


def test_request_larger_than_free_kv_goes_where_it_fits():
    svc = make_service()
    # w0: 1000 blocks * 16 tokens at 80% -> 3200 free tokens; w1 at 10% with more running.
    feed(svc, worker(svc, "w0"), running=1, kv=0.8)
    feed(svc, worker(svc, "w1"), running=12, kv=0.1)
    feed(svc, worker(svc, "w2"), running=12, kv=0.1)
    small = decide(svc, prompt_tokens=100, max_tokens=100)
    assert small["worker_id"] == "w0"
    # llm_aware admits on the prompt (output_fraction 0): 3150 tokens need 197 blocks, more than
    # the 193 left on w0 after small's lease.
    big = decide(svc, prompt_tokens=3150, max_tokens=1000)
    assert big["worker_id"] in ("w1", "w2")


def test_unseen_leases_take_the_kv_the_policy_counts_as_need():
    """Between scrapes a lease stands for KV the worker cannot show yet. With output_fraction 0
    llm_aware admits on the prompt alone, so a lease counts its prompt, not prompt + max_tokens:
    a worker with 1,600 free tokens takes three 500-token prompts with max_tokens 1000 before
    the next scrape (counting max_tokens, it would have been full after the first)."""
    svc = make_service(n=1, output_fraction=0.0, max_waiting=100, max_kv_usage=1.0)
    feed(svc, worker(svc, "w0"), running=5, kv=0.9)  # 16,000-token pool: 1,600 free
    picks = [decide(svc, prompt_tokens=500, max_tokens=1000) for _ in range(4)]
    assert [isinstance(p, Wait) for p in picks] == [False, False, False, True]
    assert worker(svc, "w0").unseen_tokens == 1500
    half = make_service(n=1, output_fraction=0.5, max_waiting=100, max_kv_usage=1.0)
    feed(half, worker(half, "w0"), running=5, kv=0.9)
    assert not isinstance(decide(half, prompt_tokens=500, max_tokens=1000), Wait)
    assert isinstance(decide(half, prompt_tokens=500, max_tokens=1000), Wait)  # 1000 + 1000 > 1600
    # Policies without their own need keep the whole span (least_kv weighs it).
    lkv = make_service("least_kv", n=1)
    decide(lkv, prompt_tokens=500, max_tokens=1000)
    assert worker(lkv, "w0").unseen_tokens == 1500


@pytest.mark.parametrize(
    "policy", ["llm_aware", "least_request", "least_kv", "power_of_two", "prefix_affinity"]
)
def test_burst_between_scrapes_spreads(policy):
    svc = make_service(policy, n=3) if policy != "llm_aware" else make_service(policy, n=3, max_waiting=100)
    counts = collections.Counter(decide(svc)["worker_id"] for _ in range(30))
    assert len(counts) == 3
    assert max(counts.values()) <= 14, counts  # no herd onto the "least loaded" one


def test_llm_aware_burst_is_even_and_reconciles_on_next_scrape():
    svc = make_service(max_waiting=100)
    leases = [decide(svc) for _ in range(30)]
    counts = collections.Counter(d["worker_id"] for d in leases)
    assert sorted(counts.values()) == [10, 10, 10]
    w0 = worker(svc, "w0")
    assert w0.unseen == 10 and w0.running_eff == 10
    # The next scrape (sent after the leases) shows the 10 requests running: not counted twice.
    feed(svc, w0, running=10, taken_at=time.monotonic() + 1.0)
    assert w0.unseen == 0 and w0.running_eff == 10
    # Releasing a lease the scrape saw frees one slot until the next scrape.
    mine = next(d for d in leases if d["worker_id"] == "w0")
    assert svc.release(mine["lease_id"], True)
    assert w0.running_eff == 9 and w0.in_flight == 9


def test_all_saturated_answers_wait_and_hold_wakes_on_capacity():
    svc = make_service()
    for wid in ("w0", "w1", "w2"):
        feed(svc, worker(svc, wid), running=8, waiting=2)
    assert isinstance(decide(svc), Wait)

    async def scenario():
        t0 = time.monotonic()
        task = asyncio.create_task(svc.schedule(Request("m", 10, 10), wait_ms=5000))
        await asyncio.sleep(0.05)
        assert not task.done()
        feed(svc, worker(svc, "w1"), running=8, waiting=0)  # a scrape shows room again
        out = await asyncio.wait_for(task, 1.0)
        return out, time.monotonic() - t0

    out, elapsed = asyncio.run(scenario())
    assert out["worker_id"] == "w1"
    assert elapsed < 1.0


def test_hold_times_out_with_wait():
    svc = make_service()
    for wid in ("w0", "w1", "w2"):
        feed(svc, worker(svc, wid), waiting=5)
    out = asyncio.run(svc.schedule(Request("m", 10, 10), wait_ms=30))
    assert isinstance(out, Wait) and out.retry_after_ms > 0


def test_stale_data_counts_as_saturated():
    svc = make_service()
    old = time.monotonic() - 5.0
    feed(svc, worker(svc, "w0"), taken_at=old)
    feed(svc, worker(svc, "w1"), taken_at=old)
    feed(svc, worker(svc, "w2"), running=30)
    assert {decide(svc)["worker_id"] for _ in range(5)} == {"w2"}


def test_unknown_model_and_model_filtering():
    svc = make_service()
    assert decide(svc, model="nope") == UNKNOWN_MODEL
    from scheduler.registry import WorkerState

    other = svc.add_worker(WorkerState("http://127.0.0.1:9100", worker_id="x", models=["other"]))
    other.health.on_success(time.monotonic(), 1)
    feed(svc, other)
    assert {decide(svc, model="other")["worker_id"] for _ in range(5)} == {"x"}
    assert "x" not in {decide(svc)["worker_id"] for _ in range(9)}


def test_exclude_is_respected():
    svc = make_service("round_robin")
    seen = {decide(svc, exclude=frozenset({"w1"}))["worker_id"] for _ in range(6)}
    assert seen == {"w0", "w2"}


@pytest.mark.parametrize("policy", ["llm_aware", "round_robin"])
def test_a_pinned_request_goes_to_its_worker_only_and_waits_out_its_saturation(policy):
    """A follow-up of a response one worker stores (previous_response_id) goes there even when
    another worker is the better pick, waits while its worker is full, and is told when that
    worker is down or gone (its stored state with it)."""
    svc = make_service(policy)
    feed(svc, worker(svc, "w0"), running=20)
    assert {decide(svc, pin="w0")["worker_id"] for _ in range(6)} == {"w0"}
    if policy == "llm_aware":
        feed(svc, worker(svc, "w0"), running=1, waiting=3)  # queueing: saturated
        out = decide(svc, pin="w0")
        assert isinstance(out, Wait) and out.reason == "saturated"
        assert decide(svc)["worker_id"] != "w0"  # the others are free for the rest
    svc.report_failure("w0", "connect")
    out = decide(svc, pin="w0")
    assert isinstance(out, Wait) and out.reason == "pinned_worker_unavailable"
    svc.remove_worker("w0")
    out = decide(svc, pin="w0")
    assert isinstance(out, Wait) and out.reason == "pinned_worker_gone"


def test_an_attached_request_is_counted_on_its_worker_whatever_its_load():
    """A WebSocket's next request goes to the worker its socket is connected to, full or not:
    the scheduler leases it there (its load counts at once, unseen by the last scrape) instead
    of answering wait, and is not its trial; a worker that left the pool is a wait."""
    svc = make_service()
    w0 = worker(svc, "w0")
    feed(svc, w0, running=1, waiting=3)  # queueing: saturated
    assert isinstance(decide(svc, pin="w0"), Wait)
    out = decide(svc, pin="w0", attach=True)
    assert out["worker_id"] == "w0" and out["reason"]["attached"] is True
    assert w0.unseen == 1 and w0.open_prompt_tokens == 100
    svc.report_failure("w0", "connect")  # down, then half open: still the socket's worker
    out = decide(svc, pin="w0", attach=True)
    assert out["worker_id"] == "w0" and not svc.leases.leases[out["lease_id"]].trial
    assert decide(svc, pin="w0", attach=True, model="other") == UNKNOWN_MODEL
    svc.remove_worker("w0")
    out = decide(svc, pin="w0", attach=True)
    assert isinstance(out, Wait) and out.reason == "pinned_worker_gone"


def test_a_pinned_follow_up_counts_its_history_as_kv_but_not_as_prefill_work():
    """The stored conversation's history (cached_tokens) takes KV on its worker again, so a
    follow-up that does not fit the free KV waits; what it prefills is its new input only."""
    svc = make_service(n=2)
    feed(svc, worker(svc, "w0"), running=4, kv=0.9)  # 16,000-token pool: 1,600 free
    out = decide(svc, pin="w0", prompt_tokens=3000, cached_tokens=2900)
    assert isinstance(out, Wait) and out.reason == "saturated"
    out = decide(svc, pin="w0", prompt_tokens=1000, cached_tokens=900)
    assert out["worker_id"] == "w0"
    assert worker(svc, "w0").open_prompt_tokens == 100


def test_round_robin_cycles():
    svc = make_service("round_robin")
    assert [decide(svc)["worker_id"] for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_prefix_affinity_sticks_and_guard_spreads():
    svc = make_service("prefix_affinity", balance_abs=2, balance_rel=1.0)
    hashes = [11, 22, 33]
    first = decide(svc, prefix_hashes=hashes)["worker_id"]
    # Same prefix (and a longer prompt sharing it) follows the first one while load allows.
    assert decide(svc, prefix_hashes=[*hashes, 44])["worker_id"] == first
    # Overload the affine worker: the guard sends the prefix elsewhere.
    feed(svc, worker(svc, first), running=20)
    assert decide(svc, prefix_hashes=hashes)["worker_id"] != first


def test_llm_aware_prefers_prefix_hit_when_balanced():
    svc = make_service()
    a = decide(svc, prefix_hashes=[5, 6])
    svc.release(a["lease_id"], True)
    for i in range(3):
        d = decide(svc, prefix_hashes=[5, 6, 7])
        assert d["worker_id"] == a["worker_id"]
        # Prefill backlog counts only the chunks not in the worker's prefix cache: 1 of 3 the
        # first time, none once the whole prompt has been there.
        expected = 100 / 3 if i == 0 else 0.0
        assert worker(svc, d["worker_id"]).prefill_backlog == pytest.approx(expected)
        svc.release(d["lease_id"], True)


def test_gateway_failure_report_then_half_open_single_trial():
    svc = make_service("round_robin")
    w1 = worker(svc, "w1")
    assert svc.report_failure("w1", "connect")
    assert w1.health.state == DOWN
    assert "w1" not in {decide(svc)["worker_id"] for _ in range(6)}
    now = time.monotonic()
    w1.health.on_success(now, 2)
    assert w1.health.on_success(now, 2)  # state changed: the scraper tells the service
    svc.on_health_change(w1)
    assert w1.health.state == HALF_OPEN
    picks = [decide(svc) for _ in range(9)]
    trials = [d for d in picks if d["worker_id"] == "w1"]
    assert len(trials) == 1  # a single trial in flight
    svc.release(trials[0]["lease_id"], True)
    assert w1.health.state == UP


@pytest.mark.parametrize("kind", ["http_500", "timeout", "idle_timeout", "http_503"])
def test_a_request_failure_with_an_answer_takes_a_worker_out_only_after_a_streak(kind):
    """A request the engine cannot serve fails on every worker it is retried on: one report of
    it must not take each out. A worker failing request after request (its scrapes fine, so
    it looks idle and draws the most) goes out at the streak; an ok request resets it."""
    svc = make_service("round_robin", config={"failure_report_streak": 3})
    w1 = worker(svc, "w1")
    for _ in range(2):
        assert svc.report_failure("w1", kind)
    assert w1.health.state == UP
    ok = next(d for d in (decide(svc) for _ in range(3)) if d["worker_id"] == "w1")
    svc.release(ok["lease_id"], True)  # a request it served: the streak starts again
    for _ in range(2):
        svc.report_failure("w1", kind)
    assert w1.health.state == UP
    svc.report_failure("w1", kind)
    assert w1.health.state == DOWN and w1.health.last_error == f"gateway: {kind}"
    assert "w1" not in {decide(svc)["worker_id"] for _ in range(6)}


@pytest.mark.parametrize("kind", ["connect", "connection", "empty_stream"])
def test_a_connection_failure_report_takes_a_worker_out_at_once(kind):
    svc = make_service("round_robin")
    assert svc.report_failure("w1", kind)
    assert worker(svc, "w1").health.state == DOWN


def _half_open_trial():
    """w1 taken out by a gateway report, back half open after a scrape, and its trial lease."""
    svc = make_service("round_robin")
    w1 = worker(svc, "w1")
    svc.report_failure("w1", "connect")
    w1.health.on_success(time.monotonic(), 1)
    svc.on_health_change(w1)
    trial = next(d for d in (decide(svc) for _ in range(3)) if d["worker_id"] == "w1")
    return svc, w1, trial


def test_a_trial_whose_client_left_is_no_verdict_and_the_next_request_is_the_trial():
    """A client leaving proves nothing about the worker: it stays half open (it used to pass the
    trial and come back up without having served anything)."""
    svc, w1, trial = _half_open_trial()
    assert svc.release_reported(LeaseRelease(lease_id=trial["lease_id"], ok=True, error=CLIENT_LEFT))
    assert w1.health.state == HALF_OPEN
    again = [d for d in (decide(svc) for _ in range(6)) if d["worker_id"] == "w1"]
    assert len(again) == 1  # a new trial, one at a time
    svc.release(again[0]["lease_id"], True)
    assert w1.health.state == UP


def test_a_worker_taken_out_with_requests_running_gets_its_trial_while_they_run():
    """Taken out by a report while other requests stream on it, back half open at the next
    scrapes: its trial starts then, not when the last of those streams ends (up to the
    gateway's request timeout later)."""
    svc = make_service("round_robin")
    w1 = worker(svc, "w1")
    running = [d for d in (decide(svc) for _ in range(6)) if d["worker_id"] == "w1"]
    assert running
    svc.report_failure("w1", "connect")
    w1.health.on_success(time.monotonic(), 1)
    svc.on_health_change(w1)
    assert w1.health.state == HALF_OPEN
    trials = [d for d in (decide(svc) for _ in range(6)) if d["worker_id"] == "w1"]
    assert len(trials) == 1 and svc.leases.leases[trials[0]["lease_id"]].trial
    for d in running:  # the old ones ending says nothing about the worker
        svc.release(d["lease_id"], True)
    assert w1.health.state == HALF_OPEN
    svc.release(trials[0]["lease_id"], True)
    assert w1.health.state == UP


def test_failed_trial_goes_back_down():
    svc, w1, trial = _half_open_trial()
    svc.release(trial["lease_id"], False, "connect")
    assert w1.health.state == DOWN


def test_leases_expire():
    svc = make_service()
    svc.leases.ttl_s = 0.01
    d = decide(svc)
    assert worker(svc, d["worker_id"]).in_flight == 1
    assert svc.expire_leases(time.monotonic() + 1.0) == 1
    assert worker(svc, d["worker_id"]).in_flight == 0
    assert not svc.release(d["lease_id"], True)


def test_a_renewed_lease_expires_a_ttl_after_its_renewal():
    """A long generation's lease is renewed by its gateway: it outlives its first TTL, and then
    expires a TTL after the last renewal (its gateway crashed); an unknown lease is no renewal."""
    svc = make_service()
    svc.leases.ttl_s = 10.0
    d = decide(svc)
    lease = svc.leases.leases[d["lease_id"]]
    lease.expires_at -= 9.0  # issued 9 s ago
    assert svc.renew(d["lease_id"])
    now = time.monotonic()
    assert svc.expire_leases(now + 5.0) == 0  # past its first TTL
    assert svc.expire_leases(now + 10.5) == 1
    assert not svc.renew(d["lease_id"])


def test_every_policy_decides():
    for name in POLICIES:
        svc = make_service(name)
        assert isinstance(decide(svc), dict), name


def test_bad_policy_params_are_rejected():
    with pytest.raises(ValueError, match="nonsense"):
        make_service("llm_aware", nonsense=1)


def test_prefill_backlog_drains_by_the_prompt_counter_and_never_outlives_its_leases():
    svc = make_service(max_waiting=100)
    for w in svc.registry.workers.values():
        feed(svc, w, prompt_total=5000)
    first = decide(svc, prompt_tokens=1000)
    w = worker(svc, first["worker_id"])
    assert w.prefill_backlog == 1000
    # The next scrape shows 600 of those prompt tokens prefilled, then the rest.
    feed(svc, w, running=1, prompt_total=5600, taken_at=time.monotonic() + 1.0)
    assert w.prefill_backlog == 400
    feed(svc, w, running=1, prompt_total=6000, taken_at=time.monotonic() + 1.0)
    assert w.prefill_backlog == 0
    svc.release(first["lease_id"], True)
    # A request cancelled before its first token leaves no backlog behind.
    second = decide(svc, prompt_tokens=700)
    w2 = worker(svc, second["worker_id"])
    before = w2.prefill_backlog
    assert before >= 700
    svc.release(second["lease_id"], True)
    assert w2.prefill_backlog == before - 700
    # A counter that goes backwards is a restarted worker: nothing drains, the new base is kept.
    third = decide(svc, prompt_tokens=300)
    w3 = worker(svc, third["worker_id"])
    level = w3.prefill_backlog
    feed(svc, w3, running=1, prompt_total=10, taken_at=time.monotonic() + 1.0)
    assert w3.prefill_backlog == level
    feed(svc, w3, running=1, prompt_total=110, taken_at=time.monotonic() + 1.0)
    assert w3.prefill_backlog == level - 100


def test_prefill_progress_between_counter_moves_opens_the_cap_before_the_counter_shows_it():
    """The prompt counter moves only when a prompt is done: at 4000 prefill tokens/s, 0.1 s after
    the counter last moved a 2048-token backlog is likely 400 tokens along, so the capped worker
    takes the next request; when the counter moves, the real drain replaces the guess."""
    svc = make_service(max_waiting=100, max_prefill_backlog=2048, n=1)
    w = worker(svc, "w0")
    t0 = time.monotonic()
    feed(svc, w, prompt_total=0, prefill_tps=4000.0, taken_at=t0)
    lease = decide(svc, prompt_tokens=2048)
    assert isinstance(decide(svc, prompt_tokens=100), Wait)  # capped: 2048 pending
    feed(svc, w, running=1, prompt_total=0, prefill_tps=4000.0, taken_at=t0 + 0.1)
    assert w.prefill_pending == pytest.approx(2048 - 400) and w.prefill_backlog == 2048
    nxt = decide(svc, prompt_tokens=100)
    assert nxt["worker_id"] == "w0"
    feed(svc, w, running=2, prompt_total=0, prefill_tps=4000.0, taken_at=t0 + 0.3)
    assert w.prefill_pending == pytest.approx(2148 - 1200)
    # The counter moves by 1000: that is the drain now, the guess starts again from it.
    feed(svc, w, running=2, prompt_total=1000, prefill_tps=4000.0, taken_at=t0 + 0.5)
    assert w.prefill_backlog == 2148 - 1000 and w.prefill_pending == w.prefill_backlog
    # Never more progress than backlog; without a rate, no guess at all.
    feed(svc, w, running=2, prompt_total=1000, prefill_tps=4000.0, taken_at=t0 + 5.0)
    assert w.prefill_pending == 0.0
    feed(svc, w, running=2, prompt_total=1000, prefill_tps=None, taken_at=t0 + 5.1)
    assert w.prefill_pending == w.prefill_backlog
    for out in (lease, nxt):
        svc.release(out["lease_id"], True)


def test_llm_aware_steers_arrivals_away_from_a_worker_still_prefilling():
    svc = make_service(max_waiting=100)
    for w in svc.registry.workers.values():
        feed(svc, w, running=10, kv=0.3, prompt_total=0)
    big = decide(svc, prompt_tokens=2000, max_tokens=50)
    busy = worker(svc, big["worker_id"])
    # The next scrape shows the long prompt running (counts are equal again) but not
    # prefilled yet: the next arrivals go elsewhere until its counter moves.
    for w in svc.registry.workers.values():
        feed(svc, w, running=11 if w is busy else 10, kv=0.3, prompt_total=0,
             taken_at=time.monotonic() + 1.0)
    picks = [decide(svc, prompt_tokens=200)["worker_id"] for _ in range(4)]
    assert busy.worker_id not in picks
    feed(svc, busy, running=11, kv=0.3, prompt_total=2000, taken_at=time.monotonic() + 2.0)
    assert busy.prefill_backlog == 0


def test_llm_aware_burst_spreads_prompt_tokens_not_just_counts():
    # 160 arrivals before any scrape, ShareGPT-like prompt sizes (log-normal, capped at 1024):
    # the heaviest worker's prefill (what the last first token waits for) stays close to the
    # even share, where balancing counts alone leaves it well above.
    import random

    rng = random.Random(0)
    sizes = [min(1024, max(4, int(rng.lognormvariate(5.0, 1.0)))) for _ in range(160)]
    even = sum(sizes) / 5

    def heaviest(**params):
        svc = make_service(n=5, max_waiting=100, **params)
        tokens = collections.Counter()
        for size in sizes:
            tokens[decide(svc, prompt_tokens=size, max_tokens=200)["worker_id"]] += size
        return max(tokens.values())

    assert heaviest(w_prefill=0.0) > 1.15 * even
    assert heaviest() < 1.08 * even


def test_llm_aware_prefill_backlog_cap_holds_the_rest_of_a_burst_until_prefill_drains():
    svc = make_service(max_waiting=100, max_prefill_backlog=2048)
    for w in svc.registry.workers.values():
        feed(svc, w, prompt_total=0)
    placed = []
    while not isinstance(out := decide(svc, prompt_tokens=500), Wait):
        placed.append(out)
    # Each of the 3 workers took prompts until 2,048 tokens were pending: 5 x 500.
    assert collections.Counter(d["worker_id"] for d in placed) == {"w0": 5, "w1": 5, "w2": 5}
    assert out.reason == "saturated"
    # w1 reports 1,000 prompt tokens prefilled: it takes two more, then is full again.
    w1 = worker(svc, "w1")
    feed(svc, w1, running=5, prompt_total=1000, taken_at=time.monotonic() + 1.0)
    assert [decide(svc, prompt_tokens=500)["worker_id"] for _ in range(2)] == ["w1", "w1"]
    assert isinstance(decide(svc, prompt_tokens=500), Wait)


def test_llm_aware_kv_freed_by_a_release_counts_before_the_next_scrape():
    # Every worker is full (KV 0.97 of 16,000 tokens) and a request is held. When the gateway
    # releases a request that held 1,500 tokens on w1, w1 has room at once (0.97 -> 0.876),
    # without waiting for its next scrape.
    svc = make_service(max_waiting=100)
    placed = decide(svc)
    for w in svc.registry.workers.values():
        feed(svc, w, running=30, kv=0.97, taken_at=time.monotonic() + 1.0)
    assert isinstance(decide(svc), Wait)
    assert svc.release(placed["lease_id"], True, used_tokens=1500)
    assert decide(svc)["worker_id"] == placed["worker_id"]
    # Without the token count (an old gateway), nothing is credited: still held.
    svc2 = make_service(max_waiting=100)
    placed2 = decide(svc2)
    for w in svc2.registry.workers.values():
        feed(svc2, w, running=30, kv=0.97, taken_at=time.monotonic() + 1.0)
    assert svc2.release(placed2["lease_id"], True)
    assert isinstance(decide(svc2), Wait)
    # The next scrape shows the worker's own numbers again: the credit is not kept twice.
    w = worker(svc, placed["worker_id"])
    feed(svc, w, running=30, kv=0.97, taken_at=time.monotonic() + 2.0)
    assert w.freed_tokens == 0


def test_a_release_the_last_scrape_already_showed_does_not_free_a_second_slot():
    """A request finishes at the engine, the next scrape shows its slot and KV free, and its
    release arrives after that scrape. The release is no news: counted as a finish since the
    scrape, it freed the slot and the KV a second time (a worker at its cap of 2 looked as if
    it had two free slots, and the second request sent there waited for a whole answer)."""
    svc = make_service(n=1, max_running=2)
    w = worker(svc, "w0")
    first, second = decide(svc), decide(svc)
    t = time.monotonic() + 1.0
    feed(svc, w, running=2, kv=0.1, taken_at=t)  # both running
    feed(svc, w, running=1, kv=0.05, taken_at=t + 0.1)  # `first` finished; its release is late
    assert isinstance(decide(svc), Wait)  # its lease is open until the gateway sees the end
    assert svc.release(first["lease_id"], True, used_tokens=300)
    assert (w.finished_since, w.freed_tokens, w.running_eff) == (0, 0.0, 1)
    assert decide(svc)["worker_id"] == "w0"  # the one free slot
    assert isinstance(decide(svc), Wait)  # not a second one
    # A release the scrape did not show yet frees its slot and its KV at once.
    feed(svc, w, running=2, kv=0.1, taken_at=t + 0.2)
    assert svc.release(second["lease_id"], True, used_tokens=300)
    assert (w.finished_since, w.freed_tokens, w.running_eff) == (1, 300.0, 1)
    assert decide(svc)["worker_id"] == "w0"


def test_prefilled_report_drains_the_backlog_at_once_and_the_counter_never_drains_it_twice():
    """The gateway reports a request's first token: its prompt leaves the backlog then, not at
    the worker's next scrape; when the counter then shows that prompt, nothing drains twice."""
    svc = make_service(max_waiting=100, max_prefill_backlog=2048, n=1)
    w = worker(svc, "w0")
    feed(svc, w, prompt_total=0)
    a, b, c, d, e = (decide(svc, prompt_tokens=500) for _ in range(5))
    assert w.prefill_backlog == 2500 and isinstance(decide(svc, prompt_tokens=500), Wait)
    assert svc.prefilled(a["lease_id"])
    assert w.prefill_backlog == 2000
    assert not svc.prefilled(a["lease_id"])  # reported once
    assert not svc.prefilled("no-such-lease")
    f = decide(svc, prompt_tokens=500)  # room again, before any scrape
    assert f["worker_id"] == "w0" and w.prefill_backlog == 2500
    # The next scrape's counter shows a's 500 tokens: already off the backlog.
    feed(svc, w, running=6, prompt_total=500, taken_at=time.monotonic() + 1.0)
    assert w.prefill_backlog == 2500
    # b was prefilled without a report (a non-streamed request): the counter drains it.
    feed(svc, w, running=6, prompt_total=1000, taken_at=time.monotonic() + 1.1)
    assert w.prefill_backlog == 2000
    # A report the counter never matches stops absorbing drains after one more scrape.
    assert svc.prefilled(c["lease_id"])
    feed(svc, w, running=6, prompt_total=1000, taken_at=time.monotonic() + 1.2)
    feed(svc, w, running=6, prompt_total=1000, taken_at=time.monotonic() + 1.3)
    feed(svc, w, running=6, prompt_total=1500, taken_at=time.monotonic() + 1.4)
    assert w.prefill_backlog == 1000
    # A released lease is no longer reportable, and its release takes nothing off twice.
    svc.release(c["lease_id"], True)
    assert not svc.prefilled(c["lease_id"])
    assert w.prefill_backlog == 1000
    for out in (d, e, f, b, a):
        svc.release(out["lease_id"], True)
    assert w.prefill_backlog == 0


def test_prefilled_report_on_a_kv_bound_worker_leaves_the_backlog_to_the_counter():
    """By default (prefilled_max_kv_usage 0.8) a report from a worker whose cache was nearly full at its
    last scrape does not drain its backlog: there admissions wait for KV, not for prefill, and an
    early drain would send prompts to wait inside the engine. The counter drains it, once."""
    svc = make_service(max_waiting=100, max_prefill_backlog=2048, n=1)
    w = worker(svc, "w0")
    now = time.monotonic()
    feed(svc, w, kv=0.85, prompt_total=0, taken_at=now)
    a = decide(svc, prompt_tokens=500)
    assert svc.prefilled(a["lease_id"])
    assert w.prefill_backlog == 500
    assert not svc.prefilled(a["lease_id"])  # reported once all the same
    feed(svc, w, running=1, kv=0.85, prompt_total=500, taken_at=now + 1.0)
    assert w.prefill_backlog == 0
    # Below the bound a report drains at once, as without the setting.
    feed(svc, w, running=1, kv=0.5, prompt_total=500, taken_at=now + 1.1)
    b = decide(svc, prompt_tokens=300)
    assert svc.prefilled(b["lease_id"]) and w.prefill_backlog == 0
    outcomes = {o: svc.metrics.registry.get_sample_value("scheduler_prefilled_reports_total", {"outcome": o})
                for o in ("ok", "kv_bound")}
    assert outcomes == {"ok": 1.0, "kv_bound": 1.0}


async def test_prefilled_report_wakes_a_call_held_by_the_backlog_cap():
    svc = make_service(max_waiting=100, max_prefill_backlog=1000, n=1)
    w = worker(svc, "w0")
    feed(svc, w, prompt_total=0)
    first = decide(svc, prompt_tokens=1000)
    held = asyncio.create_task(svc.schedule(Request("m", 200, None), wait_ms=5000))
    await asyncio.sleep(0.05)
    assert not held.done()
    svc.prefilled(first["lease_id"])
    out = await asyncio.wait_for(held, 1.0)
    assert out["worker_id"] == "w0"


def test_a_removed_worker_s_labelled_series_leave_the_exposition():
    """Pods come and go under Kubernetes: a removed worker's scrape series must not be
    exported forever (one set per pod address ever seen)."""
    from prometheus_client import generate_latest

    svc = make_service(n=2)
    m = svc.metrics
    for wid in ("w0", "w1"):  # what the scraper records for each worker
        m.scrape_latency.labels(wid).observe(0.002)
        m.scrape_failures.labels(wid, "timeout").inc()
        m.scrape_failures.labels(wid, "http").inc()
        m.scrape_filter_misses.labels(wid).inc()
    assert svc.remove_worker("w0")
    text = generate_latest(m.registry).decode()
    assert 'worker="w0"' not in text
    assert 'scheduler_scrape_failures_total{kind="http",worker="w1"} 1.0' in text
    assert 'scheduler_scrape_latency_seconds_count{worker="w1"} 1.0' in text


def test_a_burst_of_handed_off_requests_spreads_like_any_burst():
    """Background responses: the gateway's part ends at once (answered `queued`), the worker
    goes on. Their load must count until a scrape shows it, or every one of a burst sent
    between two scrapes goes to the worker that looked emptiest."""
    svc = make_service(max_waiting=100)
    placed = []
    for _ in range(30):
        d = decide(svc)
        assert svc.release_reported(LeaseRelease(lease_id=d["lease_id"], ok=True, handed_off=True))
        placed.append(d["worker_id"])
    assert sorted(collections.Counter(placed).values()) == [10, 10, 10]
    w0 = worker(svc, "w0")
    assert w0.unseen == 10 and w0.running_eff == 10
    # The next scrape shows them in the worker: the leases go, nothing is counted twice, and
    # nothing is freed (their end was not the requests' end).
    feed(svc, w0, running=10, taken_at=time.monotonic() + 1.0)
    assert (w0.unseen, w0.in_flight, w0.running_eff, w0.finished_since) == (0, 0, 10, 0)
    assert svc.metrics.releases.labels("handed_off")._value.get() == 30


def test_a_request_handed_off_after_a_scrape_saw_it_frees_nothing():
    svc = make_service(n=1, max_running=2)
    w = worker(svc, "w0")
    first = decide(svc)
    feed(svc, w, running=1, kv=0.1, taken_at=time.monotonic() + 1.0)
    assert svc.release_reported(LeaseRelease(lease_id=first["lease_id"], ok=True, handed_off=True,
                                             prompt_tokens=100, output_tokens=5))
    assert (w.in_flight, w.finished_since, w.freed_tokens, w.running_eff) == (0, 0, 0.0, 1)
    assert decide(svc)["worker_id"] == "w0"  # its one free slot
    assert isinstance(decide(svc), Wait)  # not a second one: the handed-off request still runs


def test_release_outcomes_are_counted_by_what_the_lease_was():
    """The dashboard's lease-end panel: a release of a lease the scheduler no longer holds
    (expired, or released twice) counts as `unknown` whatever the gateway says of the request,
    so `ok` counts only requests that really ended."""
    svc = make_service()
    count = svc.metrics.releases.labels
    d = decide(svc)
    assert svc.release_reported(LeaseRelease(lease_id=d["lease_id"], ok=True))
    assert not svc.release_reported(LeaseRelease(lease_id=d["lease_id"], ok=True))
    assert not svc.release_reported(LeaseRelease(lease_id="never-granted", ok=False))
    d = decide(svc)
    assert svc.release_reported(LeaseRelease(lease_id=d["lease_id"], ok=False, error="upstream"))
    assert [count(o)._value.get() for o in ("ok", "failed", "unknown")] == [1, 1, 2]


def test_a_model_between_workers_is_a_wait_then_unknown_after_the_grace():
    """Its last worker gone (a pod restarting, a lapsed registration), a model is 'no healthy
    worker' (the gateway's retryable 503), not 'no such model' (a 404 clients do not retry),
    for --model-gone-grace-s; then unknown. A worker serving it again ends the grace."""
    svc = make_service(n=1, config={"model_gone_grace_s": 60})
    svc.remove_worker("w0")
    out = decide(svc)
    assert isinstance(out, Wait) and out.reason == "no_routable_worker"
    assert svc.decide(Request("m", 10, 10), time.monotonic() + 61) == UNKNOWN_MODEL
    assert decide(svc, model="never-served") == UNKNOWN_MODEL
    back = svc.add_worker(WorkerState("http://127.0.0.1:9000", worker_id="w0", models=["m"]))
    back.health.on_success(time.monotonic(), 1)
    feed(svc, back)
    assert decide(svc)["worker_id"] == "w0"
    assert "m" not in svc.registry.gone_since


def test_with_no_grace_a_model_whose_workers_left_is_unknown_at_once():
    svc = make_service(n=1, config={"model_gone_grace_s": 0})
    svc.remove_worker("w0")
    assert svc.decide(Request("m", 10, 10), time.monotonic() + 0.01) == UNKNOWN_MODEL


def test_the_log_says_a_half_open_worker_answers_again(caplog):
    """Back half open, a worker still carries the error that took it out: the log line must
    not read as if that error were news ("is half_open (ClientConnectorError)")."""
    with caplog.at_level("INFO", logger="scheduler.service"):
        _half_open_trial()
    lines = [r.getMessage() for r in caplog.records if "half_open" in r.getMessage()]
    assert lines == ["worker w1 is half_open: answering again after gateway: connect; its next "
                     "request is a trial"]
