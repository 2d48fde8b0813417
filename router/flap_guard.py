"""Damping for the switch between scheduled routing and round robin (router/scheduling.py).

The gateway leaves round robin as soon as its probe finds the scheduler able to route (GET
/health's routable count). A scheduler whose /health answers while its schedule calls fail (a
bug in the decision path, a proxy in front of it that breaks POSTs, overload) then makes the
gateway flap: back to scheduled routing within a probe period, and the next request waits out
--wait-schedule-timeout-ms again before the switch. Every request that lands in that window
stalls for the whole timeout, which with a 100 ms probe is nearly all of them.

So a failure soon after a return (within FLAP_WINDOW_S) counts as a flap: round robin at once,
without waiting out the timeout again, and the next return needs the probe to find the
scheduler routable for a while first (HOLD_FIRST_S, doubling with each flap up to HOLD_MAX_S).
A scheduled stretch that outlasts the window ends the damping.
"""

from __future__ import annotations

# A failure this soon after scheduled routing resumed is a flap.
FLAP_WINDOW_S = 30.0
# How long the probe must find the scheduler routable before the return after a first flap;
# doubled with each further flap, up to HOLD_MAX_S.
HOLD_FIRST_S = 2.0
HOLD_MAX_S = 60.0


class FlapGuard:
    def __init__(self, window_s: float = FLAP_WINDOW_S, first_hold_s: float = HOLD_FIRST_S,
                 max_hold_s: float = HOLD_MAX_S) -> None:
        self.window_s = window_s
        self.first_hold_s = first_hold_s
        self.max_hold_s = max_hold_s
        # How long the probe must find the scheduler routable before the next return.
        self.hold_s = 0.0
        self._returned_at: float | None = None  # when scheduled routing last resumed

    def returned(self, now: float) -> None:
        """Scheduled routing resumed after round robin."""
        self._returned_at = now

    def failed(self, now: float) -> bool:
        """The scheduler failed a call (or the worker-list refresh). True: a flap, so round
        robin at once; the next return waits for a longer healthy stretch."""
        returned_at, self._returned_at = self._returned_at, None
        if returned_at is None:
            return False
        if now - returned_at >= self.window_s:
            self.hold_s = 0.0  # it held: not a flap
            return False
        self.hold_s = min(self.max_hold_s, max(self.first_hold_s, 2 * self.hold_s))
        return True

    def may_return(self, routable_since: float, now: float) -> bool:
        """Whether a probe finding the scheduler routable, as it has since `routable_since`
        without a failed probe between, may end round robin."""
        return now - routable_since >= self.hold_s
