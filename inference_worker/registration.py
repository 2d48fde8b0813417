"""Self-registration with a scheduler (--register-with URL --registration-token T).

The worker stands alone, so this speaks the scheduler's small JSON API with plain
aiohttp and dicts (no import of the scheduler package):
POST {scheduler}/v1/workers {"url", "models", "engine"} registers, and posting it
again is the heartbeat (it also re-registers a worker the scheduler forgot, e.g.
after a scheduler restart); DELETE {scheduler}/v1/workers/{worker_id} leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import aiohttp

from inference_worker.config import WorkerConfig
from inference_worker.server.tls import PeerContext

log = logging.getLogger(__name__)


DEFAULT_HEARTBEAT_S = 3.0
# What the scheduler may ask for: a zero or negative interval would heart-beat in a tight loop.
HEARTBEAT_BOUNDS_S = (0.1, 3600.0)


def heartbeat_interval(value: object) -> float:
    """The scheduler's heartbeat_interval_s, or the default if it sent no usable number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return DEFAULT_HEARTBEAT_S
    low, high = HEARTBEAT_BOUNDS_S
    return min(max(float(value), low), high)


class Registrar:
    def __init__(self, config: WorkerConfig, *, heartbeat_s: float | None = None,
                 max_running: int | None = None, tls: PeerContext | None = None) -> None:
        self.config = config
        # The engine's running-request cap (max_num_seqs), so the scheduler knows it before
        # requests queue here.
        self.max_running = max_running
        self.scheduler = (config.register_with or "").rstrip("/")
        # An IPv6 literal goes in brackets: http://::1:8001 has no host (the scheduler refused it).
        host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host
        scheme = "https" if config.ssl_certfile else "http"  # as this worker serves
        self.url = (config.advertise_url or f"{scheme}://{host}:{config.port}").rstrip("/")
        # An https:// scheduler: checked against --scheduler-ca-file, else the system's CAs.
        # Read for each call: a reload (server/tls_reload.py) swaps it.
        self._tls = tls if tls is not None else PeerContext()
        self.heartbeat_s = heartbeat_s  # None: what the scheduler asks for
        self.worker_id: str | None = None
        self.registered = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    @property
    def _headers(self) -> dict[str, str]:
        token = self.config.registration_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _body(self) -> dict:
        body = {"url": self.url, "models": [self.config.model_name], "engine": "vllm"}
        if self.max_running is not None:
            body["max_running"] = self.max_running
        return body

    async def start(self) -> None:
        """Call once the worker is ready to serve. Registers in the background (retrying
        until the scheduler answers) and keeps heart-beating."""
        if not self.scheduler:
            return
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0),
                                              connector=aiohttp.TCPConnector())
        self._task = asyncio.create_task(self._loop(), name="registrar")

    async def _register_once(self) -> float | None:
        """One POST; returns the heartbeat interval on success, None on failure."""
        assert self._session is not None
        try:
            async with self._session.post(
                f"{self.scheduler}/v1/workers", json=self._body(), headers=self._headers,
                ssl=self._tls.request_ssl,
            ) as resp:
                data = await resp.json(content_type=None)
                if resp.status in (200, 201) and isinstance(data, dict):
                    if resp.status == 201 or not self.registered.is_set():
                        log.info("registered with scheduler %s as %s", self.scheduler, data.get("worker_id"))
                    self.worker_id = data.get("worker_id")
                    self.registered.set()
                    return heartbeat_interval(data.get("heartbeat_interval_s"))
                log.warning("scheduler %s refused registration (%s): %s", self.scheduler, resp.status, data)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("cannot register with scheduler %s: %r", self.scheduler, exc)
        return None

    async def _loop(self) -> None:
        retry_s = 0.5
        while True:
            interval = await self._register_once()
            if interval is None:
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, 5.0)
                continue
            retry_s = 0.5
            await asyncio.sleep(self.heartbeat_s or interval)

    async def stop(self) -> None:
        """Leave the scheduler's rotation (DELETE) and stop heart-beating."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is None:
            return
        if self.worker_id:
            try:
                async with self._session.delete(
                    f"{self.scheduler}/v1/workers/{self.worker_id}",
                    headers=self._headers,
                    timeout=aiohttp.ClientTimeout(total=2.0),
                    ssl=self._tls.request_ssl,
                ) as resp:
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("cannot deregister from scheduler %s: %r", self.scheduler, exc)
        await self._session.close()
        self._session = None
