"""Re-reading --api-key-file while the gateway runs: a rotated key takes effect without a restart.

The file is polled every --api-key-reload-s (a stat, off the event loop) and re-read at once on
SIGHUP. The stat follows symlinks, so a Kubernetes Secret volume's `..data` swap is seen
(scheduler/file_watch.py, shared with the TLS reload). When the stat changed the file is read,
and keys the same as those in force change nothing (a kubelet resync, a `touch`).

Fail safe: a file that cannot be read, or holds no key, keeps the keys in force and logs one
ERROR (until the file changes again): a file rewritten in place, a wrong mount or a Secret
emptied by mistake must neither open the gateway to everyone nor lock everyone out. A file that
changed while it was read is read again at the next poll. The new set is checked by requests
that arrive from then on; those accepted before (streams, WebSocket sessions) go on. Keys given
inline (--api-keys, ROUTER_API_KEYS) stay accepted beside the file's. Keys are never logged: a
reload says how many there are.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from router.auth import KeyChecker, KeyFileError, read_key_file
from router.fast_metrics import FastCounter, FastGauge
from scheduler.file_watch import SignalTasks, poll_forever, stat_signature

log = logging.getLogger("router.keys")

RESULTS = ("reloaded", "unchanged", "failed")


@dataclass(frozen=True, slots=True)
class _Look:
    """What one look at the file found."""

    signature: tuple  # the stat's identity, or the error that stopped the stat
    keys: list[bytes] | None = None  # None: not read (the stat had not changed), or `error`
    error: KeyFileError | None = None
    settled: bool = True  # False: the file changed while it was read


def _look(path: str, seen: tuple | None, force: bool) -> _Look:
    """Runs in a thread: the stat, and the read when the stat changed (or `force`)."""
    try:
        before = stat_signature(path)
    except OSError as exc:
        return _Look(("error", exc.errno),
                     error=KeyFileError(f"cannot read api-key-file {path}: {exc.strerror or exc}"))
    if before == seen and not force:
        return _Look(before)
    try:
        keys = read_key_file(path)
    except KeyFileError as exc:
        return _Look(before, error=exc)
    try:
        after: tuple | None = stat_signature(path)
    except OSError:
        after = None
    return _Look(before, keys, settled=after == before)


def _digest(keys: list[bytes]) -> bytes:
    # What is kept to tell a changed key set: a digest, not a second copy of the keys.
    return hashlib.sha256(b"\n".join(keys)).digest()


class KeyFileWatcher:
    """Keeps `checker` on the inline keys plus the key file's latest good keys."""

    def __init__(self, path: str, inline: list[bytes], file_keys: list[bytes], checker: KeyChecker,
                 registry: CollectorRegistry | None = None) -> None:
        self.path = path
        self.inline = list(inline)
        self.checker = checker
        self._digest = _digest(file_keys)  # the file's keys in force
        self._seen: tuple | None = None  # the stat last handled (None: read at the next look)
        self._lock = asyncio.Lock()  # a SIGHUP and a poll do not apply two reads crosswise
        self._sighup_tasks = SignalTasks()
        self.reloads = FastCounter(
            "router_api_key_reloads_total",
            "Re-reads of --api-key-file (its stat changed, or SIGHUP) by result: reloaded (a new "
            "key set in force), unchanged, failed (unreadable or no key: the keys in force kept)",
            ["result"], registry=registry)
        for result in RESULTS:  # at 0 from the start, for increase()
            self.reloads.labels(result)
        self.loaded = FastGauge(
            "router_api_keys_loaded",
            "API keys accepted now: the key file's last good read and those given inline",
            registry=registry)
        self.loaded.set_function(lambda: len(self.checker.keys))
        # A failed read is counted once (until the file changes again), so a rate cannot tell
        # that the file is still bad; this can (the alert LLMGatewayApiKeyFileUnreadable).
        self.file_ok = True
        self.last_ok = FastGauge(
            "router_api_key_file_last_read_ok",
            "1 if the last read of --api-key-file gave keys, 0 if it failed (the keys of the "
            "last good read stay in force: a rotation since has not taken effect)",
            registry=registry)
        self.last_ok.set_function(lambda: 1.0 if self.file_ok else 0.0)

    async def start(self) -> None:
        """Takes the file as it is now as handled, when it still holds the keys start-up read
        (else the first poll reads it: it changed in between)."""
        look = await asyncio.to_thread(_look, self.path, None, True)
        if look.keys is not None and look.settled and _digest(look.keys) == self._digest:
            self._seen = look.signature

    async def poll(self, period_s: float) -> None:
        """Until cancelled: a look every `period_s`."""
        await poll_forever(period_s, lambda: self.check(force=False, why="file changed"), log,
                           "api-key-file")

    def on_sighup(self) -> None:
        self._sighup_tasks.spawn(self.check(force=True, why="SIGHUP"))

    async def check(self, force: bool, why: str) -> None:
        async with self._lock:
            look = await asyncio.to_thread(_look, self.path, self._seen, force)
            if look.signature == self._seen and not force:
                return
            if look.keys is not None and not look.settled:
                # Being written: left as not seen, so the next poll reads it again.
                log.log(logging.INFO if force else logging.DEBUG,
                        "api-key-file %s changed while it was read (%s): read again at the next "
                        "poll", self.path, why)
                return
            self._seen = look.signature
            if look.keys is None:
                self.file_ok = False
                self.reloads.labels("failed").inc()
                log.error("api-key-file re-read (%s) failed, the %d key(s) in force are kept: %s",
                          why, len(self.checker.keys), look.error)
                return
            self.file_ok = True
            digest = _digest(look.keys)
            if digest == self._digest:
                self.reloads.labels("unchanged").inc()
                log.log(logging.INFO if force else logging.DEBUG,
                        "api-key-file re-read (%s): unchanged, %d key(s) in force", why,
                        len(self.checker.keys))
                return
            self.checker.replace(self.inline + look.keys)
            self._digest = digest
            self.reloads.labels("reloaded").inc()
            log.info("api-key-file reloaded (%s): %d key(s) from %s, %d in force in all", why,
                     len(look.keys), self.path, len(self.checker.keys))
