"""Workers an operator took out of rotation (POST /v1/workers/{id}/cordon), like `kubectl
cordon`: a cordoned worker gets no new placement, but it is still scraped and health-tracked,
its requests in flight finish, and requests pinned to it (a Responses API follow-up whose
stored state lives only there) still go there, since no other worker can serve them. A WebSocket
a gateway holds to it is not kept there: its answer under way finishes, and its next request is
placed afresh on another worker (router/ws_relay.py), so that the drain ends.

Kept by worker id, not by WorkerState: a worker that re-registers, or that Kubernetes lists
again after a blip, comes back as a new WorkerState under the same id and must stay cordoned.
So a cordon outlives its worker until it is lifted. In memory, and with --cordon-file in a file
too (scheduler/cordon_file.py), which a restarted scheduler reads back before it decides
anything; without one, a restarted scheduler forgets every cordon.

The decision reads it only where its candidates are rebuilt (scheduler/service.py), never per
request, so the path with no cordon costs nothing more.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

# An operator's note ("driver upgrade", a ticket): bounded, as it is logged and listed.
MAX_REASON_CHARS = 200


@dataclass(frozen=True, slots=True)
class Cordon:
    since: float  # wall clock (time.time()): shown to operators, compared with other clocks
    reason: str | None


def clean_reason(value: object) -> str | None:
    """The operator's reason as it may be logged: a string, bounded, with anything that could
    forge a log line (a newline) escaped."""
    if value is None:
        return None
    text = str(value)[:MAX_REASON_CHARS]
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")[:MAX_REASON_CHARS]
    return text or None


def iso_utc(ts: float, timespec: str = "seconds") -> str:
    """A wall-clock time as UTC ISO 8601 ending in Z: to the second for operators to read, to
    the microsecond in the cordon file (scheduler/cordon_file.py), which must give it back."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec=timespec).replace(
        "+00:00", "Z")


class Cordons:
    """Cordoned worker ids, each with when and why."""

    def __init__(self) -> None:
        self.by_id: dict[str, Cordon] = {}

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.by_id

    def restore(self, cordons: dict[str, Cordon]) -> None:
        """The cordons read back at start (scheduler/cordon_file.py), before any decision."""
        self.by_id.update(cordons)

    def get(self, worker_id: str) -> Cordon | None:
        return self.by_id.get(worker_id)

    def cordon(self, worker_id: str, reason: str | None, now: float) -> Cordon | None:
        """Cordon the id. The new cordon, or None when it was cordoned already (idempotent: a
        repeat keeps the first time and reason, so "since" says how long it has been out)."""
        if worker_id in self.by_id:
            return None
        cordon = self.by_id[worker_id] = Cordon(now, reason)
        return cordon

    def uncordon(self, worker_id: str) -> Cordon | None:
        """Lift the id's cordon. The cordon lifted, or None when there was none."""
        return self.by_id.pop(worker_id, None)

    def view(self, worker_id: str) -> dict:
        """The fields GET /v1/workers shows for a worker."""
        c = self.by_id.get(worker_id)
        if c is None:
            return {"cordoned": False, "cordoned_since": None, "cordon_reason": None}
        return {"cordoned": True, "cordoned_since": iso_utc(c.since), "cordon_reason": c.reason}

    def views(self) -> dict[str, dict]:
        """Every cordon, by id, those of workers that left the pool included (lift them with
        uncordon, or they wait for the id to come back)."""
        return {wid: {"since": iso_utc(c.since), "reason": c.reason} for wid, c in self.by_id.items()}
