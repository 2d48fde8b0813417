"""Did each fault of the chaos soak really happen, and did its target come back?

A soak that counts no lost request proves nothing if the kill missed its process or the
restarted process never took traffic again, so each fault is checked from two sides: the
process (its pid, exit status, /proc state) and the traffic (a request it served after its
recovery, as the answers' `x-router-*` headers tell).

Two faults are looked at closer, and the run as a whole once it is over:
- The scheduler killed while the load exceeds what the workers run (a surge): the requests
  held at that instant (the gateways' access lines: looking for a worker then) must each be
  answered (whole, by round robin once the gateways give up on the scheduler; or cut by one of
  the design's limits, e.g. a stream on a worker SIGKILLed after round robin sent it there:
  never lost), none answered twice, and the gateways' queues must empty again.
- A gateway SIGKILLed: its requests not yet answered move to the other replica, those begun
  are cut (benchmarks/chaos_outcomes.py); what the scheduler does with the leases the dead
  gateway will never release is recorded over time (evidence, not checked: by the design they
  last `--lease-ttl-s`, and they count as running on their workers meanwhile).
- The end of the run: every gateway holds and runs nothing, no request was answered twice;
  the scheduler's open leases are reported (checked only against `max_leases_left` if given).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos_client import Outcome
from benchmarks.chaos_faults import FaultRecord
from benchmarks.chaos_logs import GatewayLogs
from benchmarks.chaos_outcomes import LOST, FaultView, fault_view
from benchmarks.chaos_probe import IN_FLIGHT, QUEUED, Sample

FALLBACK_POLICY = "fallback_round_robin"  # the gateway's x-router-policy while the scheduler is away
# A request that looked for a worker this long was held (a schedule call answered at once: ~1 ms).
HELD_MIN_MS = 50.0
# How long after a gateway's SIGKILL the scheduler's leases are shown in the report.
LEASE_WATCH_S = 20.0


@dataclass
class FaultCheck:
    fault: str
    checks: dict[str, bool] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


def _served_after(outcomes: list[Outcome], view: FaultView, since: float, policy: str) -> list[Outcome]:
    """Requests begun after `since` that the fault's target served whole."""
    after = [o for o in outcomes if o.ok and o.start_s >= since]
    if view.kind == "worker":
        return [o for o in after if o.worker == view.worker_id]
    if view.kind == "gateway":
        return [o for o in after if o.gateway == view.gateway]
    return [o for o in after if o.policy == policy]  # scheduled again, not round robin


def check_fault(rec: FaultRecord, view: FaultView | None, outcomes: list[Outcome],
                policy: str) -> FaultCheck:
    c = FaultCheck(rec.fault.name)
    c.checks["signalled"] = rec.pid is not None and rec.signal_s is not None
    c.checks["no injector error"] = not rec.errors
    if rec.errors:
        c.evidence["errors"] = rec.errors
    action = rec.fault.action
    if action == "kill":
        c.checks["died of SIGKILL (exit -9)"] = rec.exit_code == -9
    elif action == "term":
        c.checks["drained and exited by itself (exit 0)"] = rec.exit_code == 0
    else:
        c.checks["stopped (/proc state T)"] = rec.stopped_state == "T"
        c.checks["running again after SIGCONT"] = rec.resumed_state not in (None, "T")
    if action != "stop":
        c.checks["restarted (a new pid that answers /health)"] = (
            rec.ready_s is not None and rec.new_pid is not None and rec.new_pid != rec.pid)
    c.evidence.update(pid=rec.pid, exit_code=rec.exit_code, new_pid=rec.new_pid,
                      stopped_state=rec.stopped_state, resumed_state=rec.resumed_state)
    if view is None or rec.recovered_s is None:
        c.checks["served again after recovery"] = False
        return c
    again = _served_after(outcomes, view, rec.recovered_s, policy)
    c.checks["served again after recovery"] = bool(again)
    if again:
        first = min(again, key=lambda o: o.start_s)
        c.evidence["first request served after recovery"] = {
            "id": first.request_id, "start_s": round(first.start_s, 3),
            "after_recovery_s": round(first.start_s - rec.recovered_s, 3)}
    c.evidence.update(_what_it_did(rec, view, outcomes))
    return c


