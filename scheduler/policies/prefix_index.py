"""Where prompt prefixes were sent recently: hash -> {worker_id: last use}.

The gateway sends cumulative fingerprints (hash i covers the prompt up to chunk i),
so holding hash i implies holding every shorter one; the deepest hash a worker
holds is its match length. Bounded twice: an LRU over fingerprints (oldest go first),
and at most `max_owners` workers per fingerprint (the most recent ones), so a hot
shared prefix (a system prompt sent everywhere) never makes a lookup walk every worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

# The most fingerprints of one prompt the index reads or records. The gateway sends at most 64
# (router/tokens.py), but the schedule API takes a list of any length: 300,000 made one decision
# walk them all (0.12 s) and its lease record them all, which evicted every other prompt's
# entries from the index. Fingerprints are cumulative, so the first ones are a prefix of their own.
MAX_KEYS = 1024
# (model, adapter) scopes whose salt is kept (PrefixIndex.keys).
MAX_SCOPES = 1024


class PrefixIndex:
    def __init__(self, capacity: int = 200_000, max_owners: int = 4) -> None:
        self.capacity = capacity
        self.max_owners = max_owners
        self._map: OrderedDict[int, dict[str, float]] = OrderedDict()
        # Per scope (model, LoRA adapter): what its fingerprints are mixed with. An engine's
        # prefix cache is per model and per adapter (vLLM hashes the adapter into each block,
        # SGLang keys its radix tree by it), while the gateway's fingerprints are of the text
        # alone: a prompt cached under one adapter matched the same text under another, which
        # won it the affinity bonus and a prefill backlog charged as if cached. The first scope
        # gets 0, so a single-model pool pays nothing for this.
        self._salts: dict[Hashable, int] = {}

    def keys(self, hashes: Sequence[int], scope: Hashable) -> Sequence[int]:
        """The index's keys for a prompt's fingerprints in `scope`: at most MAX_KEYS of them."""
        if len(hashes) > MAX_KEYS:
            hashes = hashes[:MAX_KEYS]
        salt = self._salts.get(scope)
        if salt is None:
            salt = (hash(scope) or 1) if self._salts else 0
            # Kept for the scopes seen first (the first one's salt is 0: a one-model pool's keys
            # are its fingerprints); past MAX_SCOPES (a client naming an adapter per request)
            # the salt is recomputed, the same each time, instead of kept for good.
            if len(self._salts) < MAX_SCOPES:
                self._salts[scope] = salt
        if salt:
            return [h ^ salt for h in hashes]
        return hashes

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
