"""The WebSocket relay's request leases under races: a cancel while the socket moves, a
gateway that starts to stop while a request's lease is being asked for, a lease that comes
back after its answer ended. In-process fakes for the proxy (its scheduler calls gated on cue),
the worker's socket and the client's socket: these orders cannot be forced through processes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp

from router.access_log import RequestRecord
from router.scheduling import Route
from router.ws_leases import WsTurn
from router.ws_relay import _CANCELLED_HERE, KEY_REVOKED, WsRelay, turn_of
from router.ws_sessions import SHUTTING_DOWN, WsSession, WsSessions
from scheduler.tls import PeerContext

CHUNK = json.dumps({"choices": [{"index": 0, "text": " tok"}]}, separators=(",", ":"))
DONE = json.dumps({"type": "done", "id": "x"})


class FakeClient:
    def __init__(self) -> None:
        self.closed = False
        self.sent: list[str] = []
        self.close_code = None

    async def send_str(self, data: str) -> None:
        self.sent.append(data)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(repr(data))

    async def close(self, code: int = 1000, message: bytes = b"") -> None:
        self.closed = True
        self.close_code = code


class FakeUpstream:
    """The worker's socket: what the test puts in `inbox` comes out of `async for`."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list = []
        self.closed = False
        self.close_code = None

    async def send_str(self, data: str) -> None:
        self.sent.append(data)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    async def close(self) -> None:
        self.closed = True

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.inbox.get()
        if item is None:
            raise StopAsyncIteration
        kind, data = item
        return aiohttp.WSMessage(kind, data, None)


class FakeProxy:
    def __init__(self) -> None:
        self.cfg = SimpleNamespace(queue_timeout_ms=5000, retry_count=0, ws_heartbeat_s=30.0)
        self.worker_tls = PeerContext()
        self.released: list[tuple[str, bool, int, int, str | None]] = []
        self.issued: list[str] = []
        self.acquire_gate: asyncio.Event | None = None
        self.attach_gate: asyncio.Event | None = None
        self.upstreams: list[FakeUpstream] = []
        self.unreachable: set[str] = set()  # workers whose WebSocket cannot be connected to
        self._n = 0
        proxy = self

        class _Session:
            async def ws_connect(self, url, **kw):
                if any(f"//{w}/" in url for w in proxy.unreachable):
                    raise aiohttp.ClientConnectionError("refused")
                up = FakeUpstream()
                proxy.upstreams.append(up)
                return up

        class _Sched:
            leasing = True
            fallback = SimpleNamespace(is_cordoned=lambda worker_id: False)

            async def attach(self, body, bound, flow=""):
                if proxy.attach_gate is not None:
                    await proxy.attach_gate.wait()
                return proxy._lease(bound.worker_id)

        self.session = _Session()
        self.sched = _Sched()
        async def count_off_loop(text: str, ids: int = 0) -> int:
            return len(text) // 4

        self.tokens = SimpleNamespace(count=lambda text, ids=0: len(text) // 4,
                                      count_off_loop=count_off_loop)

    def _lease(self, worker_id: str) -> Route:
        self._n += 1
        lease = f"L{self._n}@{worker_id}"
        self.issued.append(lease)
        return Route(worker_id, "http://" + worker_id, lease, "p", {})

    async def _acquire(self, rec, body, exclude, deadline, pinned_url=None, priority=0):
        if self.acquire_gate is not None:
            await self.acquire_gate.wait()
        worker = next(w for w in ("A", "B", "C") if w not in exclude)
        return self._lease(worker)

    def _upstream_headers(self, *a):
        return {}

    def release_lease(self, route, ok, prompt, output, ttft_ms=None, error=None, handed_off=False):
        if route.lease_id is None or route.released:
            return
        route.released = True
        self.released.append((route.lease_id, ok, prompt, output, error))

    def _release(self, route, rec, ok, error=None, held_kv=True, handed_off=False):
        self.release_lease(route, ok, 0, 0, error=error)

    def _failed(self, route, reason, rec):  # as the proxy's: with the request's (socket's) totals
        self.release_lease(route, False, rec.prompt_tokens * rec.choices, rec.output_tokens, error=reason)

    def report_failed(self, route, reason, refused=False):
        pass

    def _prefilled(self, route):
        pass

    def settle_fair(self, rec):
        pass

    def open_leases(self) -> set[str]:
        return set(self.issued) - {r[0] for r in self.released}


