"""Per-worker health: a small circuit breaker driven by scrapes, probes and gateway reports.

States: unknown (never reached) -> up; up -> down after `fail_streak` consecutive
connection-level failures, at once on a gateway's report of a connection-level failure or of a
draining worker's 503 "shutting down" answer, after
`report_streak` gateway reports in a row of requests the worker failed otherwise (an HTTP 5xx,
a timeout; an ok request in between resets it), or when nothing succeeded for `dead_after_s`
(a silent host); down -> half_open after
`recover_streak` consecutive successful scrapes; half_open admits a single trial
lease: released ok -> up, failed -> down. Timeouts alone never evict quickly:
a busy worker answers slowly, it is not dead (its data ages and the policy treats
it as saturated instead).

A down worker's `down_cause` is the cause of its latest failure (scheduler/protocol.py's
REFUSED, UNRESPONSIVE, ...): every failure carries one, and one seen while down replaces it
(but an error answer, FAILING, replaces none).
A gateway acts on it: the answers it waits for on a worker that went down REFUSED or DRAINING
are left to finish (a draining worker closed its port, or answers new requests 503 "shutting
down" until it does; a dead one's connections failed already), those on one that went silent
are given up for other workers (it may be hung).
"""

from __future__ import annotations

from scheduler.protocol import FAILING, UNRESPONSIVE

UNKNOWN, UP, DOWN, HALF_OPEN = "unknown", "up", "down", "half_open"


class Health:
    __slots__ = ("_down_cause", "consecutive_failures", "consecutive_successes", "ever_up",
                 "failure_cause", "last_error", "last_ok", "request_failures", "state")

    def __init__(self) -> None:
        self.state = UNKNOWN
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.ever_up = False
        # Requests in a row a gateway reported failed with an answer (5xx) or a timeout.
        self.request_failures = 0
        # The cause of the latest failure since the last success (None after one), and of the
        # latest while down.
        self.failure_cause: str | None = None
        self._down_cause: str | None = None

    @property
    def routable(self) -> bool:
        return self.state in (UP, HALF_OPEN)

    @property
    def down_cause(self) -> str | None:
        """Why the worker is down (the cause of its latest failure); None when it is not."""
        return self._down_cause if self.state == DOWN else None

    def _failed(self, error: str, cause: str | None) -> None:
        self.last_error = error
        self.failure_cause = cause
        # While down, the latest failure says best what the worker is now (draining, dead,
        # hung); but an error answer only that it answers. (A draining worker answers 503 to
        # what gateways send it on their kept-alive connections after its port closed: from a
        # gateway older than the "draining" kind, that must not turn it from refused to
        # possibly hung.)
        if self.state == DOWN and cause != FAILING:
            self._down_cause = cause

    def _go_down(self, cause: str | None) -> bool:
        """Take the worker out; True when it was not out already."""
        changed = self.state != DOWN
        self.state = DOWN
        self._down_cause = cause
        return changed

    def on_success(self, now: float, recover_streak: int) -> bool:
        """A scrape or probe answered. Returns True when the state changed."""
        self.last_ok = now
        self.consecutive_failures = 0
        self.consecutive_successes += 1
        self.failure_cause = None
        if self.state == UNKNOWN or (self.state == DOWN and not self.ever_up):
            # First contact (e.g. a worker started after the scheduler): no trial needed.
            self.state = UP
            self.ever_up = True
            self.last_error = None  # up: the errors before it are no reason any more
            return True
        if self.state == DOWN and self.consecutive_successes >= recover_streak:
            self.state = HALF_OPEN
            return True
        return False

    def on_failure(self, error: str, fail_streak: int, connection_level: bool,
                   cause: str | None = None) -> bool:
        """A scrape or probe failed (`cause`: scheduler/protocol.py's; None, unknown: the
        gateways take the worker for hung, as before there were causes). Returns True when the
        state changed."""
        self._failed(error, cause)
        self.consecutive_successes = 0
        if not connection_level:
            return False
        self.consecutive_failures += 1
        if self.state != DOWN and self.consecutive_failures >= fail_streak:
            return self._go_down(cause)
        return False

    def check_silence(self, now: float, dead_after_s: float) -> bool:
        """Down when nothing succeeded for dead_after_s (timeouts only, e.g. a vanished host).
        Its cause: that of the failures since the last success (timeouts, mostly), else
        UNRESPONSIVE."""
        if self.state in (UP, HALF_OPEN) and self.last_ok is not None and now - self.last_ok > dead_after_s:
            self.consecutive_successes = 0
            self.last_error = "silent"
            return self._go_down(self.failure_cause or UNRESPONSIVE)
        return False

    def on_request_failed(self, error: str, report_streak: int, cause: str | None = None) -> bool:
        """A gateway saw a request fail without a connection failure. One is no verdict: a
        request the engine cannot serve fails on every worker it is retried on, and would take
        each out. A streak is: a worker that fails everything while its scrapes answer would
        otherwise look idle, and draw the most requests. Returns True when the state changed."""
        self._failed(error, cause)
        self.request_failures += 1
        if self.state != DOWN and self.request_failures >= report_streak:
            self.consecutive_successes = 0
            return self._go_down(cause)
        return False

    def on_request_ok(self) -> None:
        self.request_failures = 0

    def force_down(self, error: str, cause: str | None = None) -> bool:
        """Gateway saw a connection failure, or a draining worker's refusal: out of rotation
        at once."""
        self._failed(error, cause)
        self.consecutive_successes = 0
        self.request_failures = 0
        return self._go_down(cause)

    def trial_result(self, ok: bool, cause: str | None = None) -> bool:
        """A half-open worker's trial request ended; `cause`: why it failed."""
        if self.state != HALF_OPEN:
            return False
        if ok:
            self.state = UP
        else:
            self._go_down(cause)
        self.ever_up = True
        if ok:
            # Back up: /v1/workers showed the error that took it out on a healthy worker, and
            # the log said "worker ... is up (ClientConnectorError)".
            self.last_error = None
        self.consecutive_successes = 0
        return True
