"""Gateways by their instance id, and when one is gone: its leases end then, not at the TTL.

Why: a gateway that dies (SIGKILL, an OOM kill, a lost node) releases none of its leases; the
workers stop its requests (their connections dropped), yet each lease stayed open until
--lease-ttl-s (600 s). Meanwhile every worker's open leases counted against its running cap
(llm_aware's `running_cap` guard counts open leases as running): measured with two workers of
cap 40 and 80 long streams in flight (benchmarks/gateway_crash_leases.py), both workers stayed
saturated with nothing running, and no request through the gateway started in its place was
placed for as long as it was watched. The in-flight gauges stayed at 40, least_request
counted the phantoms as load, and each release of a new request freed no slot until the next
scrape (a seen phantom made the scrape's drop look like releases still to come: shown_finished).

How:
- A gateway names itself (a random id per process, router/app.py) in the header
  `X-Gateway-Instance` on its channel's upgrade (`GET /v1/channel`) and on its HTTP calls. The
  leases decided for its calls are tagged with it (scheduler/leases.py: LeaseTable.tag).
- Its channel is its sign of life: the kernel closes a killed process's sockets at once, and
  a channel whose peer went silent (a lost host, no FIN) is closed by the channel's heartbeat
  (scheduler/channel.py: CHANNEL_HEARTBEAT_S). When a gateway's last channel closes, a grace
  period starts (--gateway-gone-grace-s, 5 s); a channel it opens within the grace cancels it: a
  TLS reload opens the new connection before the old one closes, and a gateway whose channel
  was cut reconnects at once (router/sched_pipe.py). Past the grace its leases end as expired
  leases end (SchedulerService.drop_gateway); a handed-off lease stays (its request goes on in
  the worker, which the gateway no longer holds) until a scrape shows it.
- Kept as before: a gateway that names no instance (an older one) and a gateway never seen on
  a channel (an HTTP-only one: --no-scheduler-pipelining, or a scheduler without the channel)
  have nothing that tells when they are gone: their leases end on release or at the TTL. A
  release of a lease ended here (a gateway cut off for longer than the grace, whose requests
  went on) is answered as for an expired lease (404, counted "unknown"): nothing is freed twice.

Chosen over a short TTL (its renewals would cost a call per long request every few seconds, and
a gateway stalled past it loses leases all the same) and over dropping the seen leases a scrape
no longer shows (it cannot tell which lease a finished request held, nor a crash from traffic
that did not come through this scheduler).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections import Counter
from collections.abc import Callable

# The header a gateway names itself in, and what an id may be: printable ASCII, no space.
GATEWAY_INSTANCE_HEADER = "X-Gateway-Instance"
MAX_INSTANCE_CHARS = 128


def valid_instance(value: str) -> bool:
    return 0 < len(value) <= MAX_INSTANCE_CHARS and value.isascii() and value.isprintable() \
        and " " not in value


def new_instance_id() -> str:
    """A gateway process's id: its host and pid (for an operator reading the scheduler's log)
    and random bytes (a pid is reused, a host name may not be unique)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "", socket.gethostname())[:63] or "gateway"
    return f"{host}-{os.getpid()}-{os.urandom(4).hex()}"


class GatewayPresence:
    """Open channels per gateway instance; `on_gone(instance)` once one has had none for the
    grace period (0: never, as before)."""

    def __init__(self, grace_s: float, on_gone: Callable[[str], object]) -> None:
        self.grace_s = grace_s
        self._on_gone = on_gone
        self.channels: Counter[str] = Counter()
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def opened(self, instance: str) -> None:
        self.channels[instance] += 1
        timer = self._timers.pop(instance, None)
        if timer is not None:
            timer.cancel()  # back within the grace: a reconnect, not a crash

    def closed(self, instance: str) -> None:
        left = self.channels[instance] - 1
        if left > 0:
            self.channels[instance] = left
            return
        del self.channels[instance]
        if self.grace_s > 0 and instance not in self._timers:
            self._timers[instance] = asyncio.get_running_loop().call_later(
                self.grace_s, self._gone, instance)

    @property
    def waiting(self) -> int:
        """Gateways whose last channel closed, within their grace."""
        return len(self._timers)

    def _gone(self, instance: str) -> None:
        self._timers.pop(instance, None)
        if instance not in self.channels:
            self._on_gone(instance)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
