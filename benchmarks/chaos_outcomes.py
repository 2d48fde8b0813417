"""What each request of the chaos soak came to, judged by what the design promises.

The classes come from README.md ("Architecture") and DESIGN.md ("Gateway behaviour"), not
from what a run shows. A failure is one of the design's limits only when the request, its
process and the time all fit that limit; any other failure is `lost`: the product promised
to survive it.

- A worker SIGKILLed: a request it held that had not reached its client yet (every whole
  answer; a stream before its first event) is retried on another worker ("retry_count ... a
  request whose worker fails before any byte reached the client is sent to another worker").
  A stream that already started is not ("never silently replayed"): it ends with an error
  event. -> `stream_cut_worker_killed`.
- A worker SIGTERMed: it refuses new requests with 503 `shutting_down`, which the gateway
  retries elsewhere, and finishes the rest for up to its `--shutdown-timeout`; "what is left
  at the limit ... ends with that error as a last stream event". -> `cut_at_worker_drain_deadline`.
- The scheduler down: the gateway retries it, then serves by round robin, and returns to it.
  Nothing may fail.
- A gateway SIGTERMed: it closes its listener (new connections go to the other replica) and
  finishes its streams within its `--shutdown-timeout`; "what is still running then is cut
  with a `shutting_down` error". -> `cut_at_gateway_drain_deadline`.
- A gateway SIGKILLed (a crash): nothing of it survives, and no design can save an answer a
  dead process was sending. A request it had not begun to answer (held, or waiting for its
  worker's first byte) loses its connection before a status line, and the client, as a load
  balancer would, sends it to the other replica: it must then end whole. One whose answer had
  begun (a stream's first event, a status line) is cut by the crash, not replayed.
  -> `cut_gateway_killed`.
- A worker hung (SIGSTOP): a whole answer is retried once the scheduler reports it down
  (router/down_watch.py); a stream waits, and only one silent past `--idle-stream-timeout-ms`
  ends with an error event. -> `stream_idle_on_hung_worker`.
- A full queue is refused with 429 `queue_full` ("past that, the client gets HTTP 429").
  -> `refused_queue_full` (overload, not a fault: the soak's load should never cause it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.chaos_client import Outcome
from benchmarks.chaos_faults import FaultRecord

OK = "ok"
LOST = "lost"
# The design's limits, in the table's column order, each with what it means.
LIMITS = {
    "stream_cut_worker_killed":
        "stream cut: its worker was SIGKILLed after its first event reached its client",
    "cut_at_worker_drain_deadline": "still running when its SIGTERMed worker's --shutdown-timeout ran out",
    "cut_at_gateway_drain_deadline": "still running when its SIGTERMed gateway's --shutdown-timeout ran out",
    "cut_gateway_killed": "answer begun (status line, a stream's events) when its gateway was SIGKILLed",
    "stream_idle_on_hung_worker": "stream silent past --idle-stream-timeout-ms on a stopped worker",
    "refused_queue_full": "429 queue_full: the gateway's queue was full",
}
CLASSES = (OK, *LIMITS, LOST)


@dataclass(frozen=True)
class Settings:
    """The services' limits the design's promises are stated in (seconds)."""

    worker_shutdown_s: float = 30.0  # a worker's --shutdown-timeout
    gateway_shutdown_s: float = 50.0  # a gateway's --shutdown-timeout
    idle_stream_s: float = 60.0  # the gateway's --idle-stream-timeout-ms
    # A SIGKILLed worker's connections break at once: a cut this long after the kill is not its.
    cut_grace_s: float = 5.0
    # After a fault's recovery, how long its effects may last (scrapes, probation, refreshes).
    settle_s: float = 3.0
    lease_ttl_s: float = 600.0  # the scheduler's --lease-ttl-s: a lease no gateway releases expires


@dataclass(frozen=True)
class FaultView:
    """A fault as the classifier needs it: what it hit, and when."""

    name: str
    action: str
    kind: str  # worker | scheduler | gateway
    worker_id: str | None  # a worker's id as the gateway names it (x-router-worker)
    gateway: int | None  # a gateway's index in the client's list
    signal_s: float
    recovered_s: float | None

    def window(self, settle_s: float) -> tuple[float, float]:
        end = self.recovered_s if self.recovered_s is not None else self.signal_s
        return self.signal_s, end + settle_s

    def touches(self, o: Outcome) -> bool:
        """Whether the request went through the process this fault hit."""
        if self.kind == "worker":
            return o.worker == self.worker_id
        if self.kind == "gateway":
            return self.gateway in o.gateways
        return True  # every request asks the scheduler


def fault_view(r: FaultRecord, worker_ids: list[str]) -> FaultView | None:
    """The fault as signalled, with the id its target has in the answers (None: not signalled)."""
    if r.signal_s is None:
        return None
    target = r.fault.target
    kind = next(k for k in ("worker", "scheduler", "gateway") if target.startswith(k))
    index = int(target[len(kind):]) if kind != "scheduler" else None
    return FaultView(
        name=r.fault.name, action=r.fault.action, kind=kind,
        worker_id=worker_ids[index] if kind == "worker" and index is not None else None,
        gateway=index if kind == "gateway" else None,
        signal_s=r.signal_s, recovered_s=r.recovered_s)


def fault_views(records: list[FaultRecord], worker_ids: list[str]) -> list[FaultView]:
    """The faults that were signalled."""
    return [v for r in records if (v := fault_view(r, worker_ids)) is not None]


Rule = Callable[[Outcome, FaultView, Settings], bool]


def _after(o: Outcome, f: FaultView, delay_s: float) -> bool:
    """The request's error came at least `delay_s` after the signal (1 s of slack for clocks)."""
    return o.error_s is not None and o.error_s >= f.signal_s + delay_s - 1.0


