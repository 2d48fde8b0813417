"""Client the gateway uses to talk to the scheduler (imported by `router`).

The scheduler is on every request's path, so this client keeps one aiohttp
session with persistent keep-alive connections (TCP_NODELAY, no per-request
connection set-up) and encodes/decodes the wire types with
pydantic-core (Rust): measured, its JSON validation and encoding are cheaper than the
stdlib json module plus hand checks or `model_construct` (benchmarks/scheduler_bench.py,
part `wire`).

Errors:
- `UnknownModelError`: no known worker serves the model (HTTP 404).
- `SchedulerUnavailableError`: connection failure, timeout, or a 5xx that is not
  the scheduler's "wait" answer. The gateway falls back to round robin on it.
- `SchedulerAuthError` (a `SchedulerUnavailableError`): the scheduler refused the gateway's
  token (401/403: its --gateway-token and our --scheduler-token differ). Unavailable, not a
  bad request: no request of a client can be served by it, so the gateway falls back to round
  robin (router/scheduling.py logs why, as an ERROR) instead of failing every request.
- `SchedulerRequestError`: the scheduler rejected the request (other 4xx).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import aiohttp
from pydantic import ValidationError
from pydantic_core import from_json, to_json

from scheduler.clip import MAX_SHOWN_CHARS, clip
from scheduler.gateways import GATEWAY_INSTANCE_HEADER
from scheduler.protocol import LeaseRelease, ScheduleDecision, ScheduleRequest, ScheduleWait, WorkerList
from scheduler.tls import PeerContext

log = logging.getLogger(__name__)

_loads = json.loads
_JSON_HEADERS = {"Content-Type": "application/json"}


class SchedulerError(Exception):
    """Base class of every error the client raises."""


class UnknownModelError(SchedulerError):
    """No worker known to the scheduler serves the requested model (404)."""


class SchedulerUnavailableError(SchedulerError):
    """The scheduler could not be reached or failed (connection error, timeout, 5xx)."""


class SchedulerAuthError(SchedulerUnavailableError):
    """The scheduler refused our token (401 or 403): a configuration error, not an outage."""


def raise_for_auth(status: int, message: str) -> None:
    """SchedulerAuthError for a 401/403 answer (shared with router/sched_pipe.py)."""
    if status in (401, 403):
        raise SchedulerAuthError(f"scheduler answered {status} (its --gateway-token refused our "
                                 f"--scheduler-token): {message}")


def auth_headers(token: str | None) -> dict[str, str]:
    """The Authorization header that carries the gateway token, or none."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class SchedulerRequestError(SchedulerError):
    """The scheduler rejected the request as invalid (4xx other than 404)."""


def encode_schedule_request(req: ScheduleRequest | dict[str, Any]) -> bytes:
    """Compact JSON; fields at their defaults are left out."""
    if isinstance(req, dict):
        return to_json(req)
    return req.model_dump_json(exclude_defaults=True).encode()


def encode_release(rel: LeaseRelease | dict[str, Any]) -> bytes:
    if isinstance(rel, dict):
        return to_json(rel)
    return rel.model_dump_json(exclude_none=True).encode()


def _wait_payload(raw: bytes) -> dict:
    """A 503 is the scheduler's "wait" answer only when it says so; else it is unavailable."""
    try:
        payload = from_json(raw)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and payload.get("wait"):
        payload.setdefault("retry_after_ms", 0)
        return payload
    raise SchedulerUnavailableError(f"scheduler answered 503: {_error_message(raw)}")


def _error_message(raw: bytes) -> str:
    """The scheduler's error message, cut when long (clip.py): the gateway quotes it to its
    client, and a scheduler of before clip.py quoted a client's model name whole."""
    try:
        return clip(str(_loads(raw)["error"]["message"]), 4 * MAX_SHOWN_CHARS)
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


