"""Self-registration: workers POST /v1/workers (and again as heartbeat), DELETE to leave.

Guarded by a shared token; a registration without heartbeats expires after
registration_ttl_s. Without a configured token, registration is refused (an open
endpoint would let anyone add an upstream).

With registration_allowed_networks, a worker may still register by name (a pod's or a
Service's DNS name, a compose service's): the POST handler resolves it (resolve_and_register)
and takes it only when every address it resolves to is in those networks. The name is resolved
again at every heartbeat, so a registration is never kept on a check older than
registration_ttl_s: a heartbeat whose name now resolves outside drops the registration at once
(DNS rebinding: the name was pointed elsewhere after it was checked), one whose name does not
resolve is refused and the registration lapses at its TTL unless a later heartbeat resolves (a
DNS hiccup is no reason to drop a worker serving traffic). This catches a name re-pointed
after its check, it does not prevent every rebinding: the scraper and the gateways resolve the
name themselves, and a DNS server that answers each query differently can pass every check. The
DNS answering for those names is trusted; an operator who cannot trust it registers IP
addresses.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from scheduler.clip import clip_repr
from scheduler.registry import WorkerState, worker_id_for
from scheduler.running_cap import is_positive_int
from scheduler.service import SchedulerService
from scheduler.urls import http_url_problem

log = logging.getLogger(__name__)

SOURCE = "registration"
# Why a bound: a registration waits for its name's resolution, and the worker's registrar gives
# up after 5 s (inference_worker/registration.py) then retries; a resolver that does not answer
# within this is refused with a message that says so rather than left to that client timeout.
RESOLVE_TIMEOUT_S = 2.0
# Why a charset: a worker id is a path segment of the API (DELETE /v1/workers/{id}, the
# gateways' .../failure reports, sent unquoted), a label of every metric and a field of the
# scheduler's and the gateways' log lines. A registered "a?b" could never be reported failed or
# deregistered, and one holding a newline forged log lines in both services. Kubernetes pod
# names, host:port and [IPv6]:port ids, UUIDs all fit.
_WORKER_ID = re.compile(r"[A-Za-z0-9._~:\[\]-]{1,253}")
MAX_MODEL_NAME_CHARS = 1024  # a model named by its path, or a LoRA adapter's: well under
MAX_ENGINE_CHARS = 64


class RegistrationError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def check_token(service: SchedulerService, authorization: str | None) -> None:
    token = service.cfg.registration_token
    if not token:
        raise RegistrationError(403, "registration disabled: the scheduler has no registration token")
    given = (authorization or "").removeprefix("Bearer ").strip()
    # aiohttp hands a header byte that is not UTF-8 on as a lone surrogate, which a plain
    # encode() refuses (a 500): surrogatepass gives bytes back, which then do not match.
    if not hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               token.encode("utf-8", "surrogatepass")):
        raise RegistrationError(401, "invalid or missing registration token")


# The cloud metadata services (169.254.169.254 and AWS's IPv6 one): no engine serves there.
_METADATA = {ipaddress.ip_address("fd00:ec2::254")}
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _host(url: str) -> Address | str:
    """The host of `url`: its IP address, or the name (a str) to resolve."""
    host = urlsplit(url).hostname or ""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return host


def _address_problem(url: str, address: Address, allowed: list[Network], resolved: bool) -> str | None:
    """Why the scheduler must not take `url`, whose host is `address` or (`resolved`) a name
    that resolves to it, or None.

    A worker listening on every interface (--host 0.0.0.0) and advertising that address:
    connecting to 0.0.0.0 or :: reaches the scheduler's own host, and every such worker
    would be one worker, '0.0.0.0:port'. A link-local address or a metadata service's: a
    registration is a URL the scheduler scrapes and the gateways send clients' requests to,
    so a leaked token pointed both at the host's credentials. Outside `allowed` (the
    operator's registration_allowed_networks), likewise."""
    # The operator reads which of a name's addresses was refused (a name may have several).
    at = f"{clip_repr(url)} resolves to {address}, which" if resolved else clip_repr(url)
    if address.is_unspecified:
        return (f"{at} names no address to reach ({address} is every interface of the worker's "
                "host): register the worker's own address (the worker's --advertise-url)")
    mapped = getattr(address, "ipv4_mapped", None) or address  # ::ffff:169.254.169.254
    if mapped.is_link_local or mapped.is_multicast or mapped in _METADATA:
        return f"{at} is a link-local, multicast or metadata address, where no worker serves"
    if allowed and not any(mapped in net for net in allowed):
        return (f"{at} is outside registration_allowed_networks "
                f"({', '.join(str(net) for net in allowed)})")
    return None


