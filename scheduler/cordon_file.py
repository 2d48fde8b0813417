"""The cordons on disk (--cordon-file): read back at start, rewritten whole after every change.

Why: cordons (scheduler/cordons.py) are an operator's word that a worker must get no traffic (a
suspected bad GPU). Kept in memory only, a scheduler that restarts (a crash, an OOM kill, node
maintenance) forgot them and sent traffic to those workers again, without a word.

The file is JSON, {"version": 1, "cordons": {"<worker id>": {"since": "<UTC ISO 8601>",
"reason": "..." | null}}}: `since` is the wall-clock time of the cordon, so GET /v1/workers shows
the first cordon's time after a restart too.

Reading fails closed: a file that cannot be read or parsed stops start-up (CordonFileError),
since starting with no cordons would put the workers it holds back in rotation. A missing file
is no cordon yet (a first start), and so is an empty one (created by hand, or left by a
filesystem that lost the data of a write it never synced).

Writing never loses a cordon in memory: a write that fails is logged (ERROR) and counted, and
the caller is told (the API answer's `persisted`), but the cordon holds. Each write goes to a
temp file in the same directory, is synced, then renamed over the file, so a reader, or a
scheduler killed mid-write, sees the old set or the new one, never half of one. Writes run in a
thread (a slow disk must not stall decisions), one at a time, and each writes the latest set:
an older set can never land after a newer one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from scheduler.cordons import Cordon, clean_reason, iso_utc

log = logging.getLogger(__name__)

VERSION = 1
# How long a stopping scheduler waits for a write under way (a hung network disk must not keep
# it from exiting; the rename is atomic, so a write cut short leaves the old file).
CLOSE_TIMEOUT_S = 5.0


class CordonFileError(Exception):
    """The cordon file cannot be used: start-up stops (fail closed)."""


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


def encode(cordons: Mapping[str, Cordon]) -> bytes:
    """The file's bytes for this set (in the order the cordons were made)."""
    body = {"version": VERSION,
            "cordons": {wid: {"since": iso_utc(c.since, "microseconds"), "reason": c.reason}
                        for wid, c in cordons.items()}}
    return (json.dumps(body, indent=2) + "\n").encode()


def _since(value: object) -> float:
    if not isinstance(value, str):
        raise ValueError("since must be a UTC time, e.g. 2024-05-01T12:00:00Z")
    when = datetime.datetime.fromisoformat(value)  # ValueError names the text
    if when.tzinfo is None:  # a naive time would be read in the machine's zone
        raise ValueError(f"since {value!r} has no time zone (end it with Z)")
    ts = when.timestamp()
    if not math.isfinite(ts):
        raise ValueError(f"since {value!r} is out of range")
    return ts


def decode(data: bytes) -> dict[str, Cordon]:
    """The cordons in the file's bytes; ValueError says what is wrong. Empty: none."""
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("not JSON (nested too deep)") from None
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    version = body.get("version")
    if version != VERSION:
        # A newer scheduler's format (a rollback) is refused, not half read.
        raise ValueError(f"version {version!r}: this scheduler reads version {VERSION}")
    entries = body.get("cordons")
    if not isinstance(entries, dict):
        raise ValueError('"cordons" must be an object of worker ids')
    out: dict[str, Cordon] = {}
    for wid, entry in entries.items():
        if not wid or not isinstance(entry, dict):
            raise ValueError(f"cordon {wid!r}: must be a non-empty worker id with an object")
        try:
            since = _since(entry.get("since"))
        except (ValueError, OverflowError, OSError) as exc:
            raise ValueError(f"cordon {wid!r}: {exc}") from None
        reason = entry.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"cordon {wid!r}: reason must be a string or null")
        # Bounded and escaped as the API's: the file may have been edited by hand.
        out[wid] = Cordon(since, clean_reason(reason))
    return out


