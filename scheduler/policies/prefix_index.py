"""Where prompt prefixes were sent recently: hash -> {worker_id: last use}.

The gateway sends cumulative fingerprints (hash i covers the prompt up to chunk i),
so holding hash i implies holding every shorter one; the deepest hash a worker
holds is its match length. Bounded twice: an LRU over fingerprints (oldest go first),
and at most `max_owners` workers per fingerprint (the most recent ones), so a hot
shared prefix (a system prompt sent everywhere) never makes a lookup walk every worker.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity: int = 200_000, max_owners: int = 4) -> None:
        self.capacity = capacity
        self.max_owners = max_owners
        self._map: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def match(self, hashes) -> dict[str, int]:
        """worker_id -> number of leading chunks it holds (longest match per worker)."""
        found: dict[str, int] = {}
        get = self._map.get
        for i in range(len(hashes) - 1, -1, -1):
            owners = get(hashes[i])
            if owners:
                for wid in owners:
                    if wid not in found:
                        found[wid] = i + 1
        return found

    def record(self, hashes, worker_id: str, now: float) -> None:
        m = self._map
        for h in hashes:
            owners = m.get(h)
            if owners is None:
                m[h] = {worker_id: now}
            else:
                owners[worker_id] = now
                if len(owners) > self.max_owners:
                    del owners[min(owners, key=owners.__getitem__)]
                m.move_to_end(h)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        for h in [h for h, owners in self._map.items() if owners.pop(worker_id, None) and not owners]:
            del self._map[h]
