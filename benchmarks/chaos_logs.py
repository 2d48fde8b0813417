"""What the gateways' own logs say of a chaos soak: each request's retries (access lines), each
retry's worker and reason ("worker X failed before the first byte (...); retrying"), and the
switches to and from round robin while the scheduler was away. Times are put on the run's
clock from the lines' local-time stamps, so a retry can be laid beside the fault that caused
it, by worker and time, even when its request ended well on another worker.

Each access line is kept too (`AccessLine`): which gateway answered a request, with what
status, and how long it looked for a worker (`queue_ms`, held in its queue and the scheduler's
held calls included), so that the requests held at an instant are known by id, and a request
answered by two gateways (or twice by one) is seen. A SIGKILLed gateway loses the lines it had
not flushed yet (router/access_log.py writes them every 0.1 s) and never writes those of the
requests it held: its requests are known from the client's side only."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_ACCESS = re.compile(r"router\.access: id=(\S+) .* retries=(\d+)")
_ACCESS_FIELDS = re.compile(r"router\.access: id=(\S+) .* worker=(\S+) status=(\d+) .*queue_ms=([\d.]+) "
                            r".*e2e_ms=([\d.]+)")
_RETRY = re.compile(r"id=(\S+) worker (\S+) failed before the first byte \((\w+)")
_SWITCH = re.compile(r"fallback mode (ON|OFF)")


@dataclass(frozen=True)
class Retry:
    at_s: float  # on the run's clock
    request_id: str
    worker: str
    reason: str  # connection, connect, worker_down, http_503, ...


@dataclass(frozen=True)
class AccessLine:
    end_s: float  # on the run's clock: when the gateway logged it (the request's end)
    request_id: str
    gateway: int  # its index in the cluster's list (gateway.log: 0, gateway1.log: 1, ...)
    status: int
    worker: str  # "-": none got it
    queue_ms: float
    e2e_ms: float

    @property
    def start_s(self) -> float:
        return self.end_s - self.e2e_ms / 1000

    def held_at(self, t: float, min_ms: float) -> bool:
        """Whether it was looking for a worker at `t`, for `min_ms` or more in all (its gateway's
        queue and the scheduler's held calls; a schedule call answered at once takes ~1 ms)."""
        return self.queue_ms >= min_ms and self.start_s <= t <= self.start_s + self.queue_ms / 1000


def gateway_index(stem: str) -> int:
    """gateway -> 0, gateway1 -> 1 (benchmarks/cluster.py's names)."""
    tail = stem[len("gateway"):]
    return int(tail) if tail.isdigit() else 0


@dataclass(frozen=True)
class Switch:
    at_s: float
    gateway: str  # its log's name
    on: bool  # True: round robin from here on


class GatewayLogs:
    """Every gateway*.log of a run, read once after the gateways stopped."""

    def __init__(self, log_dir: Path, wall_zero: float) -> None:
        self.retries: dict[str, int] = {}  # request id -> retries its access line counts
        self.retry_lines: list[Retry] = []
        self.switches: list[Switch] = []
        self.access: list[AccessLine] = []
        for path in sorted(log_dir.glob("gateway*.log")):
            for line in path.read_text(errors="replace").splitlines():
                self._read(line, path.stem, wall_zero)

    def _read(self, line: str, gateway: str, wall_zero: float) -> None:
        access = _ACCESS.search(line)
        if access is not None:
            self.retries[access.group(1)] = max(self.retries.get(access.group(1), 0), int(access.group(2)))
        retry, switch = _RETRY.search(line), _SWITCH.search(line)
        if (access is None and retry is None and switch is None) or (stamp := _STAMP.match(line)) is None:
            return
        # The services log local time (logging's default): so is naive datetime's timestamp().
        at_s = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall_zero
        if access is not None:
            if (f := _ACCESS_FIELDS.search(line)) is not None:
                self.access.append(AccessLine(at_s, f.group(1), gateway_index(gateway), int(f.group(3)),
                                              f.group(2), float(f.group(4)), float(f.group(5))))
        elif retry is not None:
            self.retry_lines.append(Retry(at_s, retry.group(1), retry.group(2), retry.group(3)))
        elif switch is not None:
            self.switches.append(Switch(at_s, gateway, switch.group(1) == "ON"))

    def retried_away(self, worker: str, start_s: float, end_s: float) -> dict[str, int]:
        """Retries off `worker` logged within [start_s, end_s], by reason."""
        return dict(Counter(r.reason for r in self.retry_lines
                            if r.worker == worker and start_s <= r.at_s <= end_s))

    def switched(self, start_s: float, end_s: float) -> list[Switch]:
        return [s for s in self.switches if start_s <= s.at_s <= end_s]

    def held_at(self, t: float, min_ms: float = 50.0) -> list[AccessLine]:
        """The requests a gateway was looking for a worker for at `t` (held), by their lines."""
        return [a for a in self.access if a.held_at(t, min_ms)]

    def answered_twice(self) -> dict[str, list[AccessLine]]:
        """Request ids with more than one 200 access line (any gateway): answered twice."""
        by_id: dict[str, list[AccessLine]] = {}
        for a in self.access:
            if a.status == 200:
                by_id.setdefault(a.request_id, []).append(a)
        return {i: lines for i, lines in by_id.items() if len(lines) > 1}


def log_lines_for(log_dir: Path, ids: list[str], per_id: int = 8) -> dict[str, list[str]]:
    """Each request id's lines in every process's log ("<file>: <line>")."""
    found: dict[str, list[str]] = {i: [] for i in ids}
    if not ids:
        return found
    pattern = re.compile("|".join(re.escape(i) + r"\b" for i in ids))
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if (m := pattern.search(line)) is not None and len(found[m.group(0)]) < per_id:
                found[m.group(0)].append(f"{path.name}: {line[:400]}")
    return found