async def make_relay():
    proxy = FakeProxy()
    client = FakeClient()
    session = WsSession(client)  # type: ignore[arg-type]
    sessions = WsSessions()
    sessions.add(session)
    rec = RequestRecord("ws1", "WS", "/v1/ws")
    rec.model = "m"
    body = {"model": "m", "prompt": "hello", "max_tokens": 8}
    first, _ = await turn_of(proxy, "m", json.dumps(body))  # type: ignore[arg-type]
    session.pending.append(first)
    relay = WsRelay(proxy, None, rec, session, sessions, first.sched_body, 0)  # type: ignore[arg-type]
    return proxy, client, session, sessions, relay


async def req(prompt: str) -> WsTurn:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8}
    turn, _ = await turn_of(FakeProxy(), "m", json.dumps(body))  # type: ignore[arg-type]
    return turn


async def test_a_cancel_while_the_socket_moves_gives_the_new_workers_lease_back():
    """Worker A refuses the only request owed and says 1001; while the relay places the socket
    on B (the scheduler call is slow), the client cancels that request, which is answered here.
    B's lease, asked for that request, went to a request no longer owed, and nobody released
    it: the idle socket counted as a request on B again."""
    proxy, client, session, _, relay = await make_relay()
    assert await relay.place([]) is None  # A, for the first request
    await relay.send_upstream(session.pending[0].data)
    relay.held, relay.outside = True, 1  # A refused it
    relay.upstream.close_code = aiohttp.WSCloseCode.GOING_AWAY
    proxy.acquire_gate = asyncio.Event()
    move = asyncio.ensure_future(relay._move())
    await asyncio.sleep(0.01)  # placing on B
    await relay.cancel('{"type": "cancel"}')
    assert client.sent[-1].startswith('{"type": "done"') and not session.pending
    proxy.acquire_gate.set()
    assert await move is True
    assert proxy.open_leases() == set()
    await relay.close()
    assert proxy.open_leases() == set()


async def test_a_request_is_owed_and_sent_before_its_lease_comes_back():
    """The request goes to the worker at once while its lease is asked for (a slow scheduler
    delays nothing), and is owed from its message on: a gateway that starts to stop meanwhile
    waits for its answer instead of closing the socket as idle. Its lease, back after the
    answer ended, is released with what the request held."""
    proxy, client, session, sessions, relay = await make_relay()
    assert await relay.place([]) is None
    relay.leases.end(session.pending.popleft())  # the first answer ended: the socket is idle
    proxy.attach_gate = asyncio.Event()
    turn = await req("second")
    await asyncio.wait_for(relay.send_request(turn), 1)  # not held up by the lease call
    assert relay.upstream.sent == [turn.data] and list(session.pending) == [turn]
    assert await sessions.drain(0.05) == 1  # busy: left open for its answer
    assert not client.closed
    turn.output_tokens = 3
    relay.leases.end(session.pending.popleft())
    proxy.attach_gate.set()
    await asyncio.sleep(0.01)
    assert proxy.released[-1] == (proxy.issued[-1], True, turn.prompt_tokens, 3, None)
    assert proxy.open_leases() == set()


async def test_a_lease_that_comes_back_after_its_request_moved_is_given_back():
    """The socket moved while a request's lease was being asked for on the worker it left:
    that lease holds nothing and goes back; the request is leased on the new worker."""
    proxy, _, session, _, relay = await make_relay()
    assert await relay.place([]) is None
    relay.leases.end(session.pending.popleft())
    proxy.attach_gate = asyncio.Event()
    turn = await req("second")
    await relay.send_request(turn)  # its lease on A is being asked for
    relay.upstream.close_code = aiohttp.WSCloseCode.GOING_AWAY
    proxy.attach_gate.set()  # A's and then B's answers come back at once
    assert await relay._move() is True
    await asyncio.sleep(0.01)
    assert turn.route is not None and turn.route.worker_id == "B"
    assert proxy.open_leases() == {turn.route.lease_id}
    await relay.close()
    assert proxy.open_leases() == set()


