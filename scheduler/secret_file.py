"""A secret file re-read while the service runs: the gateway's API keys (router/key_reload.py)
and the scheduler's admin token (scheduler/admin_auth.py).

The file's stat is looked at every reload period, off the event loop, and the file is re-read
at once on SIGHUP. The stat follows symlinks (scheduler/file_watch.py), so a Kubernetes Secret
volume's `..data` swap is seen. Only a changed stat (or SIGHUP) reads the file; a file that
changed while it was read is left unseen and read again at the next poll. What a read found goes
to the subclass's `apply`, which decides what a good and a bad read mean (both keep what is in
force on a bad one).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from dataclasses import dataclass
from typing import Generic, TypeVar

from scheduler.file_watch import SignalTasks, poll_forever, stat_signature

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FileLook(Generic[T]):
    """What one look at the file found."""

    signature: tuple  # the stat's identity, or the error that stopped the stat
    read: bool = False  # False: not read (the stat had not changed), or `error`
    value: T | None = None  # what the read gave
    error: Exception | None = None
    settled: bool = True  # False: the file changed while it was read


class WatchedSecretFile(abc.ABC, Generic[T]):
    """Polls and re-reads `path`; subclasses say how to read it and what a read changes."""

    kind = "file"  # how log lines name it ("api-key-file")
    read_error: type[Exception] = Exception  # what `read_value` raises for a file it refuses

    def __init__(self, path: str, log: logging.Logger) -> None:
        self.path = path
        self.log = log
        self._seen: tuple | None = None  # the stat last handled (None: read at the next look)
        self._lock = asyncio.Lock()  # a SIGHUP and a poll do not apply two reads crosswise
        self._sighup_tasks = SignalTasks()

    @abc.abstractmethod
    def read_value(self) -> T:
        """Read the file (in a thread); raises `read_error` for one that holds no good value."""

    @abc.abstractmethod
    def unreadable(self, exc: OSError) -> Exception:
        """The error to report for a file whose stat failed."""

    @abc.abstractmethod
    def apply(self, look: FileLook[T], why: str, force: bool) -> None:
        """Act on a settled read, or a failed one (`look.error`), under the lock."""

    def look(self, force: bool) -> FileLook[T]:
        """Blocking (run it in a thread once the loop runs): the stat, and the read when the
        stat changed since the last one handled (or `force`)."""
        try:
            before = stat_signature(self.path)
        except OSError as exc:
            return FileLook(("error", exc.errno), error=self.unreadable(exc))
        if before == self._seen and not force:
            return FileLook(before)
        try:
            value = self.read_value()
        except self.read_error as exc:
            return FileLook(before, error=exc)
        try:
            after: tuple | None = stat_signature(self.path)
        except OSError:
            after = None
        return FileLook(before, True, value, settled=after == before)

    def handled(self, look: FileLook[T]) -> None:
        """The look's file is the one in force: the next poll reads it only once it changes."""
        if look.settled:
            self._seen = look.signature

    async def poll(self, period_s: float) -> None:
        """Until cancelled: a look every `period_s`."""
        await poll_forever(period_s, lambda: self.check(force=False, why="file changed"), self.log,
                           self.kind)

    def on_sighup(self) -> None:
        self._sighup_tasks.spawn(self.check(force=True, why="SIGHUP"))

    async def check(self, force: bool, why: str) -> None:
        async with self._lock:
            look = await asyncio.to_thread(self.look, force)
            if look.signature == self._seen and not force:
                return
            if look.read and not look.settled:
                # Being written: left as not seen, so the next poll reads it again.
                self.log.log(logging.INFO if force else logging.DEBUG,
                             "%s %s changed while it was read (%s): read again at the next poll",
                             self.kind, self.path, why)
                return
            self._seen = look.signature
            self.apply(look, why, force)
