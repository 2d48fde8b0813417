"""The scheduler's admin token (--admin-token, or --admin-token-file), for operators' calls that
change routing: cordon and uncordon (scheduler/cordons.py).

Why fail closed: those calls take workers out of rotation, so a scheduler with no admin token
refuses them (403) rather than let whoever reaches it drain the pool; one with a token wants
`Authorization: Bearer <token>` (else 401). The gateway token is not accepted here: a gateway
has no business cordoning workers, and a leaked gateway token must not give that power.

Why a file: a token given inline is read once, so rotating it (a leaked token, a schedule)
needed a restart. --admin-token-file is read at start and re-read while the scheduler runs, as
the gateway re-reads its API-key file (router/key_reload.py): its stat is looked at every
--admin-token-reload-s, following symlinks (a Kubernetes Secret volume's `..data` swap is seen;
scheduler/file_watch.py), and it is re-read at once on SIGHUP. The new token takes effect for
the calls that arrive from then on. Fail safe: a file that cannot be read, is empty or holds no
token (a control character in it) keeps the token in force and logs one ERROR, until it changes
again; never a scheduler whose admin calls nobody can make, nor one left with no token at all.
At start a missing or empty file is no token yet (the calls are refused, 403, until a token
appears: a Secret's optional key that is not set), and one that holds something else stops
start-up. The token is never logged.

Metrics (registered only with a file: absent otherwise, as the gateway's key-file ones):
scheduler_admin_token_reloads_total{result} counts the re-reads, and
scheduler_admin_token_file_last_read_ok is 0 while the last re-read failed, which a rate of
failures cannot tell (one is counted per change of the file); the alert
LLMSchedulerAdminTokenFileUnreadable reads it. A file missing or empty at start is no token yet,
not a failure.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.file_watch import SignalTasks, poll_forever, stat_signature
from scheduler.gateway_auth import Handler, TokenRef, require_token
from scheduler.settings_loader import clean_secret

log = logging.getLogger("scheduler.admin")

RESULTS = ("reloaded", "unchanged", "failed")


def _error(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                 "code": code}}, separators=(",", ":")).encode()


_DISABLED = _error("admin calls are off: the scheduler has no admin token (--admin-token, "
                   "SCHEDULER_ADMIN_TOKEN, or --admin-token-file)", "admin_disabled")
_REFUSED = _error("invalid or missing admin token (the scheduler's --admin-token, sent as "
                  "Authorization: Bearer)", "invalid_admin_token")


def _refused() -> web.Response:
    return web.Response(status=401, body=_REFUSED, content_type="application/json",
                        headers={"WWW-Authenticate": 'Bearer realm="scheduler-admin"'})


def require_admin(handler: Handler, token: TokenRef) -> Handler:
    """`handler` behind the admin token in force at each call: 403 to every call while there is
    none, 401 to a call without it (before its body is read)."""
    guarded = require_token(handler, token, _refused)

    async def admin(request: web.Request) -> web.StreamResponse:
        if token.expected is None:
            return web.Response(status=403, body=_DISABLED, content_type="application/json")
        return await guarded(request)

    admin.__name__ = getattr(handler, "__name__", "admin")
    return admin


# ---- --admin-token-file --------------------------------------------------------------------


class TokenFileError(Exception):
    """The file cannot be read, or holds something that is no token."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def read_token_file(path: str) -> str | None:
    """The token the file holds, trimmed as --admin-token is (a Secret made from a file keeps
    its newline); None: the file is empty."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TokenFileError(f"cannot read --admin-token-file {path}: {exc.strerror or exc}",
                             missing=exc.errno == errno.ENOENT) from None
    try:
        return clean_secret(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        reason = "it is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise TokenFileError(f"--admin-token-file {path} holds no token: {reason}") from None


@dataclass(frozen=True, slots=True)
class _Look:
    """What one look at the file found."""

    signature: tuple  # the stat's identity, or the error that stopped the stat
    read: bool = False  # False: not read (the stat had not changed), or `error`
    token: str | None = None  # what it holds (None: empty)
    error: TokenFileError | None = None
    settled: bool = True  # False: the file changed while it was read


def _look(path: str, seen: tuple | None, force: bool) -> _Look:
    """Runs in a thread: the stat, and the read when the stat changed (or `force`)."""
    try:
        before = stat_signature(path)
    except OSError as exc:
        return _Look(("error", exc.errno), error=TokenFileError(
            f"cannot read --admin-token-file {path}: {exc.strerror or exc}",
            missing=exc.errno == errno.ENOENT))
    if before == seen and not force:
        return _Look(before)
    try:
        token = read_token_file(path)
    except TokenFileError as exc:
        return _Look(before, error=exc)
    try:
        after: tuple | None = stat_signature(path)
    except OSError:
        after = None
    return _Look(before, True, token, settled=after == before)


class AdminTokenFile:
    """Keeps `token` on the file's latest good token."""

    def __init__(self, path: str, token: TokenRef) -> None:
        self.path = path
        self.token = token
        self._seen: tuple | None = None  # the stat last handled (None: read at the next look)
        self._lock = asyncio.Lock()  # a SIGHUP and a poll do not apply two reads crosswise
        self._sighup_tasks = SignalTasks()
        self.counts = dict.fromkeys(RESULTS, 0)  # re-reads by result (start-up's read is not one)
        self.file_ok = True  # False while the last re-read failed

    def load(self) -> None:
        """At start, before the port opens. Missing or empty: no token yet (a WARNING); anything
        else that is no token stops start-up."""
        look = _look(self.path, None, True)
        if look.error is not None and not look.error.missing:
            raise SystemExit(f"error: {look.error}")
        if look.settled:
            self._seen = look.signature  # else the first poll reads it again
        self.token.set(look.token)
        if look.token is None:
            log.warning("--admin-token-file %s %s: the admin calls (cordon, uncordon) are refused "
                        "until it holds a token", self.path,
                        "is missing" if look.error is not None else "is empty")
        else:
            log.info("admin token read from %s", self.path)

    async def poll(self, period_s: float) -> None:
        """Until cancelled: a look every `period_s`."""
        await poll_forever(period_s, lambda: self.check(force=False, why="file changed"), log,
                           "admin-token-file")

    def on_sighup(self) -> None:
        self._sighup_tasks.spawn(self.check(force=True, why="SIGHUP"))

    async def check(self, force: bool, why: str) -> None:
        async with self._lock:
            look = await asyncio.to_thread(_look, self.path, self._seen, force)
            if look.signature == self._seen and not force:
                return
            if look.read and not look.settled:
                # Being written: left as not seen, so the next poll reads it again.
                log.log(logging.INFO if force else logging.DEBUG,
                        "admin-token-file %s changed while it was read (%s): read again at the "
                        "next poll", self.path, why)
                return
            self._seen = look.signature
            had = self.token.expected is not None
            if look.token is None:
                self.file_ok = False
                self.counts["failed"] += 1
                problem = look.error or f"--admin-token-file {self.path} is empty"
                log.error("admin-token-file re-read (%s) failed, %s: %s", why,
                          "the admin token in force is kept" if had
                          else "the admin calls stay refused (no token)", problem)
                return
            self.file_ok = True
            before = self.token.expected
            self.token.set(look.token)
            if self.token.expected == before:
                self.counts["unchanged"] += 1
                log.log(logging.INFO if force else logging.DEBUG,
                        "admin-token-file re-read (%s): unchanged", why)
                return
            self.counts["reloaded"] += 1
            log.info("admin-token-file reloaded (%s): a new admin token from %s is in force",
                     why, self.path)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Read at each scrape of /metrics (registered by the scheduler only with a file)."""
        reloads = CounterMetricFamily(
            "scheduler_admin_token_reloads", "Re-reads of --admin-token-file (its stat changed, "
            "or SIGHUP) by result: reloaded (a new admin token in force), unchanged, failed "
            "(unreadable, empty or no token: the token in force kept)", labels=["result"])
        for result in RESULTS:
            reloads.add_metric([result], self.counts[result])
        yield reloads
        ok = GaugeMetricFamily(
            "scheduler_admin_token_file_last_read_ok",
            "1 if the last read of --admin-token-file gave a token, 0 if it failed (the admin "
            "token of the last good read stays in force, or none: a rotation since has not "
            "taken effect); a file missing or empty at start is no token yet, not a failure")
        ok.add_metric([], 1.0 if self.file_ok else 0.0)
        yield ok
