"""`python -m inference_worker ...`: build the engine, publish its stats, serve the API.

Start-up: load `WorkerConfig` (CLI > env > YAML), build the engine
(`engine.factory.build_engine`), attach the Prometheus and log-line stat loggers,
start the engine thread, listen, and then (with `--register-with`) register with
the scheduler. SIGINT/SIGTERM: deregister, stop accepting and close connections
(in-flight requests are aborted in the engine), stop the engine thread.
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
from inference_worker.metrics.log_line import LoggingStatLogger
from inference_worker.metrics.prometheus import PrometheusStatLogger
from inference_worker.registration import Registrar
from inference_worker.server.app import build_app

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
    return prometheus


async def _start_registrar(config: WorkerConfig, max_running: int) -> Registrar | None:
    """Register with the scheduler (--register-with); start() returns at once and keeps
    retrying and heart-beating in the background."""
    if not config.register_with:
        return None
    registrar = Registrar(config, max_running=max_running)
    await registrar.start()
    return registrar


async def run_worker(config: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    try:
        engine = await _build_engine(config)
    except (ValueError, OSError) as exc:  # bad --model / --sim-profile / sizes: one line, no traceback
        raise SystemExit(f"error: cannot start the engine: {exc}") from None
    registry = CollectorRegistry()
    attach_stat_loggers(engine, config, registry)
    await engine.start()
    app = build_app(engine, config.model_name, registry)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    registrar = None
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=2048)
        try:
            await site.start()
        except OSError as exc:
            raise SystemExit(f"error: cannot listen on {config.host}:{config.port}: {exc.strerror}") from None
        log.info(
            "serving model %s (backend %s) on http://%s:%d",
            config.model_name,
            config.backend,
            config.host,
            config.port,
        )
        registrar = await _start_registrar(config, engine.max_num_seqs)
        await stop.wait()
        log.info("shutting down")
    finally:
        if registrar is not None:  # deregister first, so no new traffic is routed here
            with contextlib.suppress(Exception):
                await asyncio.wait_for(registrar.stop(), timeout=5.0)
        await runner.cleanup()
        await engine.shutdown()


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