async def test_a_worker_that_cannot_be_connected_to_while_the_socket_moves_held_nothing():
    """The socket moves; the next worker cannot be connected to, and another takes the socket.
    The failed worker's lease was released with every token the socket had carried (the
    record's totals), which the scheduler settled into the tenant's counters a second time and
    credited as freed KV on a worker that never held any."""
    proxy, _, session, _, relay = await make_relay()
    proxy.cfg.retry_count = 1
    relay.rec.prompt_tokens, relay.rec.output_tokens = 500, 300  # what the socket carried so far
    assert await relay.place([]) is None  # A
    relay.leases.end(session.pending.popleft())
    await relay.send_request(await req("next"))
    await asyncio.sleep(0.01)  # its lease on A came back
    relay.upstream.close_code = aiohttp.WSCloseCode.GOING_AWAY
    proxy.unreachable.add("B")
    assert await relay._move() is True
    assert relay.route.worker_id == "C"
    failed = [r for r in proxy.released if r[0].endswith("@B")]
    assert failed == [(failed[0][0], False, 0, 0, "connect")]


# ---- the gateway's refusals in their turn (router/ws_relay.py refuse) --------------------
REFUSED_BY_WORKER = json.dumps({"error": {"message": "The worker is shutting down; send the request to "
                                          "another one.", "type": "invalid_request_error",
                                          "param": None, "code": "shutting_down"}})


def _counting_answers(proxy: FakeProxy) -> None:
    """What the relay calls as an answer ends (its log line, metrics, latencies): nothing here."""
    proxy.metrics = SimpleNamespace(request_done=lambda *a: None)  # type: ignore[attr-defined]
    proxy.access_log = None  # type: ignore[attr-defined]
    proxy.observe_answer = lambda *a: None  # type: ignore[attr-defined]
    proxy.stats = SimpleNamespace(add_ttft=lambda ms: None)  # type: ignore[attr-defined]


async def _sent(client: FakeClient, n: int) -> list[str]:
    """The client's messages once there are n (the relay's _down runs meanwhile)."""
    for _ in range(1000):
        if len(client.sent) >= n:
            return client.sent
        await asyncio.sleep(0.001)
    raise AssertionError(f"never {n} messages: {client.sent}")


async def test_a_held_requests_cancel_is_followed_by_the_refusals_owed_after_it():
    """An older worker refuses a request at once, while the answer before it streams (mixed
    versions in a rolling update): the relay holds it, and the answer streaming ends as usual.
    A refusal of the gateway's own that came after the held request waits for it: the client
    cancels the held request, and gets its `cancelled`, then the refusal."""
    proxy, client, session, _, relay = await make_relay()
    _counting_answers(proxy)
    assert await relay.place([]) is None
    await relay.send_upstream(session.pending[0].data)
    down = asyncio.ensure_future(relay._down())
    upstream = relay.upstream
    await upstream.inbox.put((aiohttp.WSMsgType.TEXT, CHUNK))
    second = await req("second")
    await relay.send_request(second)
    await upstream.inbox.put((aiohttp.WSMsgType.TEXT, REFUSED_BY_WORKER))  # at once, mid-answer
    await relay.refuse(KEY_REVOKED)  # the client's third request, after the key was revoked
    assert await _sent(client, 1) == [CHUNK]
    await upstream.inbox.put((aiohttp.WSMsgType.TEXT, DONE))
    assert await _sent(client, 2) == [CHUNK, DONE]  # the refused one is held, not passed on
    assert relay.held and relay.outside == 1 and list(session.pending) == [second]
    await relay.cancel('{"type": "cancel"}')
    assert client.sent == [CHUNK, DONE, _CANCELLED_HERE, KEY_REVOKED]
    assert session.refusals == 0 and not session.pending
    down.cancel()
    await asyncio.gather(down, return_exceptions=True)


