"""Self-registration: workers POST /v1/workers (and again as heartbeat), DELETE to leave.

Guarded by a shared token; a registration without heartbeats expires after
registration_ttl_s. Without a configured token, registration is refused (an open
endpoint would let anyone add an upstream).
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import time
from urllib.parse import urlsplit

from scheduler.registry import WorkerState, worker_id_for
from scheduler.running_cap import is_positive_int
from scheduler.service import SchedulerService
from scheduler.urls import http_url_problem

SOURCE = "registration"
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


def _unreachable(url: str, allowed: list[Network]) -> str | None:
    """Why the scheduler must not take `url` as a worker's, or None.

    A worker listening on every interface (--host 0.0.0.0) and advertising that address:
    connecting to 0.0.0.0 or :: reaches the scheduler's own host, and every such worker
    would be one worker, '0.0.0.0:port'. A link-local address or a metadata service's: a
    registration is a URL the scheduler scrapes and the gateways send clients' requests to,
    so a leaked token pointed both at the host's credentials. Outside `allowed` (the
    operator's registration_allowed_networks), likewise."""
    host = urlsplit(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name
        if allowed:
            return (f"{url!r} names its host: with registration_allowed_networks, register the "
                    "worker's IP address")
        return None
    if address.is_unspecified:
        return (f"{url!r} names no address to reach ({host} is every interface of the worker's "
                "host): register the worker's own address (the worker's --advertise-url)")
    mapped = getattr(address, "ipv4_mapped", None) or address  # ::ffff:169.254.169.254
    if mapped.is_link_local or mapped.is_multicast or mapped in _METADATA:
        return f"{url!r} is a link-local, multicast or metadata address, where no worker serves"
    if allowed and not any(mapped in net for net in allowed):
        return f"{url!r} is outside registration_allowed_networks"
    return None


def _printable(value: object, max_chars: int) -> bool:
    """A name the logs and metrics can show as it is: no line break or other control character
    (a forged log line), bounded (a megabyte-long label on every scrape)."""
    return isinstance(value, str) and 0 < len(value) <= max_chars and value.isprintable()


def _validate(body: object, allowed: list[Network]) -> tuple[str, list[str], str | None, str | None,
                                                             int | None]:
    if not isinstance(body, dict):
        raise RegistrationError(400, "body must be a JSON object")
    url = body.get("url")
    if not isinstance(url, str):
        raise RegistrationError(400, "url is required", "url")
    problem = http_url_problem(url) or _unreachable(url, allowed)
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


def register(service: SchedulerService, body: object) -> tuple[WorkerState, bool]:
    """Add or refresh (heartbeat) a registration. Returns (worker, created).

    `max_running` (optional): the worker's running-request cap (scheduler/running_cap.py)."""
    url, models, engine, worker_id, max_running = _validate(body, service.cfg.registration_networks)
    registry = service.registry
    at_url = registry.by_url(url)
    if worker_id:
        known = registry.workers.get(worker_id)
        if at_url is not None and at_url is not known:
            # Two ids for one engine would make it two workers, each drawing a full share (a
            # worker back from a crash under a new id: its old registration expires, then
            # this one goes through).
            raise RegistrationError(409, f"url {url!r} is known as worker {at_url.worker_id!r}", "url")
    else:
        # The worker at this URL, under whatever id another source gave it (a pod's name).
        known = at_url or registry.workers.get(worker_id_for(url))
        worker_id = known.worker_id if known is not None else None
    if known is not None and known.url != url:
        # The registry keeps a known worker's URL: this one would be answered as registered
        # while its calls went on to the other URL. Once that registration expires (or leaves)
        # this one goes through.
        raise RegistrationError(409, f"worker {known.worker_id!r} is known at another URL, "
                                f"{known.url!r}", "url")
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
