"""A TCP relay on 127.0.0.1 whose connections a test can cut, and refuse for a while: what a
network fault does to a gateway's channel to its scheduler. Runs its own event loop in a
thread, so that the test's blocking calls (httpx, time.sleep) do not stall it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from tests.router.procs import free_port


class CutProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.refusing = False  # new connections are accepted and closed at once
        self.accepted = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self._open -= {writer, up_writer}

    def cut(self) -> int:
        """Reset every connection open through it (both ends); how many were open. From the
        test's thread, or the proxy's own."""
        if threading.current_thread() is self._thread:
            return self._cut_all()

        async def cut_all() -> int:
            return self._cut_all()
        return asyncio.run_coroutine_threadsafe(cut_all(), self._loop).result(5)

    def _cut_all(self) -> int:
        n = len(self._open)
        for w in list(self._open):
            w.transport.abort()
        return n

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def cut_proxy(target_port: int) -> Iterator[CutProxy]:
    proxy = CutProxy(target_port)
    proxy._thread.start()
    if not proxy._ready.wait(10):
        raise RuntimeError("the proxy did not start")
    try:
        yield proxy
    finally:
        async def shut() -> None:
            proxy._server.close()
            proxy.cut()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), proxy._loop).result(5)
        proxy._loop.call_soon_threadsafe(proxy._loop.stop)
        proxy._thread.join(5)
