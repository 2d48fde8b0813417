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
scheduler/secret_file.py), and it is re-read at once on SIGHUP. The new token takes effect for
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

import errno
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.gateway_auth import Handler, TokenRef, require_token
from scheduler.secret_file import FileLook, WatchedSecretFile
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


class AdminTokenFile(WatchedSecretFile[str | None]):
    """Keeps `token` on the file's latest good token."""

    kind = "admin-token-file"
    read_error = TokenFileError

    def __init__(self, path: str, token: TokenRef) -> None:
        super().__init__(path, log)
        self.token = token
        self.counts = dict.fromkeys(RESULTS, 0)  # re-reads by result (start-up's read is not one)
        self.file_ok = True  # False while the last re-read failed

    def read_value(self) -> str | None:
        return read_token_file(self.path)

    def unreadable(self, exc: OSError) -> Exception:
        return TokenFileError(f"cannot read --admin-token-file {self.path}: {exc.strerror or exc}",
                              missing=exc.errno == errno.ENOENT)

    def load(self) -> None:
        """At start, before the port opens. Missing or empty: no token yet (a WARNING); anything
        else that is no token stops start-up."""
        look = self.look(force=True)
        error = look.error
        if isinstance(error, TokenFileError) and not error.missing:
            raise SystemExit(f"error: {error}")
        self.handled(look)  # else the first poll reads it again
        self.token.set(look.value)
        if look.value is None:
            log.warning("--admin-token-file %s %s: the admin calls (cordon, uncordon) are refused "
                        "until it holds a token", self.path,
                        "is missing" if error is not None else "is empty")
        else:
            log.info("admin token read from %s", self.path)

    def apply(self, look: FileLook[str | None], why: str, force: bool) -> None:
        had = self.token.expected is not None
        if look.value is None:
            self.file_ok = False
            self.counts["failed"] += 1
            problem = look.error or f"--admin-token-file {self.path} is empty"
            log.error("admin-token-file re-read (%s) failed, %s: %s", why,
                      "the admin token in force is kept" if had
                      else "the admin calls stay refused (no token)", problem)
            return
        self.file_ok = True
        before = self.token.expected
        self.token.set(look.value)
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
