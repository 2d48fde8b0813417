"""python -m router --port 8000 --scheduler http://127.0.0.1:8090 [--workers URL,...] ..."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from router.app import serve
from router.config import load_router_config


def main(argv: list[str] | None = None) -> None:
    cfg = load_router_config(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

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
