"""The gateway's aiohttp application: routes, shared clients, background tasks."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
import socket
import ssl
import time
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from router.access_log import AccessLog, Stats, stats_loop
from router.auth import KeyChecker, inline_keys, key_bytes, load_api_keys
from router.config import RouterConfig
from router.cors import CorsPolicy
from router.errors import error_response
from router.fallback import FallbackRouter
from router.http_errors import OpenAIErrorAppRunner
from router.key_reload import KeyFileWatcher
from router.metrics import RouterMetrics
from router.proxy import Proxy
from router.queue import AdmissionQueue
from router.request_checks import ROOT_PATHS
from router.sched_pipe import SchedulerPipe
from router.scheduling import Scheduling
from router.slash_redirect import unrouted
from router.ws_proxy import handle_ws
from router.ws_sessions import WsSessions
from scheduler.client import SchedulerClient
from scheduler.clip import clip_repr
from scheduler.connection_limit import connection_budget
from scheduler.gateways import new_instance_id
from scheduler.tls import PeerContext, TlsError, client_context, scheme, server_context
from scheduler.tls_reload import tls_reloader

if TYPE_CHECKING:
    from router.tracing import Tracing

log = logging.getLogger("router")

PROXY_KEY = web.AppKey("proxy", Proxy)
# How long a stopping gateway waits for its last traces to be exported, after its drain: within
# the orchestrator's grace period (Kubernetes: 60 s, less the 5 s preStop sleep and the default
# --shutdown-timeout 50 s), and a collector that is away must not hold the stop longer.
TRACES_FLUSH_S = 3.0
# aiohttp refuses a request line or a header field over 8 KiB with a plain-text 400; identity
# tokens with many claims pass that, and vLLM (behind uvicorn) takes them. 32 KiB each.
HEADER_LIMITS = {"max_line_size": 32 * 1024, "max_field_size": 32 * 1024}


def load_tracing(cfg: RouterConfig) -> Tracing | None:
    """The gateway's OpenTelemetry traces, with --otlp-traces-endpoint; else None, and no
    opentelemetry module is imported at all. Missing packages stop start-up with one line."""
    if not cfg.otlp_traces_endpoint:
        return None
    try:
        from router.tracing import Tracing
    except ImportError as exc:
        raise SystemExit(
            f"error: --otlp-traces-endpoint needs the OpenTelemetry packages ({exc}): "
            "pip install '.[tracing]'") from None
    return Tracing(cfg.otlp_traces_endpoint, cfg.otlp_traces_sample_ratio)


def _nodelay_socket_factory(addr_info) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setblocking(False)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Gateway:
    """Everything one gateway process holds; built in `start()` inside the running loop."""

    def __init__(self, cfg: RouterConfig, served_ssl: ssl.SSLContext | None = None) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.stats = Stats()
        inline = inline_keys(cfg.api_keys)
        from_file = load_api_keys(cfg.api_key_file) if cfg.api_key_file else []
        self.keys = KeyChecker(inline + from_file)
        # The key file is re-read while the gateway runs (router/key_reload.py).
        self.key_watcher = (KeyFileWatcher(cfg.api_key_file, inline, from_file, self.keys,
                                           self.metrics.registry)
                            if cfg.api_key_file else None)
        # As the API keys: a byte of ROUTER_ADMIN_TOKEN that is not UTF-8 was a traceback here.
        self.admin_token = key_bytes(cfg.admin_token) if cfg.admin_token else None
        self.queue = AdmissionQueue(cfg.max_queue_size, cfg.queue_ms_per_prompt_token, cfg.queue_askers,
                                    cfg.fair_share, cfg.fair_output_token_weight)
        # Every request in line, not only those asking the scheduler (the head, by default).
        self.metrics.queued.set_function(lambda: self.queue.size)
        self.metrics.queued_flows.set_function(lambda: self.queue.waiting_flows)
        self.fallback = FallbackRouter(cfg.worker_urls, cfg.fallback_cooldown_ms / 1000)
        # https:// upstreams are checked against the CA bundles given (else the system's CAs),
        # and shown the client certificate, if any. Raises TlsError for files that do not load.
        self.worker_tls = PeerContext(client_context(cfg.worker_ca_file, cfg.ssl_client_certfile,
                                                     cfg.ssl_client_keyfile))
        self.scheduler_tls = PeerContext(client_context(cfg.scheduler_ca_file, cfg.ssl_client_certfile,
                                                        cfg.ssl_client_keyfile,
                                                        ca_option="--scheduler-ca-file"))
        # Renewed certificates and CA bundles are loaded while it runs (scheduler/tls_reload.py):
        # a reload puts fresh contexts in these two, which every call reads as it is made.
        self.tls = tls_reloader(cfg, served_ssl, [
            ("workers", self.worker_tls, cfg.worker_ca_file, "--worker-ca-file"),
            ("the scheduler", self.scheduler_tls, cfg.scheduler_ca_file, "--scheduler-ca-file")])
        if self.tls is not None:
            self.metrics.registry.register(self.tls.collector("router"))
        # Before anything starts: a tracing set-up that cannot load stops start-up at once.
        self.tracing = load_tracing(cfg)
        self.session: aiohttp.ClientSession | None = None
        self.client: SchedulerClient | None = None
        self.sched: Scheduling | None = None
        self.proxy: Proxy | None = None
        self.ws_sessions = WsSessions()
        self._tasks: list[asyncio.Task] = []
        self._models_cache: tuple[float, bytes] | None = None

    async def start(self, _app: web.Application | None = None) -> None:
        cfg = self.cfg
        # No ssl= here: each call to a worker passes worker_tls's context in force then.
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=30, socket_factory=_nodelay_socket_factory,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        # This process's name to the scheduler, which ends its leases once it is gone (a crash:
        # scheduler/gateways.py); new at every start, so a restarted gateway is another one.
        instance = new_instance_id()
        if cfg.scheduler:
            self.client = SchedulerClient(cfg.scheduler, timeout_s=cfg.scheduler_timeout_ms / 1000,
                                          token=cfg.scheduler_token, tls=self.scheduler_tls,
                                          instance=instance)
        self.sched = Scheduling(
            self.client,
            self.fallback,
            self.queue,
            self.metrics,
            wait_schedule_timeout_s=cfg.wait_schedule_timeout_ms / 1000,
            try_period_s=cfg.wait_schedule_try_period_ms / 1000,
            probe_period_s=cfg.scheduler_probe_ms / 1000,
            schedule_wait_ms=cfg.schedule_wait_ms,
            followup_pass_s=cfg.followup_pass_ms / 1000,
            workers_refresh_s=cfg.workers_refresh_ms / 1000,
            lease_renew_s=cfg.lease_renew_ms / 1000,
        )
        if self.client is not None and cfg.scheduler_pipelining:
            self.sched.pipe = SchedulerPipe(
                cfg.scheduler, timeout_s=cfg.scheduler_timeout_ms / 1000, channel=cfg.scheduler_channel,
                token=cfg.scheduler_token, tls=self.scheduler_tls, instance=instance,
            )
        self.sched.start(self.session, self.worker_tls)
        if self.key_watcher is not None:
            await self.key_watcher.start()
            if cfg.api_key_reload_s > 0:
                self._tasks.append(asyncio.get_running_loop().create_task(
                    self.key_watcher.poll(cfg.api_key_reload_s)))
        if self.tls is not None:
            await self.tls.start()
            if cfg.ssl_reload_s > 0:
                self._tasks.append(asyncio.get_running_loop().create_task(self.tls.poll(cfg.ssl_reload_s)))
        self.proxy = Proxy(cfg, self.sched, self.metrics, self.stats, self.keys, self.session,
                           self.worker_tls)
        self.proxy.tracing = self.tracing
        if cfg.access_log:
            self.proxy.access_log = AccessLog()
            self._tasks.append(asyncio.get_running_loop().create_task(self.proxy.access_log.run()))
        self._tasks.append(
            asyncio.get_running_loop().create_task(
                stats_loop(self.stats, self._gauges, cfg.log_stats_interval)
            )
        )

    async def stop(self, _app: web.Application | None = None) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sched is not None:
            await self.sched.stop()
        if self.client is not None:
            await self.client.close()
        if self.session is not None:
            await self.session.close()
        if self.tracing is not None:
            # Last: every request has ended by now (aiohttp's shutdown ran before this
            # cleanup), so its spans are in the batch processor's queue.
            await self.tracing.close(TRACES_FLUSH_S)

    def _gauges(self) -> tuple[int, int, bool]:
        in_flight = int(self.metrics.in_flight.value)
        return in_flight, self.queue.size, bool(self.sched and self.sched.fallback_active)

    # ---- handlers ------------------------------------------------------------------------
    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.handle(request)

    async def handle_ws(self, request: web.Request) -> web.StreamResponse:
        return await handle_ws(self.proxy, request, self.ws_sessions)

    async def handle_models(self, request: web.Request) -> web.Response:
        if not self.keys.allows(request.headers.get("Authorization")):
            return error_response(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )
        now = time.monotonic()
        if self._models_cache is None or now - self._models_cache[0] > self.cfg.models_cache_ms / 1000:
            models = await self.sched.models(self.cfg.models_cache_ms / 1000)
            created = int(time.time())
            body = json.dumps(
                {
                    "object": "list",
                    "data": [
                        {"id": m, "object": "model", "created": created, "owned_by": "llm-router"}
                        for m in models
                    ],
                }
            ).encode()
            self._models_cache = (now, body)
        model_id = request.match_info.get("model_id")
        if model_id is not None:
            for m in json.loads(self._models_cache[1])["data"]:
                if m["id"] == model_id:
                    return web.json_response(m)
            return error_response(
                404, f"model {clip_repr(model_id)} is not served here", code="model_not_found", param="model"
            )
        return web.Response(body=self._models_cache[1], content_type="application/json")

    def _admin_ok(self, request: web.Request) -> bool:
        if self.admin_token is None:
            return True
        import hmac

        from router.auth import bearer_token

        token = bearer_token(request.headers.get("Authorization"))
        return token is not None and hmac.compare_digest(token, self.admin_token)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        if not self._admin_ok(request):
            return error_response(401, "invalid or missing admin token", "authentication_error")
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def handle_health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "mode": "fallback" if self.sched.fallback_active else "scheduled"}
        )

    async def handle_state(self, request: web.Request) -> web.Response:
        if not self._admin_ok(request):
            return error_response(401, "invalid or missing admin token", "authentication_error")
        s = self.sched
        return web.json_response(
            {
                "mode": "fallback" if s.fallback_active else "scheduled",
                "scheduler": self.cfg.scheduler,
                "scheduler_down_for_s": (time.monotonic() - s.down_since)
                if s.down_since is not None
                else None,
                "last_switch_s": s.last_switch_s,
                "queued": self.queue.size,
                "queued_flows": self.queue.waiting_flows,
                **self.queue.fair_state(),
                "in_flight": self._gauges()[0],
                "fallback_workers": [
                    {
                        "worker_id": w.worker_id,
                        "url": w.url,
                        "models": sorted(w.models) if w.models else None,
                        "resting_s": max(0.0, w.down_until - time.monotonic()),
                        "cordoned": w.cordoned,  # the scheduler's last word (a socket there leaves)
                    }
                    for w in self.fallback.workers
                ],
            }
        )


# After --shutdown-timeout, how long aiohttp waits for a handler before it cancels it (it
# waits up to twice this).
CUT_AFTER_DEADLINE_S = 0.5


# vLLM's endpoints outside /v1 (pooling, tokenizer): any method, so that another than POST gets
# the proxy's 405 in the OpenAI shape, as on /v1/embeddings.
_ROOT_ROUTE = "/{root:" + "|".join(sorted(p.lstrip("/") for p in ROOT_PATHS)) + "}"


def build_app(gw: Gateway) -> web.Application:
    cfg = gw.cfg
    app = web.Application(client_max_size=cfg.max_body_bytes + 1)
    if cfg.cors_origins:
        CorsPolicy(cfg.cors_origins).install(app)
    app.on_startup.append(gw.start)
    app.on_cleanup.append(gw.stop)
    prefixes = [""] + ([cfg.base_path] if cfg.base_path else [])
    for p in prefixes:
        app.router.add_get(p + "/v1/models", gw.handle_models)
        app.router.add_get(p + "/v1/models/{model_id}", gw.handle_models)
        app.router.add_get(p + "/v1/ws", gw.handle_ws)
        app.router.add_route("*", p + "/v1/{tail:.+}", gw.handle_proxy)
        app.router.add_route("*", p + _ROOT_ROUTE, gw.handle_proxy)
        app.router.add_get(p + "/health", gw.handle_health)
    app.router.add_get("/admin/state", gw.handle_state)
    if cfg.allow_metrics and cfg.metrics_port is None:
        app.router.add_get("/metrics", gw.handle_metrics)
    # Last, so it only sees what no route above took: clients get the OpenAI error shape, not
    # aiohttp's plain-text 404 / 405 (or the redirect of a trailing slash, slash_redirect.py).
    # Any character (`(?s:.*)`): `.*` stops at a newline, and a path with an escaped one (%0a)
    # got the plain-text 404.
    app.router.add_route("*", "/{tail:(?s:.*)}", unrouted)
    return app


def build_metrics_app(gw: Gateway) -> web.Application:
    app = web.Application()
    app.router.add_get("/metrics", gw.handle_metrics)
    return app


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def _reload_on_sighup(gw: Gateway) -> bool:
    """SIGHUP re-reads the key file and the TLS files at once (an operator's `kill -HUP`, a
    config reloader's signal). Only the main thread takes signals: a gateway served from another
    one does not."""
    reloaders = [r for r in (gw.key_watcher, gw.tls) if r is not None]
    if not reloaders:
        return False  # SIGHUP as before: it ends the process

    def on_sighup() -> None:
        for reloader in reloaders:
            reloader.on_sighup()

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled."""
    try:  # first: a certificate, key or CA file that does not load stops start-up at once
        server_ssl = server_context(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs, cfg.ssl_cert_reqs)
        gw = Gateway(cfg, server_ssl)
    except TlsError as exc:
        raise SystemExit(f"error: {exc}") from None
    # The open-file limit raised before anything opens connections. Each client request holds
    # a connection to its worker too (2 descriptors): at the default cap, the gateway's own
    # connections still get theirs, so requests in flight are not lost to EMFILE.
    budget = connection_budget(cfg.max_connections, 2)
    app = build_app(gw)
    # Before the port opens: a SIGHUP sent once /health answers must not end the process.
    sighup = _reload_on_sighup(gw)
    # aiohttp's shutdown only cuts what the deadline below left (see router/in_flight.py).
    receive_timeout_s = cfg.request_receive_timeout_ms / 1000  # the head's; the body's: request_checks.py
    keepalive_s = cfg.keepalive_timeout_s  # idle kept-alive connections: scheduler/connection_limit.py
    runner = OpenAIErrorAppRunner(app, handler_cancellation=True, access_log=None,
                                  shutdown_timeout=CUT_AFTER_DEADLINE_S, receive_timeout_s=receive_timeout_s,
                                  keepalive_timeout=keepalive_s, max_connections=budget.max_connections,
                                  **HEADER_LIMITS)
    gw.metrics.registry.register(runner.connections.collector("router"))
    runners = [runner]
    port = cfg.port
    try:
        await runner.setup()  # gw.start: a --tokenizer that does not load ends start-up here
        site = web.TCPSite(runner, cfg.host, cfg.port, backlog=2048, ssl_context=server_ssl)
        await site.start()
        if cfg.allow_metrics and cfg.metrics_port is not None:
            port = cfg.metrics_port
            # Not under the API port's cap: an overloaded gateway can still be scraped.
            mrunner = OpenAIErrorAppRunner(build_metrics_app(gw), access_log=None,
                                           receive_timeout_s=receive_timeout_s, keepalive_timeout=keepalive_s)
            runners.append(mrunner)
            await mrunner.setup()
            # In TLS as well: a scraper's --admin-token must not cross the network in clear.
            await web.TCPSite(mrunner, cfg.host, cfg.metrics_port, ssl_context=server_ssl).start()
    except (OSError, SystemExit) as exc:
        # One line and out: a port in use or a host that does not resolve was a traceback, and
        # the sessions gw.start opened were logged as unclosed after the message.
        for r in runners:
            await r.cleanup()
        if sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if isinstance(exc, SystemExit):
            await gw.stop()  # a startup that failed has no cleanup of its own
            raise
        raise SystemExit(f"error: cannot listen on {cfg.host}:{port}: {exc.strerror or exc}") from None
    log.info(
        "gateway listening on %s://%s:%d%s (scheduler %s, %d static workers)",
        scheme(server_ssl),
        cfg.host,
        cfg.port,
        cfg.base_path,
        cfg.scheduler or "none",
        len(cfg.worker_urls),
    )
    log.info("%s", budget.describe())
    if not gw.keys.enabled and not _loopback(cfg.host):
        # Not refused (a proxy in front may authenticate), but said: every client that reaches
        # this address can use the workers.
        log.warning("no API keys (--api-key-file, ROUTER_API_KEYS) and listening on %s, not "
                    "loopback: any client that reaches it is served", cfg.host)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        # Stopping: no new connections; WebSockets are sent away once their answers are out
        # while the requests in flight finish, both within --shutdown-timeout: one deadline,
        # not one after the other, or a busy socket and a long stream outlast the
        # orchestrator's grace period and are killed instead of cut. Then aiohttp's shutdown
        # cuts what is left and closes the connections.
        await site.stop()
        busy_requests = gw.proxy.in_flight.count if gw.proxy else 0
        if busy_requests or gw.ws_sessions.open:
            # Said at once, as the workers say it: an operator watching a stop that takes up to
            # --shutdown-timeout sees what it waits for, not silence until the deadline.
            log.info("shutting down: %d request(s) and %d WebSocket(s) in flight, waiting up to "
                     "%g s for them", busy_requests, len(gw.ws_sessions.open), cfg.shutdown_timeout)
        else:
            log.info("shutting down: nothing in flight")
        ws_left, requests_left = await asyncio.gather(
            gw.ws_sessions.drain(cfg.shutdown_timeout),
            gw.proxy.in_flight.wait_done(cfg.shutdown_timeout) if gw.proxy else asyncio.sleep(0, 0),
        )
        if requests_left and gw.proxy:
            await gw.proxy.in_flight.cut()  # each gets a `shutting_down` it can retry on
        if ws_left or requests_left:
            log.warning("%d WebSocket(s) and %d request(s) still busy after --shutdown-timeout %.0f s: cut",
                        ws_left, requests_left, cfg.shutdown_timeout)
        for r in reversed(runners):
            await r.cleanup()
        if sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