def _what_it_did(rec: FaultRecord, view: FaultView, outcomes: list[Outcome]) -> dict[str, Any]:
    """What the traffic shows of the fault (evidence, not checked: the load decides how much)."""
    sig = rec.signal_s
    assert sig is not None
    end = rec.recovered_s if rec.recovered_s is not None else sig
    spanning = [o for o in outcomes if o.start_s < sig and (o.end_s or 0) > sig]
    if view.kind == "scheduler":
        routed = [o for o in outcomes if o.ok and sig <= o.start_s <= end]
        return {"requests served by round robin while it was away": sum(
            o.policy == FALLBACK_POLICY for o in routed)}
    if view.kind == "gateway":
        return {"requests in flight on it at the signal that ended whole": sum(
            o.ok and o.gateway == view.gateway for o in spanning),
            "requests that moved to another replica (no answer from it)": sum(
            bool(o.no_answer) and sig <= o.start_s <= end for o in outcomes)}
    on_it = [o for o in spanning if o.worker == view.worker_id]
    return {"requests in flight on it at the signal that ended whole there": sum(o.ok for o in on_it),
            "requests in flight on it at the signal that failed": sum(not o.ok for o in on_it)}


def _from_the_logs(view: FaultView, logs: GatewayLogs, settle_s: float) -> dict[str, Any]:
    """What the gateways logged of the fault: retries off its worker, switches to round robin."""
    start, end = view.window(settle_s)
    if view.kind == "worker":
        assert view.worker_id is not None
        return {"retried off it by the gateways (their logs), by reason":
                logs.retried_away(view.worker_id, start, end)}
    if view.kind == "scheduler":
        back = view.recovered_s if view.recovered_s is not None else start
        return {"gateways' switches to round robin, s after the kill": [
                    round(s.at_s - start, 2) for s in logs.switched(start, end) if s.on],
                "... and back to the scheduler, s after it served again": [
                    round(s.at_s - back, 2) for s in logs.switched(start, end) if not s.on]}
    return {}


def check_faults(records: list[FaultRecord], outcomes: list[Outcome], worker_ids: list[str],
                 policy: str, logs: GatewayLogs, settle_s: float) -> list[FaultCheck]:
    checks = []
    for r in records:
        view = fault_view(r, worker_ids)
        check = check_fault(r, view, outcomes, policy)
        if view is not None:
            check.evidence.update(_from_the_logs(view, logs, settle_s))
        checks.append(check)
    return checks


def held_at_kill(rec: FaultRecord, outcomes: list[Outcome], classes: dict[str, str], logs: GatewayLogs,
                 samples: list[Sample], expect_held: bool) -> FaultCheck:
    """The requests held when the scheduler was killed: each answered once and none lost
    (`classes`: each request id's class, benchmarks/chaos_outcomes.py); the gateways' queues
    empty again afterwards. expect_held: the load was meant to saturate the workers then (a
    surge), so none held means the fault missed what it was for."""
    c = FaultCheck(f"{rec.fault.name}: held requests")
    sig = rec.signal_s
    if sig is None:
        c.checks["signalled"] = False
        return c
    held = logs.held_at(sig, HELD_MIN_MS)
    by_id = {o.request_id: o for o in outcomes}
    failed = {a.request_id: classes.get(a.request_id, LOST) for a in held
              if not (by_id.get(a.request_id) and by_id[a.request_id].ok)}
    lost = [i for i, cls in failed.items() if cls == LOST]
    twice = logs.answered_twice()
    held_twice = sorted({a.request_id for a in held} & set(twice))
    if expect_held:
        c.checks["requests held at the kill (the load saturated the workers)"] = bool(held)
    c.checks["no request held at the kill lost (each whole, or cut by a design limit)"] = not lost
    c.checks["no request held at the kill answered twice"] = not held_twice
    back = next((s for s in samples if s.at_s > sig and s.queued == 0
                 and all(g is not None for g in s.gateways)), None)
    if expect_held:
        c.checks["the gateways' queues empty again after the kill"] = back is not None
    gauges = (rec.before or {}).get("gateways") or []
    c.evidence.update({
        "held at the kill (access lines: looking for a worker then), by gateway": {
            f"gateway{g}": sum(a.gateway == g for a in held) for g in sorted({a.gateway for a in held})},
        "held at the kill: total": len(held),
        "gateways' queue gauges just before the kill (router_requests_queued)": [
            None if g is None else g.get(QUEUED) for g in gauges],
        "held requests served by round robin": sum(
            by_id[a.request_id].policy == FALLBACK_POLICY for a in held if a.request_id in by_id),
        "held requests that ended whole": len(held) - len(failed),
        "held requests that did not end whole, and their class": dict(list(failed.items())[:20]),
        "held requests answered twice": held_twice[:20],
        "longest a held request looked for a worker, s": round(
            max((a.queue_ms for a in held), default=0) / 1000, 2),
        "gateways' queues empty again, s after the kill": None if back is None else round(back.at_s - sig, 2),
    })
    return c


