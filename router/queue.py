"""Bounded admission queue, one line per model, FIFO or shortest-prompt-first.

A request that the scheduler cannot place yet takes a place here. Only the first
`askers` of a model's line (the head, by default one) ask the scheduler (with a
long-poll `wait_ms`, so they are answered the moment capacity frees, without a
polling delay); when one is placed it leaves and the next one asks at once. With
more than one asker, room the head cannot use (its prompt does not fit the KV a
worker has free) goes to the next one that fits instead of idling: the scheduler
wakes held calls by priority, then in the order they came (or by their flows' token counters),
so the head still has first pick. New
arrivals for a model that already has a line join it instead of overtaking the head.
The bound is global: past `max_size` waiting requests, a newcomer is refused (429).
A request cancelled while waiting (its client went away) leaves the line and wakes
its successor.

Order: a request's `priority` first (vLLM's field: lower is served first, 0 by default), so
that under saturation the gateway's queue does not undo what engines running priority
scheduling do. Within a priority, the flows (tenants: a fairness id or API key, see
router/fairness.py) take turns (see below for whose turn it is): a tenant that floods the
queue does not get all the places ahead of everybody else's. Within a flow, with
`ms_per_prompt_token` 0 the line is FIFO. Above 0, a request's place is its arrival time plus
its prompt length times that many milliseconds: after a burst, short prompts go first
(shortest-job-first is what minimises the mean time to first token when the workers drain a
backlog), and the delay a long prompt can suffer from later, shorter ones of its flow is
bounded by its own length times the factor. With one flow (no fairness ids, no keys) the line
is as it was without flows. Priorities are strict: a lower one waits while higher ones keep
coming.

Turns are one request each, round robin as the Gateway API Inference Extension's flow control
does, with `fair_share="requests"` (this class's default). With
`fair_share="tokens"` (the gateway's default) the flow served the fewest tokens goes next
(scheduler/fair_share.py: a virtual token counter per flow and model, charged as requests get
their workers and settled with what they used), so a tenant of long prompts and long answers
does not take most of the GPUs by taking as many turns as a tenant of short ones.

The bound is fair too: when the queue is full, a newcomer whose flow has at least two
waiters fewer than the flow with the most takes the place of that flow's last waiter (of its
worst priority, and none better than the newcomer's), which is refused (429, QueueDisplaced)
instead of the newcomer. So a flood fills the queue only while nobody else needs it. Failing
that, a newcomer takes the place of the last waiter of the worst priority, if that is worse
than its own (so a queue full of batch requests still takes an interactive one). (The
displaced waiter leaves a moment later, so the count can pass `max_size` by the displacements
still under way.)
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

from scheduler.fair_share import DEFAULT_OUTPUT_TOKEN_WEIGHT, FlowLedger

FairShare = Literal["requests", "tokens"]


class QueueFull(Exception):
    """The admission queue already holds max_size requests."""


class QueueDisplaced(QueueFull):
    """A waiter whose place went to a newcomer (the queue is full): another flow's, or one of
    a better priority."""

    def __init__(self, by: str = "another tenant's request") -> None:
        super().__init__(by)
        self.by = by


class QueueTimeout(Exception):
    """A request waited longer than the queue timeout."""


_Entry = tuple[float, int, float, asyncio.Future[None]]  # (place, ticket, arrival, future)


def _expire(fut: asyncio.Future[None]) -> None:
    """A waiter's deadline passed before its turn: it leaves with QueueTimeout (promote() skips
    it); one already woken is asking, and checks its deadline itself."""
    if not fut.done():
        fut.set_exception(QueueTimeout())


class _Band:
    """One priority's waiters: a heap per flow, and the flows' turns (round robin)."""

    __slots__ = ("flows", "turns")

    def __init__(self) -> None:
        self.flows: dict[str, list[_Entry]] = {}
        self.turns: deque[str] = deque()  # each flow with waiters, once

    def push(self, flow: str, entry: _Entry, ledger: FlowLedger | None) -> None:
        heap = self.flows.get(flow)
        if heap is None:
            if ledger is not None:
                ledger.lift(flow, self.turns)  # it starts waiting: no credit banked while away
            heap = self.flows[flow] = []
            self.turns.append(flow)
        heapq.heappush(heap, entry)

    def pop(self, last: str | None, ledger: FlowLedger | None) -> tuple[str, _Entry] | None:
        """(flow, its best waiter) of the flow whose turn it is (None: none left); that flow's
        next turn is after every other flow's. `last`: the flow a waiter last left the line
        for (perhaps without waiting here): it goes after the others too. With a ledger, the
        turn is the flow's served least, and `last` goes after the others among equals (a
        tenant that starts waiting is lifted level with the others: the next turn is its)."""
        if len(self.turns) > 1 and self.turns[0] == last:
            self.turns.rotate(-1)
        while self.turns:
            if ledger is None:
                flow = self.turns.popleft()
            else:
                flow = ledger.pick(self.turns)
                self.turns.remove(flow)
            heap = self.flows[flow]
            while heap and heap[0][3].done():  # waiters that left (cancelled): skipped
                heapq.heappop(heap)
            entry = heapq.heappop(heap) if heap else None
            if heap:
                self.turns.append(flow)
            else:
                del self.flows[flow]
            if entry is not None:
                return flow, entry
        return None


class _Line:
    """One model's waiters, by priority band, plus those asking now."""

    __slots__ = ("askers", "bands", "last_flow", "ledger")

    def __init__(self, ledger: FlowLedger | None) -> None:
        self.ledger = ledger  # fair_share="tokens": the model's counters
        self.bands: dict[int, _Band] = {}
        self.askers: dict[asyncio.Future[None], float] = {}  # asking future -> arrival time
        self.last_flow: str | None = None  # whose request became an asker last

    def __bool__(self) -> bool:
        return bool(self.askers) or bool(self.bands)

    def push(self, priority: int, flow: str, entry: _Entry) -> None:
        band = self.bands.get(priority)
        if band is None:
            band = self.bands[priority] = _Band()
        band.push(flow, entry, self.ledger)

    def promote(self, max_askers: int) -> None:
        """The best waiters still waiting ask, up to max_askers, and are woken."""
        while self.bands and len(self.askers) < max_askers:
            priority = min(self.bands)
            band = self.bands[priority]
            popped = band.pop(self.last_flow, self.ledger)
            if not band.flows:
                del self.bands[priority]
            if popped is not None:
                self.last_flow, (_, _, arrival, fut) = popped
                self.askers[fut] = arrival
                fut.set_result(None)


