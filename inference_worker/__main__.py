"""`python -m inference_worker ...`: build the engine, publish its stats, serve the API.

Start-up: load `WorkerConfig` (CLI > env > YAML), build the engine
(`engine.factory.build_engine`), attach the Prometheus and log-line stat loggers,
start the engine thread, listen, and then (with `--register-with`) register with
the scheduler. SIGINT/SIGTERM: deregister, stop accepting connections, let the requests in
flight finish for up to --shutdown-timeout seconds (new ones on open connections get 503
`shutting_down`, which routers retry elsewhere), end what is left with that 503 (a second
signal does so at once), close the connections and stop the engine thread. With TLS files,
renewed ones are loaded for new connections (every --ssl-reload-s, and at once on SIGHUP;
server/tls_reload.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import sys

from aiohttp import web
from prometheus_client import CollectorRegistry

from inference_worker.config import WorkerConfig, load_worker_config
from inference_worker.engine.errors import EngineShutdownError
from inference_worker.metrics.log_line import LoggingStatLogger
from inference_worker.metrics.prometheus import PrometheusStatLogger
from inference_worker.registration import Registrar
from inference_worker.server.app import HEADER_LIMITS, build_app
from inference_worker.server.connection_limit import connection_budget
from inference_worker.server.drain import Drain
from inference_worker.server.http_errors import OpenAIErrorAppRunner
from inference_worker.server.state import DRAIN
from inference_worker.server.tls import PeerContext, TlsError, client_context, scheme, server_context
from inference_worker.server.tls_reload import tls_reloader

log = logging.getLogger("inference_worker")


async def _build_engine(config: WorkerConfig):
    from inference_worker.engine.factory import build_engine

    if inspect.iscoroutinefunction(build_engine):
        return await build_engine(config)
    # Loading a model takes seconds: keep the loop free (signals still work meanwhile).
    return await asyncio.to_thread(build_engine, config)


def attach_stat_loggers(engine, config: WorkerConfig, registry: CollectorRegistry) -> PrometheusStatLogger:
    gpu_memory = getattr(engine, "gpu_memory", None)
    prometheus = PrometheusStatLogger(
        registry,
        model_name=config.model_name,
        max_model_len=engine.max_model_len,
        cache_config=engine.cache_info,
        show_legacy=not config.hide_legacy_metrics,
        gpu_memory=gpu_memory if gpu_memory is not None and gpu_memory() is not None else None,
    )
    engine.add_stat_logger(prometheus)
    engine.add_stat_logger(LoggingStatLogger())
    if config.backend == "sim":  # how far the host's CPU slowed the modelled GPU
        from inference_worker.sim.metrics import SimTimelineCollector

        labels = {"engine": "0", "model_name": config.model_name}
        registry.register(SimTimelineCollector(engine.engine.runner.stats, labels))
    return prometheus


async def _start_registrar(config: WorkerConfig, max_running: int,
                           tls: PeerContext) -> Registrar | None:
    """Register with the scheduler (--register-with); start() returns at once and keeps
    retrying and heart-beating in the background."""
    if not config.register_with:
        return None
    registrar = Registrar(config, max_running=max_running, tls=tls)
    await registrar.start()
    return registrar


async def run_worker(config: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    try:  # before the engine loads (up to minutes): a file that cannot be used stops start-up now
        server_ssl = server_context(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs,
                                    config.ssl_cert_reqs)
        scheduler_tls = PeerContext(client_context(config.scheduler_ca_file, config.ssl_client_certfile,
                                                   config.ssl_client_keyfile))
    except TlsError as exc:
        raise SystemExit(f"error: {exc}") from None
    # The open-file limit raised before the model's files are opened. A worker opens few
    # connections of its own: the reserve covers them and the GPU driver's device files.
    budget = connection_budget(config.max_connections, 1)
    try:
        engine = await _build_engine(config)
    except (ValueError, OSError) as exc:  # bad --model / --sim-profile / sizes: one line, no traceback
        raise SystemExit(f"error: cannot start the engine: {exc}") from None
    registry = CollectorRegistry()
    attach_stat_loggers(engine, config, registry)
    await engine.start()
    receive_timeout_s = config.request_receive_timeout_ms / 1000  # a request's head and body
    app = build_app(engine, config.model_name, registry, config.responses_store_size, receive_timeout_s)
    # The drain below waits for the requests; what aiohttp then waits for is their last writes.
    # Idle kept-alive connections and how many are served: server/connection_limit.py.
    runner = OpenAIErrorAppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                                  receive_timeout_s=receive_timeout_s, max_connections=budget.max_connections,
                                  keepalive_timeout=config.keepalive_timeout_s, **HEADER_LIMITS)
    registry.register(runner.connections.collector("worker"))  # not vLLM's names: no clash
    await runner.setup()
    registrar = None
    site = None
    # Renewed certificates are loaded while it serves (server/tls_reload.py); SIGHUP loads them
    # at once, set before the port opens: one sent once /health answers must not end it.
    tls = tls_reloader(config, server_ssl, [("the scheduler", scheduler_tls, config.scheduler_ca_file,
                                             "--scheduler-ca-file")])
    tls_poll: asyncio.Task | None = None
    if tls is not None:
        registry.register(tls.collector("worker"))
        await tls.start()
        if config.ssl_reload_s > 0:
            tls_poll = loop.create_task(tls.poll(config.ssl_reload_s))
        loop.add_signal_handler(signal.SIGHUP, tls.on_sighup)
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=2048, ssl_context=server_ssl)
        try:
            await site.start()
        except OSError as exc:
            raise SystemExit(f"error: cannot listen on {config.host}:{config.port}: {exc.strerror}") from None
        log.info(
            "serving model %s (backend %s) on %s://%s:%d",
            config.model_name,
            config.backend,
            scheme(server_ssl),
            config.host,
            config.port,
        )
        log.info("%s", budget.describe())
        registrar = await _start_registrar(config, engine.max_num_seqs, scheduler_tls)
        await stop.wait()
        drain = app[DRAIN]
        drain.begin()
        log.info("shutting down: %d requests in flight, waiting up to %g s for them",
                 drain.owed, config.shutdown_timeout)
    finally:
        if registrar is not None:  # deregister first, so no new traffic is routed here
            with contextlib.suppress(Exception):
                await asyncio.wait_for(registrar.stop(), timeout=5.0)
        if site is not None and stop.is_set():
            await _drain(app[DRAIN], site, engine, config.shutdown_timeout, hurry)
        if tls_poll is not None:
            tls_poll.cancel()
        await runner.cleanup()
        await engine.shutdown()


async def _drain(drain: Drain, site: web.TCPSite, engine, limit_s: float, hurry: asyncio.Event) -> None:
    """Refuse new connections (kept-alive ones close after their next answer, see
    server/app.py, so the scheduler's scrapes soon fail and it routes elsewhere), let the
    requests taken finish, and past `limit_s` end the rest with a 503 `shutting_down` error:
    a clean end of each stream, not a cut connection. (aiohttp's own pre-shutdown would also
    stop reading the WebSockets, whose clients could then neither cancel nor close.)"""
    await site.stop()
    if await drain.wait_answered(limit_s, hurry):
        log.info("every request in flight was answered")
        return
    ended = engine.fail_all(EngineShutdownError("The worker shut down before the request finished."))
    log.warning("ended %d requests still in flight (--shutdown-timeout %g s)", ended, limit_s)
    await drain.wait_answered(2.0)  # the handlers write those errors


def main(argv: list[str] | None = None) -> None:
    config = load_worker_config(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        import uvloop
    except ImportError:  # not on Windows
        asyncio.run(run_worker(config))
    else:
        uvloop.run(run_worker(config))


if __name__ == "__main__":
    main()
