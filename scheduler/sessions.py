"""Session affinity's memory: which worker each session's requests last went to.

A session is what a gateway names by a stable 63-bit key (router/sessions.py: a digest of the
client's session header, never its value). Kept here, in the one service every gateway replica
asks, so that any replica places a session's requests the same way. The policies that honour
sessions (llm_aware, session) read a session's worker when they choose and record where the
request went when its lease is issued: a session follows its requests, so one moved off its
worker (saturated, cordoned, failed) stays on the new one.

Bounded twice: an LRU of `max_size` sessions (the least recently used goes first), and an idle
TTL (a session unused for `ttl_s` is new again when it comes back: its worker's cache has
likely moved on). Every operation on a request's path is O(1); a worker that leaves the pool
takes its sessions with it (forget_worker, a scan: rare, and off the decision path).
"""

from __future__ import annotations

from collections import OrderedDict

# A session idle this long is new again (the scheduler's --session-ttl-s): ten minutes, a chat's
# pause to read and type, well past the engines' prefix-cache life under load. And the most
# sessions kept (--max-sessions): about 16 MB of table (a record 0.4 us, a worker's removal
# 14 ms when it is full).
DEFAULT_SESSION_TTL_S = 600.0
DEFAULT_MAX_SESSIONS = 100_000

KEPT, MOVED, NEW = "kept", "moved", "new"
OUTCOMES = (KEPT, MOVED, NEW)
# Expired sessions dropped from the LRU's old end per record(): at least one more than a
# record adds, so a table past its TTL drains while traffic flows, and no request pays for a
# whole table that expired at once (collection time, expire(), takes the rest).
_EXPIRED_PER_RECORD = 2


class SessionTable:
    def __init__(self, ttl_s: float, max_size: int) -> None:
        self.ttl_s = ttl_s
        self.max_size = max_size
        # key -> (worker id, last use); oldest use first, so expiry and eviction take the front.
        self._map: OrderedDict[int, tuple[str, float]] = OrderedDict()
        # Issued requests of a session by outcome (scheduler_session_affinity_total).
        self.counts = dict.fromkeys(OUTCOMES, 0)

    def __len__(self) -> int:
        return len(self._map)

    def worker_of(self, key: int, now: float) -> str | None:
        """The worker the session's last request went to, unless it has been idle past the TTL."""
        entry = self._map.get(key)
        if entry is None or now - entry[1] > self.ttl_s:
            return None
        return entry[0]

    def record(self, key: int, worker_id: str, now: float) -> str:
        """A request of the session was issued to `worker_id`: the session is that worker's from
        now on. Returns whether it stayed (kept), changed worker (moved) or had none (new)."""
        m = self._map
        entry = m.get(key)
        if entry is None or now - entry[1] > self.ttl_s:
            outcome = NEW
        elif entry[0] == worker_id:
            outcome = KEPT
        else:
            outcome = MOVED
        m[key] = (worker_id, now)
        m.move_to_end(key)
        self.counts[outcome] += 1
        if len(m) > self.max_size:
            m.popitem(last=False)
        self._expire_front(now, _EXPIRED_PER_RECORD)
        return outcome

    def expire(self, now: float) -> int:
        """Drop every session idle past the TTL; how many went."""
        return self._expire_front(now, len(self._map))

    def _expire_front(self, now: float, limit: int) -> int:
        m = self._map
        dropped = 0
        before = now - self.ttl_s
        while dropped < limit and m:
            key = next(iter(m))
            if m[key][1] >= before:
                break
            del m[key]
            dropped += 1
        return dropped

    def forget_worker(self, worker_id: str) -> int:
        """The worker left the pool: its sessions are new wherever they go next (its cache went
        with it; an id that comes back is a restarted worker). How many were dropped."""
        gone = [key for key, (wid, _) in self._map.items() if wid == worker_id]
        for key in gone:
            del self._map[key]
        return len(gone)