class AdmissionQueue:
    def __init__(self, max_size: int, ms_per_prompt_token: float = 0.0, askers: int = 1,
                 fair_share: FairShare = "requests",
                 output_token_weight: float = DEFAULT_OUTPUT_TOKEN_WEIGHT) -> None:
        self.max_size = max_size
        self.s_per_prompt_token = ms_per_prompt_token / 1000.0
        self.askers = max(1, askers)
        self.fair_share = fair_share
        self.output_token_weight = output_token_weight
        self._ledgers: dict[str, FlowLedger] = {}  # by model (fair_share="tokens")
        self._lines: dict[str, _Line] = {}
        self._tickets = itertools.count()
        self.size = 0
        self._waiting = Counter[str]()  # waiters (not askers) by flow, over every line

    @property
    def waiting_flows(self) -> int:
        """How many flows (tenants) have requests waiting (those asking not counted)."""
        return len(self._waiting)

    def ledger(self, model: str) -> FlowLedger | None:
        """The model's flow counters (fair_share="tokens"; None otherwise). A pinned request's
        line (`model\0worker`) shares its model's."""
        if self.fair_share != "tokens":
            return None
        model = model.split("\0", 1)[0]
        ledger = self._ledgers.get(model)
        if ledger is None:
            ledger = self._ledgers[model] = FlowLedger(self.output_token_weight)
        return ledger

    def charge(self, model: str, flow: str, prompt_tokens: int, max_tokens: int | None) -> float:
        """A request got its worker: its flow's estimated cost (0 unless fair_share="tokens").
        Called before the request leaves the line, so the next turn already counts it."""
        ledger = self.ledger(model)
        return 0.0 if ledger is None else ledger.charge(flow, prompt_tokens, max_tokens)

    def settle(self, model: str, flow: str, charged: float, prompt_tokens: int,
               output_tokens: int) -> None:
        """A request charged `charged` ended: count what it used instead (nothing for a model
        never charged: its requests went by the fallback)."""
        ledger = self._ledgers.get(model)
        if ledger is not None:
            ledger.settle(flow, charged, prompt_tokens, output_tokens)

    def fair_state(self, limit: int = 20) -> dict[str, object]:
        """The turns' mode and, by tokens, each model's level and most-served flows."""
        state: dict[str, object] = {"fair_share": self.fair_share}
        if self._ledgers:
            state["token_counters"] = {
                model: {"level": round(ledger.level, 1), "flows": len(ledger),
                        "most_served": ledger.most_served(limit)}
                for model, ledger in self._ledgers.items()}
        return state

    def has_waiters(self, model: str) -> bool:
        return bool(self._lines.get(model))

    def oldest_asker_wait_s(self, model: str) -> float:
        """How long the longest-waiting request now asking has been in line (0: none)."""
        line = self._lines.get(model)
        if not line or not line.askers:
            return 0.0
        return time.monotonic() - min(line.askers.values())

    @asynccontextmanager
    async def place(self, model: str, prompt_tokens: int = 0, priority: int = 0,
                    flow: str = "", deadline: float | None = None) -> AsyncIterator[None]:
        """Join `model`'s line and return once it is among those asking; leave the line on exit.
        deadline (time.monotonic()): a waiter still in line then is refused (QueueTimeout) there
        and then. Those asking check it themselves (the caller's loop); one behind them must
        not wait for its turn to learn it is late: priorities, flows' turns and shortest-first
        let later requests (later deadlines) ask ahead of it, for as long as they keep coming."""
        if (self.size >= self.max_size and not self._displace_for(flow, priority)
                and not self._displace_worse_than(priority)):
            raise QueueFull
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = _Line(self.ledger(model))
        me: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        arrival = time.monotonic()
        self.size += 1
        try:
            if not line.bands and len(line.askers) < self.askers:
                line.askers[me] = arrival
                line.last_flow = flow
            else:
                place = arrival + self.s_per_prompt_token * max(0, prompt_tokens)
                line.push(priority, flow, (place, next(self._tickets), arrival, me))
                self._waiting[flow] += 1
                timer = (None if deadline is None else asyncio.get_running_loop().call_later(
                    max(0.0, deadline - time.monotonic()), _expire, me))
                try:
                    await me  # resolved by promote() when it is this waiter's turn
                finally:
                    if timer is not None:
                        timer.cancel()
                    if me.done() and not me.cancelled():
                        # Read, so that a refusal (timeout, displacement) that came as the
                        # task was being cancelled is not logged as never retrieved.
                        me.exception()
                    self._waiting[flow] -= 1
                    if not self._waiting[flow]:
                        del self._waiting[flow]
            yield
        finally:
            self.size -= 1
            if line.askers.pop(me, None) is not None:
                line.promote(self.askers)
            elif not me.done():
                me.cancel()  # left before its turn: promote() will skip it
            if not line and self._lines.get(model) is line:
                del self._lines[model]

    def _displace_for(self, flow: str, priority: int) -> bool:
        """The queue is full: refuse the last waiter (of the worst priority) of the flow with the
        most waiters instead of a newcomer of `flow`, if that flow has two or more waiters more
        and that waiter's priority is not better than the newcomer's."""
        if not self._waiting:
            return False
        biggest, count = self._waiting.most_common(1)[0]
        if count < self._waiting[flow] + 2:
            return False
        # A better priority than the newcomer's keeps its place.
        victim = self._last_waiter(priority, biggest)
        if victim is None:
            return False
        victim.set_exception(QueueDisplaced())
        return True

    def _displace_worse_than(self, priority: int) -> bool:
        """The queue is full and no flow is owed a place: refuse the last waiter of the worst
        priority, if that is worse than the newcomer's. Priorities are strict in the line; a
        full line of batch requests must not turn away an interactive one that would be next."""
        victim = self._last_waiter(priority + 1)
        if victim is None:
            return False
        victim.set_exception(QueueDisplaced("a request of better priority"))
        return True

    def _last_waiter(self, min_priority: int, flow: str | None = None) -> asyncio.Future[None] | None:
        """The waiter of the worst priority, at least `min_priority`, that came last, of `flow`
        (None: of any flow), over every model's line: the one a full queue gives up first."""
        victim: tuple[int, int, asyncio.Future[None]] | None = None
        for line in self._lines.values():
            for band_priority, band in line.bands.items():
                if band_priority < min_priority or (victim is not None and band_priority < victim[0]):
                    continue
                heaps = band.flows.values() if flow is None else (band.flows.get(flow, ()),)
                for heap in heaps:
                    for _, ticket, _, fut in heap:
                        if not fut.done() and (victim is None or (band_priority, ticket) > victim[:2]):
                            victim = (band_priority, ticket, fut)
        return None if victim is None else victim[2]