class SchedulerClient:
    """One per gateway process; safe to share between concurrent requests."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 2.0,
        session: aiohttp.ClientSession | None = None,
        token: str | None = None,
        tls: PeerContext | None = None,
        instance: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # An https:// scheduler: checked against this (the gateway's --scheduler-ca-file), else
        # the system's CAs. Read for each call: a reload (scheduler/tls_reload.py) swaps it.
        self._tls = tls if tls is not None else PeerContext()
        # Built once: every call sends the same headers (token: the scheduler's --gateway-token).
        self._get_headers = auth_headers(token)
        if instance:
            # The gateway's instance id: the leases of its calls end with it (scheduler/gateways.py).
            self._get_headers[GATEWAY_INSTANCE_HEADER] = instance
        self._post_headers = {**_JSON_HEADERS, **self._get_headers}
        self.timeout_s = timeout_s
        self._session = session
        self._owns_session = session is None
        self._background: set[asyncio.Task] = set()
        self._schedule_url = f"{self.base_url}/v1/schedule"
        self._release_url = f"{self.base_url}/v1/release"
        self._prefilled_url = f"{self.base_url}/v1/prefilled"
        self._renew_url = f"{self.base_url}/v1/renew"
        self._workers_url = f"{self.base_url}/v1/workers"

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # The connector applies TCP_NODELAY to every connection it opens; keep-alive is
            # aiohttp's default. No limit per host: the gateway may have many calls in flight.
            connector = aiohttp.TCPConnector(
                limit=0, keepalive_timeout=60, socket_factory=_nodelay_socket_factory
            )
            self._session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))
            self._owns_session = True
        return self._session

    async def _post(self, url: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        session = self._get_session()
        try:
            async with session.post(
                url, data=body, headers=self._post_headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
                ssl=self._tls.request_ssl,
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise SchedulerUnavailableError(f"scheduler {url}: {type(exc).__name__}: {exc}") from exc

    async def _schedule_bytes(self, data: bytes, wait_ms: int) -> tuple[int, bytes]:
        status, raw = await self._post(self._schedule_url, data, self.timeout_s + wait_ms / 1000.0)
        if status in (200, 503):
            return status, raw
        if status == 404:
            raise UnknownModelError(_error_message(raw))
        raise_for_auth(status, _error_message(raw))
        if 400 <= status < 500:
            raise SchedulerRequestError(f"scheduler answered {status}: {_error_message(raw)}")
        raise SchedulerUnavailableError(f"scheduler answered {status}: {_error_message(raw)}")

    async def schedule_raw(self, body: dict[str, Any] | bytes, wait_ms: int = 0) -> tuple[int, dict]:
        """A dict (or pre-encoded bytes) in, (200 or 503, decoded JSON) out."""
        data = body if isinstance(body, bytes) else to_json(body)
        status, raw = await self._schedule_bytes(data, wait_ms)
        payload = _wait_payload(raw) if status == 503 else from_json(raw)
        return status, payload

    async def schedule(self, req: ScheduleRequest | dict[str, Any]) -> ScheduleDecision | ScheduleWait:
        """Ask for a worker. Returns a decision (with a lease to release) or a wait answer."""
        wait_ms = req.get("wait_ms", 0) if isinstance(req, dict) else req.wait_ms
        status, raw = await self._schedule_bytes(encode_schedule_request(req), int(wait_ms or 0))
        if status == 503:
            return ScheduleWait.model_validate(_wait_payload(raw))
        try:
            return ScheduleDecision.model_validate_json(raw)
        except ValidationError as exc:
            raise SchedulerUnavailableError(f"malformed scheduler answer: {raw[:200]!r}") from exc

    async def release(self, rel: LeaseRelease | dict[str, Any]) -> None:
        """Close a lease. Never raises (safe to fire and forget); failures are logged,
        and the scheduler's lease expiry covers a release that was lost."""
        try:
            status, raw = await self._post(self._release_url, encode_release(rel), self.timeout_s)
            if status >= 400 and status != 404:  # 404: lease already expired or released
                log.warning("scheduler release answered %s: %s", status, _error_message(raw))
        except SchedulerUnavailableError as exc:
            log.debug("lease release lost: %s", exc)

    def release_nowait(self, rel: LeaseRelease | dict[str, Any]) -> None:
        """Schedule `release` in the background (keeps a reference so the task is not GC'd)."""
        self._spawn(self.release(rel))

    async def prefilled(self, lease_id: str) -> None:
        """Report a lease's first token (its prompt is prefilled). Never raises: a lost report
        only means the worker's prompt counter tells the scheduler a scrape later."""
        try:
            await self._post(self._prefilled_url, to_json({"lease_id": lease_id}), self.timeout_s)
        except SchedulerUnavailableError as exc:
            log.debug("prefilled report lost: %s", exc)

    def prefilled_nowait(self, lease_id: str) -> None:
        self._spawn(self.prefilled(lease_id))

    async def renew(self, lease_id: str) -> None:
        """The lease's request still runs: it expires a TTL from now. Never raises: a lost
        renewal is made good by the next."""
        try:
            await self._post(self._renew_url, to_json({"lease_id": lease_id}), self.timeout_s)
        except SchedulerUnavailableError as exc:
            log.debug("lease renewal lost: %s", exc)

    def renew_nowait(self, lease_id: str) -> None:
        self._spawn(self.renew(lease_id))

    async def report_failure(self, worker_id: str, error: str, refused: bool = False) -> None:
        """The gateway saw a request fail on this worker (`error`: its failure kind; `refused`:
        its port refused the connection). A connection failure takes the worker out of rotation
        at once, other failures after a streak (scheduler/health.py). Never raises."""
        url = f"{self._workers_url}/{worker_id}/failure"
        # "refused" only when true: the report reads as before to a scheduler that knows no
        # causes, and a refused "connect" still takes the worker out there.
        report: dict[str, object] = {"error": error, "refused": True} if refused else {"error": error}
        try:
            status, raw = await self._post(url, to_json(report), self.timeout_s)
            if status >= 400 and status != 404:
                log.warning("scheduler failure report answered %s: %s", status, _error_message(raw))
        except SchedulerUnavailableError as exc:
            log.debug("failure report lost: %s", exc)

    def report_failure_nowait(self, worker_id: str, error: str, refused: bool = False) -> None:
        self._spawn(self.report_failure(worker_id, error, refused))

    async def workers(self) -> WorkerList:
        """Every worker the scheduler knows (healthy or not), and whether it is still learning
        its pool after a start. Raises SchedulerUnavailableError."""
        session = self._get_session()
        try:
            async with session.get(
                self._workers_url, headers=self._get_headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), ssl=self._tls.request_ssl,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise SchedulerUnavailableError(f"scheduler {self._workers_url}: {exc!r}") from exc
        if status != 200:
            raise SchedulerUnavailableError(f"scheduler answered {status}: {_error_message(raw)}")
        try:
            return WorkerList.model_validate(_loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise SchedulerUnavailableError(f"malformed /v1/workers answer: {exc}") from exc

    async def routable(self) -> int | None:
        """How many workers the scheduler can route to now, from GET /health: None when it
        does not answer 200. A scheduler that does not say is counted as ready (1)."""
        session = self._get_session()
        try:
            async with session.get(
                f"{self.base_url}/health", headers=self._get_headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), ssl=self._tls.request_ssl,
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return None
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        try:
            n = _loads(raw).get("routable", 1)
        except (ValueError, AttributeError):
            return 1
        return n if isinstance(n, int) and not isinstance(n, bool) else 1

    async def token_accepted(self) -> bool:
        """Whether the scheduler takes our token now: an empty batch (no operation, nothing
        changes) answered anything but 401/403. /health, which the probe reads, takes no token,
        so it cannot tell. False too when the scheduler does not answer."""
        try:
            status, _ = await self._post(f"{self.base_url}/v1/batch", b"[]", self.timeout_s)
        except SchedulerUnavailableError:
            return False
        return status not in (401, 403)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Wait briefly for background releases, then close the session if we own it."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.timeout_s)
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> SchedulerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _nodelay_socket_factory(addr_info) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setblocking(False)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