def gateway_kill_evidence(rec: FaultRecord, outcomes: list[Outcome], classes: dict[str, str],
                          samples: list[Sample], lease_ttl_s: float) -> dict[str, Any]:
    """What became of a SIGKILLed gateway's requests, and of their leases at the scheduler."""
    sig, g = rec.signal_s, int(rec.fault.target[len("gateway"):])
    assert sig is not None
    end = rec.recovered_s if rec.recovered_s is not None else sig
    mark = f"gateway{g}:"
    on_it = [o for o in outcomes if o.start_s < sig and (o.end_s or 0) > sig and g in o.gateways
             and (o.gateway == g or any(n.startswith(mark) for n in o.no_answer))]
    moved = [o for o in on_it if any(n.startswith(mark) for n in o.no_answer)]
    watch = [s for s in samples if sig - 1.0 <= s.at_s <= sig + LEASE_WATCH_S and s.leases is not None]
    series = [[round(s.at_s - sig, 1), s.leases,
               # What the live gateways hold leases for (running, not queued): the rest are the
               # dead gateway's (or the scheduler's lag behind a release).
               sum(int(x.get(IN_FLIGHT, 0) - x.get(QUEUED, 0)) for x in s.gateways if x is not None),
               # Held by the live gateways: a dead gateway's leases count as running on their
               # workers, which may look full to the scheduler while they are not.
               s.queued,
               None if s.workers is None else {w.worker_id: w.in_flight_leases for w in s.workers}]
              for s in watch]
    return {
        "requests in flight on it at the kill": len(on_it),
        "... moved to the other replica (no byte of an answer yet) and ended whole": sum(o.ok for o in moved),
        "... moved to the other replica and failed": sum(not o.ok for o in moved),
        "... cut by the crash (answer begun)": sum(
            classes.get(o.request_id) == "cut_gateway_killed" for o in on_it),
        "... whole on it already (its last bytes read as it died)": sum(
            o.ok and o.gateway == g and not o.no_answer for o in on_it),
        "requests begun while it was down that moved to the other replica": sum(
            bool(o.no_answer) and sig <= o.start_s <= end for o in outcomes),
        "scheduler's open leases after the kill [s after, total, live gateways' running, "
        "gateways' held, per worker]": series,
        "scheduler's --lease-ttl-s (a lease no gateway releases expires then)": lease_ttl_s,
    }


def _round(t: float | None) -> float | None:
    return None if t is None else round(t, 2)


def end_of_run(end: Sample | None, idle_s: float | None, leases_zero_s: float | None,
               logs: GatewayLogs, max_leases_left: int | None) -> FaultCheck:
    """Once the load is over and every request ended: nothing held, nothing in flight, nothing
    answered twice; the scheduler's leases left open reported (checked if a bound is given)."""
    c = FaultCheck("end of run")
    twice = logs.answered_twice()
    c.checks["no request answered twice (two 200 access lines)"] = not twice
    answering = end is not None and all(g is not None for g in end.gateways)
    c.checks["every gateway answers /metrics"] = answering
    if end is not None and answering:
        c.checks["gateways hold no request (router_requests_queued 0)"] = all(
            g is not None and g.get(QUEUED) == 0 for g in end.gateways)
        c.checks["gateways run no request (router_requests_in_flight 0)"] = all(
            g is not None and g.get(IN_FLIGHT) == 0 for g in end.gateways)
    leases = None if end is None else end.leases
    if max_leases_left is not None:
        c.checks[f"scheduler's open leases at most {max_leases_left}"] = (
            leases is not None and leases <= max_leases_left)
    c.evidence.update({
        "gateways' gauges at the end": None if end is None else end.gateways,
        "scheduler's open leases at the end, per worker": None if end is None or end.workers is None
        else {w.worker_id: w.in_flight_leases for w in end.workers},
        "scheduler's open leases at the end: total": leases,
        "gateways idle (nothing held or in flight), s into the run": _round(idle_s),
        "scheduler's open leases 0, s into the run": _round(leases_zero_s),
        "requests answered twice": {i: [f"gateway{a.gateway} {a.worker}" for a in lines]
                                    for i, lines in list(twice.items())[:20]},
    })
    return c