def _unreachable(url: str, allowed: list[Network], resolved: Sequence[Address] | None) -> str | None:
    """Why the scheduler must not take `url` as a worker's, or None.

    `resolved`: the addresses its host name resolved to (resolve_and_register), each checked
    as an address given in the URL would be. With `allowed` a name is taken only so: without
    it, a name is taken unresolved (the scraper and the gateways resolve it when they call)."""
    name = _host(url)
    if not isinstance(name, str):
        return _address_problem(url, name, allowed, False)
    if not allowed:
        return None
    if resolved is None:  # an in-process caller that did not resolve it
        return (f"{clip_repr(url)} names its host: with registration_allowed_networks, the name must "
                "be resolved first (resolve_and_register)")
    return next((p for a in resolved if (p := _address_problem(url, a, allowed, True))), None)


async def _resolve(url: str, name: str) -> list[Address]:
    """Every address `name` resolves to (asynchronously: getaddrinfo runs in the loop's
    executor), or a 400 that says why there is none."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except TimeoutError:
        # The executor's thread goes on until the resolver gives up; only the wait ends here.
        raise RegistrationError(400, f"url {clip_repr(url)}: its host {clip_repr(name)} did not resolve "
                                f"within {RESOLVE_TIMEOUT_S:g} s", "url") from None
    except (OSError, UnicodeError) as exc:  # socket.gaierror: no such name, no address
        raise RegistrationError(400, f"url {clip_repr(url)}: its host {clip_repr(name)} does not resolve "
                                f"({exc})", "url") from None
    addresses: dict[Address, None] = {}  # in the resolver's order, each once
    for *_, sockaddr in infos:
        try:
            addresses[ipaddress.ip_address(sockaddr[0])] = None
        except ValueError:  # a family other than IPv4 and IPv6: nothing an http client dials
            continue
    if not addresses:
        raise RegistrationError(400, f"url {clip_repr(url)}: its host {clip_repr(name)} resolves to no IP "
                                "address", "url")
    return list(addresses)


def _printable(value: object, max_chars: int) -> bool:
    """A name the logs and metrics can show as it is: no line break or other control character
    (a forged log line), bounded (a megabyte-long label on every scrape)."""
    return isinstance(value, str) and 0 < len(value) <= max_chars and value.isprintable()


def _validate(body: object, allowed: list[Network], resolved: Sequence[Address] | None
              ) -> tuple[str, list[str], str | None, str | None, int | None]:
    if not isinstance(body, dict):
        raise RegistrationError(400, "body must be a JSON object")
    url = body.get("url")
    if not isinstance(url, str):
        raise RegistrationError(400, "url is required", "url")
    problem = http_url_problem(url) or _unreachable(url, allowed, resolved)
    if problem:
        raise RegistrationError(400, f"url {problem}", "url")
    models = body.get("models", [])
    if not isinstance(models, list) or not all(_printable(m, MAX_MODEL_NAME_CHARS) for m in models):
        raise RegistrationError(400, f"models must be a list of names (printable, up to "
                                f"{MAX_MODEL_NAME_CHARS} characters)", "models")
    engine = body.get("engine")
    if engine is not None and not _printable(engine, MAX_ENGINE_CHARS):
        raise RegistrationError(400, f"engine must be a printable name of up to {MAX_ENGINE_CHARS} "
                                "characters", "engine")
    worker_id = body.get("worker_id")
    if worker_id is not None and (not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id)
                                  or worker_id in (".", "..")):
        raise RegistrationError(400, "worker_id must be 1 to 253 letters, digits and . _ ~ : [ ] -",
                                "worker_id")
    max_running = body.get("max_running")
    if max_running is not None and not is_positive_int(max_running):
        raise RegistrationError(400, "max_running must be a positive integer (at most 2**53)",
                                "max_running")
    return url.rstrip("/"), models, engine, worker_id, max_running


async def resolve_and_register(service: SchedulerService, body: object) -> tuple[WorkerState, bool]:
    """register(), for POST /v1/workers: with registration_allowed_networks and a URL that
    names its host, the name is resolved first and every address it resolves to checked.

    A name that now resolves where it must not drops the registration already at that URL (it
    was checked when it resolved elsewhere): the scraper and the gateways would call there."""
    allowed = service.cfg.registration_networks
    url = body.get("url") if isinstance(body, dict) else None
    if not allowed or not isinstance(url, str) or http_url_problem(url) is not None:
        return register(service, body)  # nothing to resolve: refused or taken as before
    name = _host(url)
    if not isinstance(name, str):
        return register(service, body)
    addresses = await _resolve(url, name)
    # After the await: what the registry holds is read afresh below, never before it.
    problem = _unreachable(url, allowed, addresses)
    if problem:
        _drop_registration(service, url.rstrip("/"), problem)
        raise RegistrationError(400, f"url {problem}", "url")
    return register(service, body, addresses)


def _drop_registration(service: SchedulerService, url: str, why: str) -> None:
    w = service.registry.by_url(url)
    if w is None or SOURCE not in w.sources:
        return
    log.warning("registration of %s dropped: %s", w.worker_id, why)
    deregister(service, w.worker_id)


def register(service: SchedulerService, body: object,
             resolved: Sequence[Address] | None = None) -> tuple[WorkerState, bool]:
    """Add or refresh (heartbeat) a registration. Returns (worker, created).

    `max_running` (optional): the worker's running-request cap (scheduler/running_cap.py).
    `resolved`: the addresses the URL's host name resolved to, where the operator keeps
    registrations to networks (resolve_and_register resolves them)."""
    url, models, engine, worker_id, max_running = _validate(body, service.cfg.registration_networks,
                                                            resolved)
    registry = service.registry
    at_url = registry.by_url(url)
    if worker_id:
        known = registry.workers.get(worker_id)
        if at_url is not None and at_url is not known:
            # Two ids for one engine would make it two workers, each drawing a full share (a
            # worker back from a crash under a new id: its old registration expires, then
            # this one goes through).
            raise RegistrationError(409, f"url {clip_repr(url)} is known as worker {at_url.worker_id!r}",
                                    "url")
    else:
        # The worker at this URL, under whatever id another source gave it (a pod's name).
        known = at_url or registry.workers.get(worker_id_for(url))
        worker_id = known.worker_id if known is not None else None
    if known is not None and known.url != url:
        # The registry keeps a known worker's URL: this one would be answered as registered
        # while its calls went on to the other URL. Once that registration expires (or leaves)
        # this one goes through.
        raise RegistrationError(409, f"worker {known.worker_id!r} is known at another URL, "
                                f"{clip_repr(known.url)}", "url")
    created = known is None or SOURCE not in known.sources
    if created:
        registered = sum(1 for w in service.registry.workers.values() if SOURCE in w.sources)
        bound = service.cfg.max_registered_workers
        if registered >= bound:
            raise RegistrationError(429, f"the scheduler keeps at most {bound} registered workers "
                                    "(max_registered_workers): retry once one has left")
    w = service.add_worker(
        WorkerState(url, worker_id=worker_id, models=models, engine=engine, source=SOURCE)
    )
    if max_running is not None:
        service.announce_running_cap(w, max_running)
    w.expires_at = time.monotonic() + service.cfg.registration_ttl_s
    return w, created


def deregister(service: SchedulerService, worker_id: str) -> bool:
    w = service.registry.workers.get(worker_id)
    if w is None or SOURCE not in w.sources:
        return False
    w.expires_at = None
    service.remove_worker(worker_id, source=SOURCE)
    return True
