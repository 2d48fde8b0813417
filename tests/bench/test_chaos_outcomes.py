"""The chaos soak's classes (benchmarks/chaos_outcomes.py): a failure is one of the design's
limits only when the request, the process it went through and the time all fit that limit;
anything else is `lost`. No processes: outcomes and faults are made up."""

from __future__ import annotations

from benchmarks.chaos_client import Outcome, Workload
from benchmarks.chaos_faults import Fault, FaultRecord
from benchmarks.chaos_outcomes import LOST, OK, Settings, classify, fault_views

WORKERS = ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
S = Settings()


def _faults() -> list:
    kill = FaultRecord(Fault(10, "kill", "worker0", 2), pid=1, signal_s=10.0, exit_code=-9, ready_s=13.0)
    gw = FaultRecord(Fault(30, "term", "gateway1", 1), pid=2, signal_s=30.0, exit_code=0, ready_s=33.0)
    sched = FaultRecord(Fault(50, "kill", "scheduler", 3), pid=3, signal_s=50.0, exit_code=-9, ready_s=54.0)
    return fault_views([kill, gw, sched], WORKERS)


def _stream_cut(worker: str, start_s: float, error_s: float) -> Outcome:
    return Outcome(index=1, request_id="r1", stream=True, max_tokens=50, start_s=start_s, end_s=error_s,
                   gateways=[0], status=200, worker=worker, started=True, tokens=7, done=True,
                   error_code="upstream_error", error_message="the worker failed mid-stream (connection)",
                   error_s=error_s)


def test_a_whole_answer_of_every_token_is_ok_and_put_down_to_the_fault_it_lived_through():
    o = Outcome(index=0, request_id="r0", stream=False, max_tokens=20, start_s=51.0, end_s=52.0,
                gateways=[1], status=200, worker=WORKERS[2], tokens=20, done=True)
    cls, fault = classify(o, _faults(), S)
    assert (cls, fault.name) == (OK, "kill scheduler")


def test_a_request_is_put_down_to_the_fault_of_its_own_gateway_before_the_schedulers():
    # It lived through both windows (the scheduler's recovery settling, the gateway's SIGTERM).
    sched = FaultRecord(Fault(27, "kill", "scheduler", 1), pid=3, signal_s=27.0, exit_code=-9, ready_s=29.0)
    gw = FaultRecord(Fault(30, "term", "gateway1", 1), pid=2, signal_s=30.0, exit_code=0, ready_s=33.0)
    o = Outcome(index=0, request_id="r0", stream=False, max_tokens=20, start_s=30.5, end_s=31.0,
                gateways=[1, 0], no_answer=["gateway1: ClientConnectorError"], status=200,
                worker=WORKERS[2], tokens=20, done=True)
    cls, fault = classify(o, fault_views([sched, gw], WORKERS), S)
    assert (cls, fault.name) == (OK, "term gateway1")


def test_a_started_stream_cut_on_the_killed_worker_at_the_kill_is_the_designs_limit():
    cls, fault = classify(_stream_cut(WORKERS[0], 9.0, 10.05), _faults(), S)
    assert (cls, fault.name) == ("stream_cut_worker_killed", "kill worker0")


def test_the_same_cut_on_another_worker_or_long_after_the_kill_is_lost():
    assert classify(_stream_cut(WORKERS[1], 9.0, 10.05), _faults(), S)[0] == LOST
    assert classify(_stream_cut(WORKERS[0], 9.0, 25.0), _faults(), S)[0] == LOST
    # Begun after the kill: its worker was already dead, so it should have been retried.
    assert classify(_stream_cut(WORKERS[0], 10.5, 10.6), _faults(), S)[0] == LOST


def test_a_whole_answer_failed_by_a_killed_worker_is_lost_it_should_have_been_retried():
    o = Outcome(index=2, request_id="r2", stream=False, max_tokens=20, start_s=9.0, end_s=10.1,
                gateways=[0], status=502, error_code="upstream_failed", error_s=10.1)
    cls, fault = classify(o, _faults(), S)
    assert (cls, fault.name) == (LOST, "kill worker0")


def test_a_draining_gateways_shutting_down_is_its_limit_only_at_its_deadline():
    def cut_at(error_s: float) -> Outcome:
        return Outcome(index=3, request_id="r3", stream=False, max_tokens=20, start_s=29.0,
                       end_s=error_s, gateways=[1], status=503, error_code="shutting_down", error_s=error_s)

    assert classify(cut_at(32.0), _faults(), S)[0] == LOST  # it had 50 s to finish
    assert classify(cut_at(30.0 + S.gateway_shutdown_s), _faults(), S)[0] == "cut_at_gateway_drain_deadline"


def test_a_short_answer_no_gateway_and_a_request_cut_by_the_runs_cap_are_lost():
    short = Outcome(index=4, request_id="r4", stream=True, max_tokens=20, start_s=1.0, end_s=2.0,
                    gateways=[0], status=200, started=True, tokens=12, done=True)
    nobody = Outcome(index=5, request_id="r5", stream=False, max_tokens=20, start_s=1.0, end_s=6.0,
                     gateways=[0, 1] * 10, error_code="no_gateway_answered")
    cut = Outcome(index=6, request_id="r6", stream=False, max_tokens=20, start_s=1.0, end_s=9.0,
                  gateways=[0], unfinished=True)
    for o in (short, nobody, cut):
        assert not o.ok
        assert classify(o, _faults(), S) == (LOST, None)  # before any fault


def test_each_request_of_a_workload_is_the_same_on_every_run():
    w = Workload("m", seed=3)
    assert w.request(7) == Workload("m", seed=3).request(7)
    kinds = {w.request(i)[0] for i in range(50)}
    assert kinds == {True, False}  # both streamed and whole answers
    body = next(w.request(i)[1] for i in range(50) if w.request(i)[0])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_a_stream_begun_on_a_sigkilled_gateway_is_cut_by_the_crash_one_not_begun_is_lost():
    kill = FaultRecord(Fault(40, "kill", "gateway0", 2), pid=4, signal_s=40.0, exit_code=-9, ready_s=43.0)
    views = fault_views([kill], WORKERS)

    def on_gateway0(status: int | None, start_s: float, error_s: float) -> Outcome:
        return Outcome(index=7, request_id="r7", stream=True, max_tokens=50, start_s=start_s, end_s=error_s,
                       gateways=[0], status=status, worker=WORKERS[1], started=status is not None, tokens=9,
                       transport_error="ClientPayloadError: Response payload is not completed",
                       error_s=error_s)

    assert classify(on_gateway0(200, 38.0, 40.01), views, S) == ("cut_gateway_killed", views[0])
    # The same cut on the other gateway, or long after the kill, is not the crash's.
    other = on_gateway0(200, 38.0, 40.01)
    other.gateways = [1]
    assert classify(other, views, S)[0] == LOST
    assert classify(on_gateway0(200, 38.0, 50.0), views, S)[0] == LOST
    # No status line: the client should have sent it to the other gateway, and did not.
    assert classify(on_gateway0(None, 38.0, 40.01), views, S)[0] == LOST
