"""What the gateways' own logs say of a chaos soak: each request's retries (access lines), each
retry's worker and reason ("worker X failed before the first byte (...); retrying"), and the
switches to and from round robin while the scheduler was away. Times are put on the run's
clock from the lines' local-time stamps, so a retry can be laid beside the fault that caused
it, by worker and time, even when its request ended well on another worker."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_ACCESS = re.compile(r"router\.access: id=(\S+) .* retries=(\d+)")
_RETRY = re.compile(r"id=(\S+) worker (\S+) failed before the first byte \((\w+)")
_SWITCH = re.compile(r"fallback mode (ON|OFF)")


@dataclass(frozen=True)
class Retry:
    at_s: float  # on the run's clock
    request_id: str
    worker: str
    reason: str  # connection, connect, worker_down, http_503, ...


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
        for path in sorted(log_dir.glob("gateway*.log")):
            for line in path.read_text(errors="replace").splitlines():
                self._read(line, path.stem, wall_zero)

    def _read(self, line: str, gateway: str, wall_zero: float) -> None:
        if (m := _ACCESS.search(line)) is not None:
            self.retries[m.group(1)] = max(self.retries.get(m.group(1), 0), int(m.group(2)))
            return
        retry, switch = _RETRY.search(line), _SWITCH.search(line)
        if (retry is None and switch is None) or (stamp := _STAMP.match(line)) is None:
            return
        # The services log local time (logging's default): so is naive datetime's timestamp().
        at_s = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall_zero
        if retry is not None:
            self.retry_lines.append(Retry(at_s, retry.group(1), retry.group(2), retry.group(3)))
        elif switch is not None:
            self.switches.append(Switch(at_s, gateway, switch.group(1) == "ON"))

    def retried_away(self, worker: str, start_s: float, end_s: float) -> dict[str, int]:
        """Retries off `worker` logged within [start_s, end_s], by reason."""
        return dict(Counter(r.reason for r in self.retry_lines
                            if r.worker == worker and start_s <= r.at_s <= end_s))

    def switched(self, start_s: float, end_s: float) -> list[Switch]:
        return [s for s in self.switches if start_s <= s.at_s <= end_s]


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