async def test_refusals_owed_after_a_request_follow_its_answer_from_the_next_worker():
    """A worker refuses a request in its turn (after the answer before it) and says 1001: the
    socket moves with that request, and the refusal the gateway owes after it goes out after
    its answer from the next worker."""
    proxy, client, session, _, relay = await make_relay()
    _counting_answers(proxy)
    assert await relay.place([]) is None
    await relay.send_upstream(session.pending[0].data)
    down = asyncio.ensure_future(relay._down())
    first = relay.upstream
    second = await req("second")
    await relay.send_request(second)
    await relay.refuse(SHUTTING_DOWN)
    for message in (CHUNK, DONE, REFUSED_BY_WORKER):  # the first answer, then its refusal in turn
        await first.inbox.put((aiohttp.WSMsgType.TEXT, message))
    first.close_code = aiohttp.WSCloseCode.GOING_AWAY
    await first.inbox.put(None)
    for _ in range(1000):  # until the socket is on B with the held request
        if len(proxy.upstreams) == 2 and proxy.upstreams[1].sent:
            break
        await asyncio.sleep(0.001)
    assert proxy.upstreams[1].sent == [second.data]
    assert client.sent == [CHUNK, DONE]
    await proxy.upstreams[1].inbox.put((aiohttp.WSMsgType.TEXT, DONE))
    assert await _sent(client, 4) == [CHUNK, DONE, DONE, SHUTTING_DOWN]
    assert session.refusals == 0
    down.cancel()
    await asyncio.gather(down, return_exceptions=True)


async def test_a_stopping_gateway_sends_a_socket_away_after_its_refusals_owed():
    """A refusal owed keeps a socket from counting as idle: the gateway begins to stop while the
    answer's end is being sent (a slow client) with a refusal to follow it, and nothing is owed
    any more. Its drain leaves the socket open; the 1001 comes after the refusal."""
    proxy, client, session, sessions, relay = await make_relay()
    _counting_answers(proxy)
    assert await relay.place([]) is None
    await relay.send_upstream(session.pending[0].data)
    down = asyncio.ensure_future(relay._down())
    await relay.refuse(KEY_REVOKED)
    sending = asyncio.Event()
    slow = asyncio.Event()
    send_str = client.send_str

    async def slow_send(data: str) -> None:
        if data == DONE:
            sending.set()
            await slow.wait()
        await send_str(data)

    client.send_str = slow_send  # type: ignore[method-assign]
    await relay.upstream.inbox.put((aiohttp.WSMsgType.TEXT, DONE))
    await asyncio.wait_for(sending.wait(), 1)
    assert not session.pending and session.refusals == 1
    assert await sessions.drain(0.01) == 1  # not idle: left open
    assert not client.closed
    slow.set()
    await asyncio.wait_for(down, 1)  # _down ends: the socket was sent away
    assert client.sent == [DONE, KEY_REVOKED] and client.close_code == 1001


async def test_a_stopping_gateway_sends_a_socket_away_when_its_last_held_request_is_cancelled():
    """The socket's worker refused its request (the worker stops), so the gateway holds it; the
    gateway begins to stop too and leaves the socket open for that answer. The client cancels
    it: nothing is owed any more, and the socket goes away (1001) at once, not at the end of the
    gateway's shutdown timeout."""
    proxy, client, session, sessions, relay = await make_relay()
    _counting_answers(proxy)
    assert await relay.place([]) is None
    await relay.send_upstream(session.pending[0].data)
    down = asyncio.ensure_future(relay._down())
    await relay.upstream.inbox.put((aiohttp.WSMsgType.TEXT, REFUSED_BY_WORKER))
    for _ in range(1000):
        if relay.held:
            break
        await asyncio.sleep(0.001)
    assert relay.held and relay.outside == 1
    assert await sessions.drain(0.01) == 1  # an answer owed: left open
    await relay.cancel('{"type": "cancel"}')
    assert client.sent == [_CANCELLED_HERE]
    assert client.closed and client.close_code == 1001
    down.cancel()
    await asyncio.gather(down, return_exceptions=True)
