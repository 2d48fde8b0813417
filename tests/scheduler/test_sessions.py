"""Session affinity in the scheduler (in process, no HTTP): the session table
(scheduler/sessions.py), llm_aware's soft affinity (its session_slack), the `session` policy
(production-stack's stickiness), a new session's rendezvous worker (scheduler/rendezvous.py,
the gateway fallback's pick), the decision's reason and metrics, and the session key on both
wire forms of a schedule call."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from router.fallback import FallbackRouter
from scheduler.app import BadRequest, parse_schedule
from scheduler.channel import run_batch
from scheduler.policies import Request
from scheduler.rendezvous import rendezvous_pick
from scheduler.service import Wait
from scheduler.sessions import SessionTable
from tests.scheduler.helpers import feed, make_service, worker

S = 0x1234_5678_9ABC_DEF0  # a session key, as a gateway derives it (63 bits)


def decide(svc, **kw):
    kw.setdefault("prompt_tokens", 100)
    kw.setdefault("max_tokens", 100)
    return svc.decide(Request(kw.pop("model", "m"), **kw), time.monotonic())


def placed(svc, **kw) -> tuple[str, str | None]:
    """A decision's worker and its reason's session outcome; its lease released at once, so
    the loads the test fed stay what decides."""
    out = decide(svc, **kw)
    assert not isinstance(out, Wait), out
    svc.release(out["lease_id"], True)
    return out["worker_id"], out["reason"].get("session")


def idle(svc, *ids: str) -> None:
    for wid in ids:
        feed(svc, worker(svc, wid))


def rendezvous_of(svc, key: int) -> str:
    """The session's rendezvous worker among all of the service's workers."""
    return rendezvous_pick(key, svc.registry.workers.values()).worker_id


def key_on(svc, wid: str, start: int = 1) -> int:
    """A session key (the first from `start`) whose rendezvous worker is `wid`."""
    for key in range(start, start + 1000):
        if rendezvous_of(svc, key) == wid:
            return key
    raise AssertionError(f"no key of 1000 has its rendezvous on {wid}")


# ---- the table ----------------------------------------------------------------------------

def test_the_table_keeps_the_most_recently_used_sessions_up_to_its_bound():
    t = SessionTable(ttl_s=600, max_size=3)
    for key in (1, 2, 3):
        assert t.record(key, "w0", 0.0) == "new"
    assert t.record(1, "w0", 1.0) == "kept"  # 1 is now the most recent: 2 goes first
    t.record(4, "w1", 2.0)
    assert len(t) == 3
    assert t.worker_of(2, 2.0) is None
    assert [t.worker_of(k, 2.0) for k in (1, 3, 4)] == ["w0", "w0", "w1"]
    assert t.record(3, "w1", 3.0) == "moved"
    assert t.worker_of(3, 3.0) == "w1"
    assert t.counts == {"kept": 1, "moved": 1, "new": 4}


def test_a_session_idle_past_the_ttl_is_new_again_and_expires():
    t = SessionTable(ttl_s=10, max_size=100)
    t.record(1, "w0", 0.0)
    t.record(2, "w0", 5.0)
    assert t.worker_of(1, 10.0) == "w0"
    assert t.worker_of(1, 10.5) is None  # idle 10.5 s
    assert t.record(1, "w0", 10.5) == "new"  # not "kept": its worker's cache has likely moved on
    assert t.expire(15.5) == 1  # 2 (last used at 5)
    assert len(t) == 1 and t.worker_of(1, 15.5) == "w0"


def test_recording_drops_a_few_expired_sessions_not_the_whole_table():
    t = SessionTable(ttl_s=10, max_size=10_000)
    for key in range(1000):
        t.record(key, "w0", 0.0)
    t.record(5000, "w1", 100.0)  # every other session expired: a bounded few go per record
    left = len(t)
    assert 990 < left < 1001
    assert t.expire(100.0) == left - 1 and len(t) == 1 and t.worker_of(5000, 100.0) == "w1"


def test_a_worker_leaving_takes_its_sessions_with_it():
    t = SessionTable(ttl_s=600, max_size=100)
    t.record(1, "w0", 0.0)
    t.record(2, "w1", 0.0)
    t.record(3, "w0", 0.0)
    assert t.forget_worker("w0") == 2
    assert t.worker_of(1, 0.0) is None and t.worker_of(3, 0.0) is None and t.worker_of(2, 0.0) == "w1"


# ---- llm_aware -----------------------------------------------------------------------------

def test_llm_aware_keeps_a_session_on_its_worker_while_within_the_slack():
    svc = make_service(n=3)
    home, outcome = placed(svc, session=S)
    assert outcome == "new"
    others = [w for w in ("w0", "w1", "w2") if w != home]
    # Its worker runs 3 more requests than the others (slack 4): the session stays.
    feed(svc, worker(svc, home), running=3)
    for _ in range(3):
        assert placed(svc, session=S) == (home, "kept")
    # A request without a session goes to the least loaded; a new session whose rendezvous
    # worker is the busier one goes there too (the same slack), one whose is not goes to its own.
    assert placed(svc)[0] in others
    assert placed(svc, session=key_on(svc, home)) == (home, "new")
    assert placed(svc, session=key_on(svc, others[0])) == (others[0], "new")


def test_llm_aware_moves_a_session_whose_worker_is_busier_than_the_slack_and_it_stays_moved():
    svc = make_service(n=2)
    home, _ = placed(svc, session=S)
    other = "w1" if home == "w0" else "w0"
    feed(svc, worker(svc, home), running=5)  # 5 above the other: past the slack of 4
    assert placed(svc, session=S) == (other, "moved")
    # The old worker is idle again: the session stays where it went (a tie is within the slack).
    idle(svc, home, other)
    assert placed(svc, session=S) == (other, "kept")
    # Past a slack of 0 only a tie keeps it.
    strict = make_service(n=2, session_slack=0.0)
    home, _ = placed(strict, session=S)
    feed(strict, worker(strict, home), running=1)
    assert placed(strict, session=S)[1] == "moved"


@pytest.mark.parametrize("why", ["saturated", "cordoned", "down", "excluded"])
def test_llm_aware_moves_a_session_off_a_worker_that_cannot_take_it_now(why):
    svc = make_service(n=2)
    home, _ = placed(svc, session=S)
    other = "w1" if home == "w0" else "w0"
    feed(svc, worker(svc, other), running=2)  # the session's worker is the better pick, too
    kw = {}
    if why == "saturated":
        feed(svc, worker(svc, home), running=1, waiting=1)  # queueing: no more while another has room
    elif why == "cordoned":
        svc.cordon(home)
    elif why == "down":
        svc.report_failure(home, "connect")
    else:
        kw["exclude"] = frozenset({home})  # it failed this request before (a retry)
    assert placed(svc, session=S, **kw) == (other, "moved")
    assert placed(svc, session=S) == (other, "kept")  # and it stays there


def test_llm_aware_places_a_new_session_on_its_rendezvous_worker_while_it_has_room_within_the_slack():
    svc = make_service(n=3)
    key = key_on(svc, "w1")
    # Its rendezvous worker runs 3 more requests than the others (slack 4): not the best, but
    # the new session starts there, as the gateway's fallback would place it.
    feed(svc, worker(svc, "w1"), running=3)
    out = decide(svc, session=key)
    assert out["worker_id"] == "w1"
    assert out["reason"]["session"] == "new" and out["reason"]["rendezvous"] is True
    svc.release(out["lease_id"], True)
    assert placed(svc, session=key) == ("w1", "kept")
    # A session idle past its TTL is placed anew the same way.
    ttl = make_service(n=3, config={"session_ttl_s": 0.05})
    feed(ttl, worker(ttl, "w1"), running=3)
    assert placed(ttl, session=key) == ("w1", "new")
    later = time.monotonic() + 1.0  # idle 1 s, past its TTL of 0.05
    out = ttl.decide(Request("m", prompt_tokens=100, max_tokens=100, session=key), later)
    assert out["worker_id"] == "w1" and out["reason"]["session"] == "new"


@pytest.mark.parametrize("why", ["saturated", "far_worse"])
def test_llm_aware_places_a_new_session_elsewhere_when_its_rendezvous_worker_cannot_take_it(why):
    svc = make_service(n=3)
    key = key_on(svc, "w1")
    if why == "saturated":
        feed(svc, worker(svc, "w1"), running=1, waiting=1)  # queueing: no room
    else:
        feed(svc, worker(svc, "w1"), running=5)  # 5 requests above the best: past the slack
    out = decide(svc, session=key)
    assert out["worker_id"] in ("w0", "w2")
    assert out["reason"]["session"] == "new" and "rendezvous" not in out["reason"]


def test_a_new_session_whose_rendezvous_worker_is_excluded_takes_its_next_as_the_fallback_does():
    for policy in ("llm_aware", "session"):
        svc = make_service(policy, n=3)
        key = key_on(svc, "w1")
        rest = [worker(svc, "w0"), worker(svc, "w2")]
        out = decide(svc, session=key, exclude=frozenset({"w1"}))  # it failed this request (a retry)
        assert out["worker_id"] == rendezvous_pick(key, rest).worker_id and out["reason"]["rendezvous"]


def test_new_sessions_spread_over_the_workers_as_the_fallback_places_them_and_again_after_a_restart():
    svc = make_service(n=3)
    keys = range(1, 61)
    first = {key: placed(svc, session=key)[0] for key in keys}
    counts = sorted(list(first.values()).count(w) for w in ("w0", "w1", "w2"))
    assert counts[0] >= 10, counts  # 60 sessions over 3 workers: none left out, none takes all
    # The gateway's fallback, knowing the workers by the scheduler's list (its URLs with a '/'
    # here: both sides drop it), places every session on the same worker.
    fallback = FallbackRouter([], cooldown_s=1.0)
    fallback.update_from_scheduler([(w.worker_id, w.url + "/", ["m"]) for w in svc.registry.workers.values()])
    assert {key: fallback.pick("m", [], session=key).worker_id for key in keys} == first
    # A scheduler restarted with an empty table puts each session back where it was.
    fresh = make_service(n=3)
    assert {key: placed(fresh, session=key)[0] for key in keys} == first


def test_llm_aware_never_holds_a_request_for_its_sessions_worker():
    svc = make_service(n=2)
    home, _ = placed(svc, session=S)
    other = "w1" if home == "w0" else "w0"
    feed(svc, worker(svc, home), running=1, waiting=3)
    feed(svc, worker(svc, other), running=30, kv=0.5)  # far busier, but it has room
    assert placed(svc, session=S) == (other, "moved")
    # With every worker saturated the request is held as any other.
    feed(svc, worker(svc, other), running=1, waiting=3)
    out = decide(svc, session=S)
    assert isinstance(out, Wait) and out.reason == "saturated"


def test_a_pinned_request_goes_to_its_pin_whatever_its_session_says():
    svc = make_service(n=2)
    home, _ = placed(svc, session=S)
    pin = "w1" if home == "w0" else "w0"
    feed(svc, worker(svc, pin), running=6)  # past the slack: the session alone would not go there
    assert placed(svc, session=S, pin=pin) == (pin, "moved")
    # The conversation's state is there now: the session follows it.
    idle(svc, "w0", "w1")
    assert placed(svc, session=S) == (pin, "kept")


def test_a_session_keeps_its_worker_over_a_slightly_better_prefix_match_elsewhere():
    """The session's worker is compared with the prefix bonus counted on both sides: a worker
    holding more of the prompt wins only by more than the slack."""
    svc = make_service(n=2)
    home, _ = placed(svc, session=S, prefix_hashes=[1, 2, 3, 4])
    other = "w1" if home == "w0" else "w0"
    # Other prompts sent to the other worker: it holds their first chunks.
    for hashes in ([11], [41]):
        out = decide(svc, prefix_hashes=hashes, pin=other)
        svc.release(out["lease_id"], True)
    # The session's next prompt starts as one of them: the other worker holds 1 of its 4 chunks
    # (a bonus of 2, w_prefix 8), the session's worker none. Within the slack (4): kept.
    assert placed(svc, session=S, prefix_hashes=[11, 21, 22, 23]) == (home, "kept")
    # Its own bonus counts too: 7 more requests there, but it holds half this prompt (4 less).
    feed(svc, worker(svc, home), running=7)
    assert placed(svc, session=S, prefix_hashes=[1, 2, 61, 62]) == (home, "kept")
    # 3 more requests on the session's worker and the bonus of 2 elsewhere: 5, past the slack.
    feed(svc, worker(svc, home), running=3)
    assert placed(svc, session=S, prefix_hashes=[41, 51, 52, 53]) == (other, "moved")


def test_policies_without_sessions_ignore_them():
    svc = make_service("round_robin", n=3)
    assert [placed(svc, session=S) for _ in range(3)] == [("w0", None), ("w1", None), ("w2", None)]
    assert len(svc.env.sessions) == 0


# ---- the session policy ----------------------------------------------------------------------

def test_the_session_policy_sticks_to_a_sessions_worker_while_it_is_in_rotation():
    svc = make_service("session", n=3)
    home, outcome = placed(svc, session=S)
    assert outcome == "new"
    # Busy (open leases) does not move it: production-stack's stickiness, not a balance.
    for _ in range(5):
        out = decide(svc, session=S)
        assert out["worker_id"] == home and out["reason"]["session"] == "kept"
    # A request without a session goes to the worker with the fewest open requests; a new
    # session to its rendezvous worker, busy or not.
    assert placed(svc)[0] != home
    assert placed(svc, session=key_on(svc, home)) == (home, "new")
    svc.cordon(home)
    moved, outcome = placed(svc, session=S)
    assert moved != home and outcome == "moved"
    svc.uncordon(home)
    assert placed(svc, session=S) == (moved, "kept")  # it stays moved
    svc.report_failure(moved, "connect")  # down: out of rotation
    assert placed(svc, session=S)[1] == "moved"


def test_the_session_policy_places_new_sessions_by_rendezvous_and_never_holds():
    svc = make_service("session", n=3)
    for wid in ("w0", "w1", "w2"):
        feed(svc, worker(svc, wid), running=5, waiting=5)  # saturated, as llm_aware counts it
    keys = range(1, 31)
    firsts = [decide(svc, session=k) for k in keys]  # leases kept open
    assert [d["worker_id"] for d in firsts] == [rendezvous_of(svc, k) for k in keys]
    assert all(d["reason"]["session"] == "new" and d["reason"]["rendezvous"] for d in firsts)
    assert min(sum(d["worker_id"] == w for d in firsts) for w in ("w0", "w1", "w2")) >= 4
    assert decide(svc, session=1)["worker_id"] == firsts[0]["worker_id"]
    assert not isinstance(decide(svc, session=99, exclude=frozenset({"w0", "w1"})), Wait)


# ---- the service: reason, metrics, a worker leaving ---------------------------------------

def test_a_removed_workers_sessions_are_new_wherever_they_go_next():
    svc = make_service(n=2)
    home, _ = placed(svc, session=S)
    assert svc.remove_worker(home)
    assert len(svc.env.sessions) == 0
    assert placed(svc, session=S)[1] == "new"


def test_the_outcomes_and_the_tables_size_are_on_metrics():
    svc = make_service(n=2, config={"session_ttl_s": 30, "max_sessions": 2})
    placed(svc, session=1)
    placed(svc, session=1)
    placed(svc, session=2)
    placed(svc, session=3)  # the bound: session 1 is forgotten
    text = generate_latest(svc.metrics.registry).decode()
    assert 'scheduler_session_affinity_total{outcome="new"} 3.0' in text
    assert 'scheduler_session_affinity_total{outcome="kept"} 1.0' in text
    assert 'scheduler_session_affinity_total{outcome="moved"} 0.0' in text
    assert "scheduler_sessions 2.0" in text


# ---- the wire: HTTP body and batch operation ---------------------------------------------

def test_a_schedule_call_carries_the_session_key_on_both_wire_forms():
    req, _, _ = parse_schedule(b'{"model": "m", "session": %d}' % S)
    assert req.session == S
    assert parse_schedule(b'{"model": "m"}')[0].session is None
    for bad in (b"-1", str(1 << 63).encode(), b'"abc"'):
        with pytest.raises(BadRequest) as err:
            parse_schedule(b'{"model": "m", "session": ' + bad + b"}")
        assert err.value.param == "session"
    svc = make_service(n=2)
    answers, _ = run_batch(svc, [{"op": "schedule", "model": "m", "prompt_tokens": 5, "session": S}] * 2)
    first, second = (payload for _, payload in answers)
    assert first["reason"]["session"] == "new"
    assert second["reason"]["session"] == "kept" and second["worker_id"] == first["worker_id"]
    status, _ = run_batch(svc, [{"op": "schedule", "model": "m", "session": -5}])[0][0]
    assert status == 400
