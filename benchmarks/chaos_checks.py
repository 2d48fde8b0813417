"""Did each fault of the chaos soak really happen, and did its target come back?

A soak that counts no lost request proves nothing if the kill missed its process or the
restarted process never took traffic again, so each fault is checked from two sides: the
process (its pid, exit status, /proc state) and the traffic (a request it served after its
recovery, as the answers' `x-router-*` headers tell).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos_client import Outcome
from benchmarks.chaos_faults import FaultRecord
from benchmarks.chaos_logs import GatewayLogs
from benchmarks.chaos_outcomes import FaultView, fault_view

FALLBACK_POLICY = "fallback_round_robin"  # the gateway's x-router-policy while the scheduler is away


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
        return {"requests in flight on it at SIGTERM that ended whole": sum(
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
