"""Re-reading --api-key-file while the gateway runs: a rotated key takes effect without a restart.

The file is polled every --api-key-reload-s and re-read at once on SIGHUP, following a
Kubernetes Secret volume's `..data` swap (scheduler/secret_file.py, shared with the scheduler's
admin token). Keys the same as those in force change nothing (a kubelet resync, a `touch`).

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

from prometheus_client import CollectorRegistry

from router.auth import KeyChecker, KeyFileError, read_key_file
from router.fast_metrics import FastCounter, FastGauge
from scheduler.secret_file import FileLook, WatchedSecretFile

log = logging.getLogger("router.keys")

RESULTS = ("reloaded", "unchanged", "failed")


def _digest(keys: list[bytes]) -> bytes:
    # What is kept to tell a changed key set: a digest, not a second copy of the keys.
    return hashlib.sha256(b"\n".join(keys)).digest()


class KeyFileWatcher(WatchedSecretFile[list[bytes]]):
    """Keeps `checker` on the inline keys plus the key file's latest good keys."""

    kind = "api-key-file"
    read_error = KeyFileError

    def __init__(self, path: str, inline: list[bytes], file_keys: list[bytes], checker: KeyChecker,
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(path, log)
        self.inline = list(inline)
        self.checker = checker
        self._digest = _digest(file_keys)  # the file's keys in force
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

    def read_value(self) -> list[bytes]:
        return read_key_file(self.path)

    def unreadable(self, exc: OSError) -> Exception:
        return KeyFileError(f"cannot read api-key-file {self.path}: {exc.strerror or exc}")

    async def start(self) -> None:
        """Takes the file as it is now as handled, when it still holds the keys start-up read
        (else the first poll reads it: it changed in between)."""
        look = await asyncio.to_thread(self.look, True)
        if look.value is not None and _digest(look.value) == self._digest:
            self.handled(look)

    def apply(self, look: FileLook[list[bytes]], why: str, force: bool) -> None:
        if look.value is None:
            self.file_ok = False
            self.reloads.labels("failed").inc()
            log.error("api-key-file re-read (%s) failed, the %d key(s) in force are kept: %s",
                      why, len(self.checker.keys), look.error)
            return
        self.file_ok = True
        digest = _digest(look.value)
        if digest == self._digest:
            self.reloads.labels("unchanged").inc()
            log.log(logging.INFO if force else logging.DEBUG,
                    "api-key-file re-read (%s): unchanged, %d key(s) in force", why,
                    len(self.checker.keys))
            return
        self.checker.replace(self.inline + look.value)
        self._digest = digest
        self.reloads.labels("reloaded").inc()
        log.info("api-key-file reloaded (%s): %d key(s) from %s, %d in force in all", why,
                 len(look.value), self.path, len(self.checker.keys))