def write_atomic(path: Path, data: bytes) -> None:
    """Replace the file with `data`: a temp file beside it, synced, renamed over it. On any
    failure the old file is left as it was (and the temp file removed); raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # The rename itself made durable (a power loss could otherwise undo it). Some filesystems
    # cannot sync a directory; the file is in place for a restarted process all the same.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class CordonFile:
    """The cordon file of one scheduler: load() once at start, save() after each change."""

    def __init__(self, path: Path, write_failures: _Counter) -> None:
        self.path = path
        self._write_failures = write_failures
        self._seq = 0  # sets handed to save(), numbered
        self._pending: tuple[int, bytes] | None = None  # the latest set not yet being written
        self._waiters: list[tuple[int, asyncio.Future[bool]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._failing = False

    def load(self) -> dict[str, Cordon]:
        """The cordons in the file, logged with their count. Raises CordonFileError when the
        file cannot be used (its directory missing, unreadable, corrupt, another version)."""
        path = self.path
        if not path.parent.is_dir():
            raise CordonFileError(f"cordon file {path}: its directory {path.parent} does not exist "
                                  "(create it, or fix --cordon-file)")
        self._remove_stale_temp_files()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            log.info("cordon file %s does not exist yet: no cordon to restore (it is written at the "
                     "first cordon)", path)
            data = None
        except OSError as exc:
            raise CordonFileError(f"cordon file {path} cannot be read ({exc.strerror or exc}); "
                                  "fix it or remove it: starting without its cordons would put the "
                                  "workers it holds back in rotation") from None
        cordons: dict[str, Cordon] = {}
        if data is not None:
            try:
                cordons = decode(data)
            except ValueError as exc:
                raise CordonFileError(f"cordon file {path} is not a cordon file: {exc}; fix it or "
                                      "remove it: starting without its cordons would put the "
                                      "workers it holds back in rotation") from None
            shown = ", ".join(list(cordons)[:20]) + (", ..." if len(cordons) > 20 else "")
            log.info("restored %d cordon(s) from %s%s", len(cordons), path,
                     f": {shown}" if cordons else (" (empty file)" if not data.strip() else ""))
        if not os.access(path.parent, os.W_OK):
            log.warning("cordon file %s: its directory is not writable: cordons made from now on "
                        "hold in memory only and are lost at a restart", path)
        return cordons

    def _remove_stale_temp_files(self) -> None:
        """Temp files of writes cut short (a kill between creating and renaming one)."""
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()

    async def save(self, cordons: Mapping[str, Cordon]) -> bool:
        """Write this set (copied now: later changes write their own); True once it, or a newer
        set, is in the file, False when that write failed. Cancelling the caller (a client that
        left) does not cancel the write."""
        self._seq += 1
        seq = self._seq
        self._pending = (seq, encode(cordons))
        written = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, written))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_pending(), name="cordon-file")
        return await asyncio.shield(written)

    async def _write_pending(self) -> None:
        """One write at a time, each of the latest set: the sets handed in while one is under
        way are written once, after it, as the newest of them."""
        try:
            while self._pending is not None:
                seq, data = self._pending
                self._pending = None
                ok = await self._write(data)
                done = [f for s, f in self._waiters if s <= seq]
                self._waiters = [(s, f) for s, f in self._waiters if s > seq]
                for f in done:
                    if not f.done():
                        f.set_result(ok)
        finally:
            self._writer = None

    async def _write(self, data: bytes) -> bool:
        try:
            await asyncio.to_thread(write_atomic, self.path, data)
        except Exception as exc:  # OSError above all (disk full, read-only); never fatal here
            self._write_failures.inc()
            self._failing = True
            log.error("cordon file %s could not be written (%s): the change holds in memory, but a "
                      "restarted scheduler would not have it; the next cordon or uncordon call "
                      "writes every cordon again", self.path,
                      exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc),
                      exc_info=not isinstance(exc, OSError))
            return False
        if self._failing:
            self._failing = False
            log.info("cordon file %s written again: it holds every cordon in force", self.path)
        return True

    async def close(self) -> None:
        """Wait for the write under way and the one pending (a scheduler stopping right after a
        change keeps it), at most CLOSE_TIMEOUT_S."""
        writer = self._writer
        if writer is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(writer), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.error("cordon file %s: a write still under way after %.0f s at shutdown; the file "
                      "holds the set before it", self.path, CLOSE_TIMEOUT_S)
