"""Routing policies under the edge cases a production pool meets: mixed KV pools, workers
without load data, LoRA traffic, oversized inputs, restarts (in process; no HTTP)."""

from __future__ import annotations

import math
import time

from scheduler.policies import Request
from scheduler.registry import WorkerState
from scheduler.service import Wait
from tests.scheduler.helpers import feed, make_service, worker


def decide(svc, **kw):
    kw.setdefault("prompt_tokens", 100)
    kw.setdefault("max_tokens", 100)
    return svc.decide(Request(kw.pop("model", "m"), **kw), time.monotonic())


def test_a_request_only_a_larger_pool_can_hold_waits_for_it_not_for_a_smaller_one():
    """Mixed fleet: w0's pool holds 10,000 tokens (half in use), w1's 4,000 (idle). A 6,000-token
    prompt fits w0's pool but not now; it must not go to w1, whose engine can never admit it
    (vLLM refuses it: longer than the max_model_len its pool holds). It waits for w0, and goes
    there once w0 has room; smaller requests still go to w1."""
    svc = make_service(n=2, max_waiting=100)
    w0, w1 = worker(svc, "w0"), worker(svc, "w1")
    feed(svc, w0, running=3, kv=0.5, num_blocks=625, block_size=16)
    feed(svc, w1, running=0, kv=0.0, num_blocks=250, block_size=16)
    out = decide(svc, prompt_tokens=6000)
    assert isinstance(out, Wait) and out.reason == "saturated"
    assert decide(svc, prompt_tokens=500)["worker_id"] == "w1"
    feed(svc, w0, running=0, kv=0.1, num_blocks=625, block_size=16, taken_at=time.monotonic() + 1.0)
    assert decide(svc, prompt_tokens=6000)["worker_id"] == "w0"


def test_a_request_larger_than_every_pool_still_goes_somewhere():
    """Larger than every candidate's whole pool, a request waits for nothing: the least loaded
    unsaturated worker gets it and its engine answers (an error the client sees at once)."""
    svc = make_service(n=2, max_waiting=100)
    feed(svc, worker(svc, "w0"), running=3, kv=0.5, num_blocks=625, block_size=16)
    feed(svc, worker(svc, "w1"), running=1, kv=0.2, num_blocks=250, block_size=16)
    assert decide(svc, prompt_tokens=20_000)["worker_id"] == "w1"
    # With prefix fingerprints too (the other loop of the policy).
    assert decide(svc, prompt_tokens=20_000, prefix_hashes=[1, 2])["worker_id"] in ("w0", "w1")


def _blind_worker(svc, wid: str = "x"):
    """A routable worker whose /metrics the scheduler cannot read (no load snapshot)."""
    w = svc.add_worker(WorkerState("http://127.0.0.1:9500", worker_id=wid, models=["m"]))
    w.health.on_success(time.monotonic(), 1)
    svc.on_health_change(w)
    assert w.snapshot is None
    return w


def test_a_worker_without_load_data_keeps_its_declared_running_cap():
    """No snapshot (a dialect the scheduler cannot read): its load is its leases, which are
    exact, so the cap it declared (registration, config) holds there as well: with a cap of 2 the
    third request waits instead of queueing inside the engine; a release frees a slot."""
    svc = make_service(n=0)
    w = _blind_worker(svc)
    w.declare_running_cap(2)
    svc.refresh(w)
    first, second = decide(svc), decide(svc)
    assert first["worker_id"] == second["worker_id"] == "x"
    out = decide(svc)
    assert isinstance(out, Wait) and out.reason == "saturated"
    assert w.saturated == "running_cap"
    svc.release(first["lease_id"], True)
    assert decide(svc)["worker_id"] == "x"
    # The policy's own caps too.
    capped = make_service(n=0, max_running=1)
    _blind_worker(capped)
    assert decide(capped)["worker_id"] == "x"
    assert isinstance(decide(capped), Wait)


def test_a_worker_without_load_data_competes_by_its_leases():
    """Its leases are its load: idle, it takes the next request ahead of a worker that runs
    five; it does not take them all either (its own leases count). Its rank used to be its
    bare score against the others' score - w_age * scrape time, so it got nothing while
    another worker had room."""
    svc = make_service(n=1, max_waiting=100)
    feed(svc, worker(svc, "w0"), running=5)
    x = _blind_worker(svc)
    picks = [decide(svc)["worker_id"] for _ in range(10)]
    assert picks[0] == "x"
    assert 0 < picks.count("x") < 10, picks
    # Released, it is the idle one again.
    for lease_id in list(x.leases):
        svc.release(lease_id, True)
    assert decide(svc)["worker_id"] == "x"


