"""Several failures in one run under steady load (`python -m benchmarks.chaos --quick`): four
sim workers, the scheduler and two gateways on 127.0.0.1; a worker SIGKILLed, a worker
SIGTERMed, the scheduler SIGKILLed while a surge of load keeps requests held in the gateways'
queues, a gateway SIGTERMed, a worker SIGSTOPped then continued, the other gateway SIGKILLed
(each restarted). No request may be lost (fail where README/DESIGN say the product survives),
each fault must really have happened (the process died of its signal, or was stopped; a new
one answered, and it served requests again), no request held when the scheduler died may be
lost or answered twice, the killed gateway's requests must have moved to the other replica or been
cut by the crash, and every held and in-flight count must be back to 0 at the end. No timing
assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos_outcomes import LOST, OK


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_no_request_is_lost_through_six_faults_and_each_fault_happened(tmp_path: Path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--quick", "--output", str(out),
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=240, check=False)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())

    lost = [{k: c.get(k) for k in ("id", "fault", "failure", "log_lines")} for c in doc["lost"]]
    assert doc["totals"][LOST] == 0, json.dumps(lost, indent=1)
    assert doc["totals"][OK] > 0
    assert not any(r["unfinished"] for r in doc["requests"])

    assert [f["fault"]["name"] for f in doc["faults"]] == [
        "kill worker0", "term worker1", "kill scheduler", "term gateway1", "stop worker2", "kill gateway0"]
    failed_checks = {c["fault"]: c["checks"] for c in doc["checks"] if not c["passed"]}
    assert not failed_checks, json.dumps(doc["checks"], indent=1)
    by_name = {f["fault"]["name"]: f for f in doc["faults"]}
    assert (by_name["kill worker0"]["exit_code"] == by_name["kill scheduler"]["exit_code"]
            == by_name["kill gateway0"]["exit_code"] == -9)
    assert by_name["term worker1"]["exit_code"] == by_name["term gateway1"]["exit_code"] == 0
    assert by_name["stop worker2"]["stopped_state"] == "T"
    for f in doc["faults"]:
        assert f["errors"] == [], f
        if f["fault"]["action"] != "stop":
            assert f["new_pid"] not in (None, f["pid"]), f
    # The requests the client moved to the other replica found it: the gateway's SIGTERM was
    # seen by the traffic, not only by the process.
    gateway_check = next(c for c in doc["checks"] if c["fault"] == "term gateway1")
    assert gateway_check["evidence"]["requests that moved to another replica (no answer from it)"] > 0
    # The scheduler died with requests held (the surge saturated the workers), and none was
    # lost (the check "no request held at the kill lost", passed above).
    checks = {c["fault"]: c for c in doc["checks"]}
    held = checks["kill scheduler: held requests"]
    assert held["checks"]["requests held at the kill (the load saturated the workers)"], held
    assert held["evidence"]["held at the kill: total"] > 0
    # The SIGKILLed gateway's requests: each moved to the other replica, or was cut by the crash.
    crash = checks["kill gateway0"]["evidence"]
    on_it = crash["requests in flight on it at the kill"]
    assert on_it > 0
    assert crash["... moved to the other replica and failed"] == 0, crash
    assert on_it == (crash["... moved to the other replica (no byte of an answer yet) and ended whole"]
                     + crash["... cut by the crash (answer begun)"]
                     + crash["... whole on it already (its last bytes read as it died)"]), crash
    # Nothing held, nothing in flight, nothing answered twice once the load is over.
    assert checks["end of run"]["passed"], checks["end of run"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Nothing outlives the run, restarted processes included.
    pids = [p for f in doc["faults"] for p in (f["pid"], f["new_pid"]) if p is not None]
    assert not [p for p in pids if _alive(p)]