def _cut_by_kill(o: Outcome, f: FaultView, s: Settings) -> bool:
    return (f.action == "kill" and f.kind == "worker" and o.stream and o.started
            and o.error_code == "upstream_error" and o.worker == f.worker_id
            and o.start_s < f.signal_s and o.error_s is not None
            and f.signal_s - 1.0 <= o.error_s <= f.signal_s + s.cut_grace_s)


def _worker_deadline(o: Outcome, f: FaultView, s: Settings) -> bool:
    return (f.action == "term" and f.kind == "worker" and o.error_code == "shutting_down"
            and o.worker == f.worker_id and _after(o, f, s.worker_shutdown_s))


def _gateway_deadline(o: Outcome, f: FaultView, s: Settings) -> bool:
    return (f.action == "term" and f.kind == "gateway" and o.error_code == "shutting_down"
            and o.gateway == f.gateway and _after(o, f, s.gateway_shutdown_s))


def _cut_by_gateway_kill(o: Outcome, f: FaultView, s: Settings) -> bool:
    return (f.action == "kill" and f.kind == "gateway" and o.gateway == f.gateway
            and o.status is not None and o.transport_error is not None
            and o.start_s < f.signal_s and o.error_s is not None
            and f.signal_s - 1.0 <= o.error_s <= f.signal_s + s.cut_grace_s)


def _idle_on_hang(o: Outcome, f: FaultView, s: Settings) -> bool:
    return (f.action == "stop" and f.kind == "worker" and o.stream and o.started
            and o.error_code == "upstream_error" and "idle_timeout" in (o.error_message or "")
            and o.worker == f.worker_id and _after(o, f, s.idle_stream_s))


RULES: dict[str, Rule] = {
    "stream_cut_worker_killed": _cut_by_kill,
    "cut_at_worker_drain_deadline": _worker_deadline,
    "cut_at_gateway_drain_deadline": _gateway_deadline,
    "cut_gateway_killed": _cut_by_gateway_kill,
    "stream_idle_on_hung_worker": _idle_on_hang,
}


def failure_text(o: Outcome) -> str:
    """One line on how a request failed, for the report."""
    if o.unfinished:
        return "unfinished at the run's wall-clock cap"
    if o.status is None:
        return f"no gateway answered ({o.error_code}; {'; '.join(o.no_answer[-2:])})"
    if o.transport_error:
        return f"HTTP {o.status}, then the connection failed: {o.transport_error}"
    if o.error_code:
        where = "a stream's error event" if o.started else f"HTTP {o.status}"
        return f"{where}: {o.error_code}: {o.error_message}"
    return f"HTTP {o.status}, {o.tokens} of {o.max_tokens} tokens{'' if o.done else ', not ended'}"


def event_of(o: Outcome, faults: list[FaultView], s: Settings) -> FaultView | None:
    """The fault a request lived through (its lifetime overlaps the fault's window, signal to
    recovery + settle): one that hit its own worker or gateway, else the scheduler's (every
    request asks it), else any other; of several, the last signalled."""
    end = o.end_s if o.end_s is not None else o.start_s
    live = [f for f in faults if o.start_s <= f.window(s.settle_s)[1] and end >= f.signal_s]
    own = [f for f in live if f.kind != "scheduler" and f.touches(o)]
    scheduler = [f for f in live if f.kind == "scheduler"]
    pick = own or scheduler or live
    return max(pick, key=lambda f: f.signal_s) if pick else None


def classify(o: Outcome, faults: list[FaultView], s: Settings) -> tuple[str, FaultView | None]:
    """(class, the fault it is put down to)."""
    if o.ok:
        return OK, event_of(o, faults, s)
    if o.status == 429 and o.error_code == "queue_full":
        return "refused_queue_full", event_of(o, faults, s)
    for name, rule in RULES.items():
        for f in faults:
            if rule(o, f, s):
                return name, f
    return LOST, event_of(o, faults, s)