def test_requests_deferred_by_a_lora_budget_do_not_saturate_a_worker():
    """vLLM skips waiting requests it defers (their adapter does not fit its max_loras now) and
    admits the ones behind them: a worker whose only waiting requests are deferred still takes
    requests; one with a request waiting for capacity does not."""
    svc = make_service(n=2)
    w0, w1 = worker(svc, "w0"), worker(svc, "w1")
    feed(svc, w0, running=4, waiting=2, waiting_deferred=2)
    feed(svc, w1, running=4, waiting=1)
    assert w0.saturated is None and w1.saturated == "waiting"
    assert decide(svc, lora=None)["worker_id"] == "w0"
    feed(svc, w0, running=4, waiting=3, waiting_deferred=2, taken_at=time.monotonic() + 1.0)
    assert isinstance(decide(svc), Wait)


def _two_adapters(policy: str = "llm_aware", **params):
    """w0 and w1 serve a base model and two LoRA adapters (each a model name, as vLLM lists them)."""
    svc = make_service(policy, n=2, model="base", **params)
    for wid in ("w0", "w1"):
        worker(svc, wid).models |= {"adA", "adB"}
    svc.registry.reindex()
    return svc


def test_a_prefix_cached_under_one_adapter_is_no_match_for_another():
    """Engines cache prefixes per model and adapter, while the gateway's fingerprints are of the
    text alone: the same prompt sent to adapter B finds nothing of adapter A's cache. It gets no
    affinity to A's worker and its whole prompt counts as prefill work; adapter A's next turn
    still matches."""
    svc = _two_adapters(max_waiting=100)
    hashes = [11, 22, 33, 44]
    first = decide(svc, model="adA", prompt_tokens=1000, prefix_hashes=hashes)
    home = worker(svc, first["worker_id"])
    svc.release(first["lease_id"], True)
    other = worker(svc, "w1" if home.worker_id == "w0" else "w0")
    feed(svc, other, running=2)  # so that the home worker is the better pick either way
    out = decide(svc, model="adB", prompt_tokens=1000, prefix_hashes=hashes)
    assert out["worker_id"] == home.worker_id
    assert out["reason"].get("prefix_match", 0) == 0
    assert home.prefill_backlog == 1000
    svc.release(out["lease_id"], True)
    again = decide(svc, model="adA", prompt_tokens=1000, prefix_hashes=[*hashes, 55])
    assert again["reason"]["prefix_match"] == 4


def test_prefix_affinity_does_not_follow_a_prefix_across_adapters():
    svc = _two_adapters("prefix_affinity", balance_abs=100, balance_rel=100.0)
    hashes = [7, 8, 9]
    home = decide(svc, model="adA", prefix_hashes=hashes)["worker_id"]
    picks = {decide(svc, model="adB", prefix_hashes=hashes)["reason"]["prefix_match"] for _ in range(4)}
    assert picks == {0, 3}  # adapter B's own first request, then its own affinity
    assert decide(svc, model="adA", prefix_hashes=hashes)["worker_id"] == home


def test_a_huge_fingerprint_list_neither_evicts_the_prefix_index_nor_is_walked_whole():
    """The schedule API takes any number of fingerprints (the gateway sends at most 64): one
    request with 300,000 used to be walked whole and recorded whole, evicting every other
    prompt from the index (capacity 200,000). Only its first MAX_KEYS count."""
    from scheduler.policies.prefix_index import MAX_KEYS

    svc = make_service(max_waiting=100)
    index = svc.env.prefix_index
    chat = [101, 102, 103]
    home = decide(svc, prefix_hashes=chat)
    svc.release(home["lease_id"], True)
    before = len(index)
    huge = decide(svc, prefix_hashes=list(range(10**9, 10**9 + 300_000)))
    svc.release(huge["lease_id"], True)
    assert len(index) == before + MAX_KEYS
    follow_up = decide(svc, prefix_hashes=[*chat, 104])
    assert follow_up["worker_id"] == home["worker_id"] and follow_up["reason"]["prefix_match"] == 3


