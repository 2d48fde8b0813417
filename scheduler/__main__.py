"""python -m scheduler --host 127.0.0.1 --port 8090 --workers URL,... --policy llm_aware"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from scheduler.admin_auth import AdminTokenFile
from scheduler.app import build_app, connection_error
from scheduler.config import SchedulerConfig, load_scheduler_config
from scheduler.connection_limit import connection_budget
from scheduler.cordon_file import CordonFileError
from scheduler.discovery.static import add_static_workers
from scheduler.gateway_auth import TokenRef
from scheduler.http_errors import OpenAIErrorAppRunner
from scheduler.scrape.scraper import Scraper
from scheduler.service import SchedulerService
from scheduler.tls import PeerContext, TlsError, client_context, scheme, server_context
from scheduler.tls_reload import tls_reloader

log = logging.getLogger("scheduler")


async def serve(cfg: SchedulerConfig) -> None:
    try:  # first: a certificate that cannot be used stops start-up before anything runs
        server_ssl = server_context(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs, cfg.ssl_cert_reqs)
        worker_tls = PeerContext(client_context(cfg.worker_ca_file, cfg.ssl_client_certfile,
                                                cfg.ssl_client_keyfile))
    except TlsError as exc:
        raise SystemExit(f"error: {exc}") from None
    # The open-file limit raised before anything opens files or connections. Its own calls are
    # a few per worker (scrapes, health checks): the reserve covers tens of workers; with more
    # and a small hard limit, set --max-connections.
    budget = connection_budget(cfg.max_connections, 1)
    service = SchedulerService(cfg)
    try:  # before anything decides: no request may reach a worker an operator cordoned
        service.restore_cordons()
    except CordonFileError as exc:  # fail closed: its workers would be back in rotation
        raise SystemExit(f"error: {exc}") from None
    admin_token = TokenRef(cfg.admin_token)
    token_file = AdminTokenFile(cfg.admin_token_file, admin_token) if cfg.admin_token_file else None
    if token_file is not None:
        token_file.load()  # a file that holds something else than a token stops start-up here
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []
    # Renewed certificates are loaded while it runs (scheduler/tls_reload.py), and the admin
    # token file re-read (scheduler/admin_auth.py); SIGHUP does both at once, set before the
    # port opens: one sent once /health answers must not end it.
    tls = tls_reloader(cfg, server_ssl, [("workers", worker_tls, cfg.worker_ca_file, "--worker-ca-file")])
    if tls is not None:
        service.metrics.registry.register(tls.collector("scheduler"))
        await tls.start()
        if cfg.ssl_reload_s > 0:
            tasks.append(asyncio.create_task(tls.poll(cfg.ssl_reload_s), name="tls-reload"))
    if token_file is not None:
        service.metrics.registry.register(token_file)  # its metrics: none without a file
        if cfg.admin_token_reload_s > 0:
            tasks.append(asyncio.create_task(token_file.poll(cfg.admin_token_reload_s),
                                             name="admin-token-reload"))
    reloaders = [r for r in (tls, token_file) if r is not None]
    if reloaders:  # else SIGHUP ends it, as before
        def on_sighup() -> None:
            for reloader in reloaders:
                reloader.on_sighup()

        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, on_sighup)
    add_static_workers(service, cfg.worker_urls)
    scraper = Scraper(service, tls=worker_tls)
    await scraper.start()
    tasks.append(asyncio.create_task(scraper.run(), name="scraper"))
    if cfg.k8s_namespace:
        from scheduler.discovery.kubernetes import KubernetesDiscovery

        tasks.append(asyncio.create_task(KubernetesDiscovery(service, cfg).run(), name="k8s"))
    # handler_cancellation: a held /v1/schedule whose caller disconnects stops holding.
    # Malformed HTTP (a URL or header over 8 KiB, a bad method) in the OpenAI error shape.
    # A request head not complete within --request-receive-timeout-ms closes its connection (a
    # body's: scheduler/app.py read_body). Idle kept-alive connections and how many are served:
    # scheduler/connection_limit.py.
    runner = OpenAIErrorAppRunner(build_app(service, admin_token), answer=connection_error,
                                  log=logging.getLogger("scheduler.http"), access_log=None,
                                  handler_cancellation=True,
                                  receive_timeout_s=cfg.request_receive_timeout_ms / 1000,
                                  keepalive_timeout=cfg.keepalive_timeout_s,
                                  max_connections=budget.max_connections)
    service.metrics.registry.register(runner.connections.collector("scheduler"))
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True, ssl_context=server_ssl)
    try:
        await site.start()
    except OSError as exc:  # a port in use, a host that does not resolve or is not this machine's
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await scraper.stop()
        await runner.cleanup()
        raise SystemExit(f"error: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
    port = site._server.sockets[0].getsockname()[1] if site._server else cfg.port
    log.info("scheduler listening on %s://%s:%d policy=%s workers=%d", scheme(server_ssl), cfg.host, port,
             cfg.policy, len(cfg.worker_urls))
    log.info("%s", budget.describe())
    print(f"scheduler ready on {scheme(server_ssl)}://{cfg.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await scraper.stop()
    await runner.cleanup()
    if service.cordon_file is not None:
        await service.cordon_file.close()  # a change made just before the stop is kept


def main(argv: list[str] | None = None) -> None:
    cfg = load_scheduler_config(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2"):  # lightkube's client: a line per watch call
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
