"""A stand-in Kubernetes API server: no cluster runs here, so the EndpointSlice watch is
served by this local aiohttp server, which replays recorded watch events
(fixtures/k8s_endpointslices_watch.json, in the API server's watch-stream format:
one JSON {"type", "object"} per line). The first events are sent when the watch
opens; the test releases the rest one at a time."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

FIXTURE = Path(__file__).parent / "fixtures" / "k8s_endpointslices_watch.json"


class FakeKubeApi:
    def __init__(self, ports: dict[str, int], initial: int = 2) -> None:
        text = FIXTURE.read_text()
        for key, port in ports.items():
            text = text.replace(f'"{{{key}}}"', str(port))
        self.events = json.loads(text)
        self.initial = initial
        self.pending: asyncio.Queue = asyncio.Queue()
        self.requests: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self.watch)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._later = list(self.events[self.initial :])
        return self.url

    def release_next(self) -> None:
        """Send the next recorded event on the open watch."""
        self.pending.put_nowait(self._later.pop(0))

    async def watch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(str(request.rel_url))
        if request.query.get("watch") != "true":
            return web.json_response({"kind": "Status", "code": 400}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if len(self.requests) == 1:
            for event in self.events[: self.initial]:
                await resp.write((json.dumps(event) + "\n").encode())
        try:
            while True:
                event = await self.pending.get()
                await resp.write((json.dumps(event) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
