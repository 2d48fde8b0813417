"""Schedule calls held while every candidate is saturated, and the order they are woken in.

When something may have freed room every held call is woken, and each decides again as it
resumes, in the order woken (tasks resume in the order their futures complete): the first to
decide gets the room. That order is:
- priority first (the gateway queue's, lower first: ScheduleRequest.priority);
- within a priority, a model's calls in the order of their flows' token counters
  (scheduler/fair_share.py: the tenant served the fewest weighted tokens over every gateway's
  traffic first), in the places its calls hold in the list (a model's counters say nothing
  about another model's);
- otherwise the list's order: a call goes in at its request's arrival in its gateway's queue
  (ScheduleRequest.waited_ms: a long poll that ran out and is asked again keeps its place);
  woken and still waiting, it goes back in the order woken (its turn).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

from scheduler.fair_share import FlowLedger

# Flows whose last held call ran out, kept at most (HeldCalls.poll_ran_out).
POLLS_OUT_KEPT = 4096
# A call of a flow whose last held call ran out this recently is that flow asking again.
ASKED_AGAIN_WITHIN_S = 1.0


class HeldCall:
    """A schedule call held until something may have freed room."""

    __slots__ = ("arrival", "flow", "future", "ledger", "priority")

    def __init__(self, arrival: tuple[float, int], ledger: FlowLedger | None, flow: str | None,
                 priority: int = 0) -> None:
        # When its request arrived in its gateway's queue (time.monotonic()), then the call's
        # number.
        self.arrival = arrival
        self.ledger = ledger  # its model's counters (None: no flow, or fair_share off)
        self.flow = flow
        self.priority = priority
        self.future: asyncio.Future | None = None

    def turn(self) -> tuple[int, float, tuple[float, int]]:
        served = self.ledger.served(self.flow) if self.ledger is not None else 0.0
        return (self.priority, served, self.arrival)


class HeldCalls:
    def __init__(self) -> None:
        self._held: list[HeldCall] = []
        self._seq = itertools.count()
        # Per (counters, flow): when its last held call ran out unplaced. Its gateway asks
        # again for the same request at once, which is the flow still waiting, not arriving.
        self._polls_out: dict[tuple[FlowLedger, str], float] = {}

    def __len__(self) -> int:
        return len(self._held)

    def new(self, now: float, waited_ms: int, ledger: FlowLedger | None, flow: str | None,
            priority: int) -> HeldCall:
        return HeldCall((now - waited_ms / 1000.0, next(self._seq)), ledger, flow, priority)

    def place_of(self, call: HeldCall) -> int | None:
        """Where a new call goes: ahead of the calls held since its request arrived (None: at
        the end)."""
        return next((i for i, h in enumerate(self._held) if h.arrival > call.arrival), None)

    def hold(self, call: HeldCall, at: int | None) -> asyncio.Future:
        """Hold `call` (at `at`, else last) until wake_all() or unhold(); its future."""
        call.future = asyncio.get_running_loop().create_future()
        if at is None:
            self._held.append(call)
        else:
            self._held.insert(at, call)
        return call.future

    def unhold(self, call: HeldCall) -> None:
        """Woken (it left the list then), timed out or cancelled (it is still in it)."""
        if call.future is not None and not call.future.done():
            call.future.cancel()
            self._held.remove(call)

    def wake_all(self) -> None:
        held = self._held
        if not held:
            return
        self._held = []
        if any(h.ledger is not None for h in held):
            held = _fair_order(held)
        if any(h.priority for h in held):
            held = sorted(held, key=_priority_of)  # stable: each priority keeps the order above
        for h in held:
            if h.future is not None and not h.future.done():
                h.future.set_result(None)

    def flows_held(self, ledger: FlowLedger) -> Iterator[str | None]:
        return (h.flow for h in self._held if h.ledger is ledger)

    def waiting(self, ledger: FlowLedger, flow: str, now: float) -> bool:
        """Whether the flow is waiting here: a call of it held, or one that ran out just before
        (its gateway asks again at once, for a request that waits on)."""
        ran_out = self._polls_out.pop((ledger, flow), None)
        if ran_out is not None and now - ran_out <= ASKED_AGAIN_WITHIN_S:
            return True
        return any(h.ledger is ledger and h.flow == flow for h in self._held)

    def poll_ran_out(self, ledger: FlowLedger, flow: str) -> None:
        now = time.monotonic()
        if len(self._polls_out) >= POLLS_OUT_KEPT:
            # Calls not asked again (their requests left): a gateway asks again at once.
            self._polls_out = {k: t for k, t in self._polls_out.items() if now - t < 60.0}
            if len(self._polls_out) >= POLLS_OUT_KEPT:
                self._polls_out.clear()  # at worst, flows asking again are lifted as before
        self._polls_out[ledger, flow] = now


def _priority_of(held: HeldCall) -> int:
    return held.priority


def _fair_order(held: list[HeldCall]) -> list[HeldCall]:
    """Each model's calls in their flows' order, in the places its calls had in the list."""
    by_ledger: dict[FlowLedger | None, list[HeldCall]] = {}
    for h in held:
        by_ledger.setdefault(h.ledger, []).append(h)
    turns = {ledger: iter(sorted(calls, key=HeldCall.turn)) for ledger, calls in by_ledger.items()}
    return [next(turns[h.ledger]) for h in held]
