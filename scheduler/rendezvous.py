"""A session's rendezvous (highest-random-weight) worker: of a set of workers, the one whose
score for (session key, worker URL) is highest.

Shared by the scheduler's session policies (a session it has no worker for starts on this one)
and the gateway's fallback (router/fallback.py: every session, while the scheduler is away), so
both place a session on the same worker without sharing any state, and a scheduler restarted
with an empty session table puts a session back where it was. The score is a fixed integer mix
of the key and a digest of the URL, not Python's salted hash(): the same in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from functools import lru_cache
from typing import Protocol, TypeVar

_MASK64 = (1 << 64) - 1


@lru_cache(maxsize=4096)
def url_seed(url: str) -> int:
    """A worker's 64-bit rendezvous value: the blake2b digest of its URL less any trailing '/'
    (the form both the scheduler's registry and the gateway's --workers keep), so either side
    gets the same value for one worker. Cached: the scheduler asks once per new session and
    candidate, and a fleet has few URLs."""
    digest = hashlib.blake2b(url.rstrip("/").encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_score(session: int, seed: int) -> int:
    """A session's score on a worker: splitmix64's finalizer of key XOR seed. Both steps are
    bijections of 64-bit integers, so workers with different seeds never tie, and a few integer
    operations per worker cost far less than a digest each."""
    x = (session ^ seed) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _HasUrl(Protocol):
    url: str


W = TypeVar("W", bound=_HasUrl)


def rendezvous_pick(session: int, workers: Iterable[W]) -> W | None:
    """The worker of highest score for the session (None: no workers)."""
    best = None
    best_score = -1
    for w in workers:
        score = rendezvous_score(session, url_seed(w.url))
        if score > best_score:
            best, best_score = w, score
    return best
