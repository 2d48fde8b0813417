"""python -m router --port 8000 --scheduler http://127.0.0.1:8090 [--workers URL,...] ..."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp.http_exceptions import HttpProcessingError

from router.app import serve
from router.config import load_router_config


class MalformedHttpFilter(logging.Filter):
    """aiohttp answers a request it cannot parse (a control byte in a header, a Content-Length
    that is no number: what scanners and broken proxies send, no HTTP client library) with its own
    400 and logs it at ERROR with a traceback. On a gateway facing the internet that is log noise
    whoever scans it controls: one WARNING line says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = (str(exc.message).splitlines() or [""])[0].rstrip(":")
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "malformed HTTP request from %s: %s", (*(record.args or ()), reason)
            record.exc_info = record.exc_text = None
        return True


def main(argv: list[str] | None = None) -> None:
    cfg = load_router_config(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.server").addFilter(MalformedHttpFilter())

    async def run() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(cfg)
        except asyncio.CancelledError:
            pass

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(run())
    else:
        uvloop.run(run())


if __name__ == "__main__":
    main()