def test_a_restarted_worker_forgets_the_running_cap_learnt_before():
    """A cap learnt from a worker's scrapes (it queued at 2 with KV free) is about that engine
    process: once its prompt counter goes back (a restart, maybe with a larger --max-num-seqs),
    the worker takes requests past 2 again instead of being held to the old cap for a minute."""
    from scheduler.running_cap import PLATEAU_S

    svc = make_service(n=1)
    w = worker(svc, "w0")
    t = time.monotonic() - PLATEAU_S - 0.5
    for _ in range(round(PLATEAU_S / 0.1) + 3):
        feed(svc, w, running=2, waiting=1, kv=0.05, prompt_total=50_000.0, taken_at=t)
        t += 0.1
    assert w.running_cap.cap == 2
    feed(svc, w, running=2, waiting=0, kv=0.05, prompt_total=50_000.0, taken_at=t)
    assert isinstance(decide(svc), Wait)
    feed(svc, w, running=0, waiting=0, kv=0.0, prompt_total=0.0, taken_at=t + 0.1)
    assert w.running_cap.cap == math.inf
    assert [decide(svc)["worker_id"] for _ in range(3)] == ["w0"] * 3


def test_a_scrape_costs_the_same_however_many_requests_other_workers_handed_off():
    """Handed-off leases (background responses) wait for their worker's next scrape. They were
    kept in one set for the whole pool, which every scrape of every worker walked: per round of
    scrapes, workers x leases. A scrape now looks at its own worker's only: the cost of applying
    one does not grow with the other workers' handed-off leases (a ratio within one run)."""
    from scheduler.leases import LeaseTable

    def cost_of_a_scrape(others: int) -> float:
        table = LeaseTable(ttl_s=60.0)
        pool = [WorkerState(f"http://10.0.0.{i % 250}:{8000 + i}") for i in range(others // 10)]
        t = time.monotonic()
        for i in range(others):
            table.hand_off(table.issue(pool[i % len(pool)], t, 100.0).lease_id)
        quiet = WorkerState("http://10.1.0.1:8000")
        mine = table.issue(quiet, t, 100.0)
        table.hand_off(mine.lease_id)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                table.drop_handed_off(quiet, t - 1.0)  # shows none of its leases yet
            best = min(best, time.perf_counter() - t0)
        assert quiet.in_flight == 1 and len(table.leases) == others + 1
        table.drop_handed_off(quiet, t + 1.0)
        assert quiet.in_flight == 0 and quiet.unseen == 0 and len(table.leases) == others
        return best

    few, many = cost_of_a_scrape(10), cost_of_a_scrape(20_000)
    assert many < 20 * few, (few, many)


async def test_a_hold_replaced_by_the_same_prompt_ending_elsewhere_gives_its_room_back():
    """Two requests with the same prompt end on two workers of a full cluster: the follow-up hold
    keeps the newest. The first worker's room is then everyone's at once (as when a hold
    expires), not hidden until that worker's next scrape."""
    from scheduler.config import SchedulerConfig
    from scheduler.service import SchedulerService

    svc = SchedulerService(SchedulerConfig(policy="llm_aware", followup_hold_ms=5000, visibility_lag_ms=0))
    for i in range(2):
        w = svc.add_worker(WorkerState(f"http://127.0.0.1:{9000 + i}", worker_id=f"w{i}", models=["m"]))
        w.health.on_success(time.monotonic(), 1)
        feed(svc, w, kv=0.5)
    history = [11, 12, 13]
    a = decide(svc, prefix_hashes=history)
    b = decide(svc, prefix_hashes=history, exclude=frozenset({a["worker_id"]}))
    later = time.monotonic() + 0.01  # a scrape that sees both leases
    for w in svc.registry.workers.values():
        feed(svc, w, running=30, kv=0.96, taken_at=later)  # 1,600 tokens bring one under 0.95
    assert svc.release(a["lease_id"], True, used_tokens=1600)
    assert isinstance(decide(svc, prefix_hashes=[99]), Wait)  # a's room is held for its follow-up
    assert svc.release(b["lease_id"], True, used_tokens=1600)
    first = worker(svc, a["worker_id"])
    assert first.reserved_tokens == 0
    out = decide(svc, prefix_hashes=[99])
    assert out["worker_id"] == a["worker_id"]
