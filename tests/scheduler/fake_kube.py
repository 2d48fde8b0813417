"""A stand-in Kubernetes API server: no cluster runs here, so the EndpointSlice list and
watch are served by this local aiohttp server from recorded watch events
(fixtures/k8s_endpointslices_watch.json, in the API server's watch-stream format:
one JSON {"type", "object"} per line).

Like the real one, it ends a watch after the `timeoutSeconds` the client asks for (a normal
end: the client resumes from the last resourceVersion it saw). `stall()` models a watch
connection that died without a close (a load balancer's idle drop, a lost node): the open
watches stay open and silent, and their timeout never reaches the client either.

Like the real one it keeps a resourceVersion: the first `initial` events have happened
before the test starts (a list shows their result; a watch from the list's version sends
nothing for them); the test releases the rest one at a time on the open watch, or
applies one while no watch can see it and compacts history, so that a watch resuming
from an older version gets 410 Gone, as after an etcd compaction.
"""

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
        self.slices: dict[str, dict] = {}  # name -> object: the current state
        self.version = 0
        self.compacted = 0  # watches from an older version get 410 Gone
        for event in self.events[:initial]:
            self._apply(event)
        self._later = list(self.events[initial:])
        self.streams: list[asyncio.Queue] = []
        self.stalled: set[int] = set()  # ids of the streams that are silent for good
        self._closing = asyncio.Event()
        self.requests: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _apply(self, event: dict) -> None:
        self.version += 1
        event["object"]["metadata"]["resourceVersion"] = str(self.version)
        name = event["object"]["metadata"]["name"]
        if event["type"] == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = event["object"]

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def release_next(self) -> None:
        """The next recorded event happens, and open watches see it."""
        event = self._later.pop(0)
        self._apply(event)
        for stream in self.streams:
            if id(stream) not in self.stalled:
                stream.put_nowait(event)

    def stall(self) -> None:
        """The open watches' connections die silently: nothing more reaches their client."""
        self.stalled.update(id(stream) for stream in self.streams)

    def apply_next_unseen(self) -> None:
        """The next recorded event happens while the watches are cut off and history is
        compacted: only a fresh list can tell the scheduler about it."""
        self._apply(self._later.pop(0))
        self.compacted = self.version
        for stream in self.streams:
            if id(stream) not in self.stalled:
                stream.put_nowait(None)  # end that stream

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(str(request.rel_url))
        if request.query.get("watch") != "true":
            return web.json_response({
                "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": list(self.slices.values()),
            })
        since = int(request.query.get("resourceVersion") or 0)
        if since < self.compacted:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "reason": "Expired", "code": 410,
                                      "message": "too old resource version"}, status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since == 0:  # no version: the current state first, as ADDED events
            for obj in self.slices.values():
                await resp.write((json.dumps({"type": "ADDED", "object": obj}) + "\n").encode())
        stream: asyncio.Queue = asyncio.Queue()
        self.streams.append(stream)
        timeout = float(request.query.get("timeoutSeconds") or 0) or None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while True:
                left = None if deadline is None else deadline - loop.time()
                try:
                    event = await asyncio.wait_for(stream.get(), left)
                except TimeoutError:
                    if id(stream) in self.stalled:
                        await self._closing.wait()  # the close is lost too: silent till stop()
                    break  # the server's timeout: a normal end
                if event is None:
                    break
                await resp.write((json.dumps(event) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.streams.remove(stream)
            self.stalled.discard(id(stream))
        return resp

    async def stop(self) -> None:
        # aiohttp does not cancel a handler whose client left: end the open watches, or the
        # cleanup waits its whole shutdown timeout for them.
        self._closing.set()
        for stream in self.streams:
            stream.put_nowait(None)
        if self.runner is not None:
            await self.runner.cleanup()
