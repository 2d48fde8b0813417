"""The gateway's scheduler channel, both wire forms (the scheduler's WebSocket batch channel
and HTTP/1.1 pipelining): against the real scheduler process (with stand-in echo workers),
plus its failure modes (refused, silent peer, no channel on the peer, a peer that closes idle
connections) and its parsers."""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
from dataclasses import dataclass

import httpx
import pytest

from router.sched_pipe import IDLE_CLOSE_S, SchedulerPipe, _Pipe, _WsPipe, ws_frame
from scheduler.client import SchedulerUnavailableError, UnknownModelError
from scheduler.connection_limit import DEFAULT_KEEPALIVE_TIMEOUT_S
from scheduler.tls import PeerContext
from tests.router.procs import (
    Proc,
    free_port,
    scheduler_over_two_echo_workers,
    start_echo_worker,
    start_scheduler,
    wait_http,
)


@pytest.fixture(scope="module")
def scheduler():
    yield from scheduler_over_two_echo_workers()


@pytest.mark.parametrize("channel", ["ws", "http"])
async def test_concurrent_calls_share_one_connection_and_leases_are_released(scheduler, channel):
    pipe = SchedulerPipe(scheduler, timeout_s=5, channel=channel)
    try:
        results = await asyncio.gather(
            *(pipe.schedule_raw({"model": "m", "prompt_tokens": 10}) for _ in range(40))
        )
        assert all(status == 200 for status, _ in results)
        assert pipe.kind == channel
        leases = {p["lease_id"] for _, p in results}
        assert len(leases) == 40
        async with httpx.AsyncClient() as c:
            workers = (await c.get(scheduler + "/v1/workers")).json()["workers"]
        assert sum(w["in_flight_leases"] for w in workers) >= 40
        for lease in leases:
            pipe.release_nowait({"lease_id": lease, "ok": True, "prompt_tokens": 10, "output_tokens": 1})
        with pytest.raises(UnknownModelError):
            await pipe.schedule_raw({"model": "no-such-model"})  # answered after every release above
        async with httpx.AsyncClient() as c:
            workers = (await c.get(scheduler + "/v1/workers")).json()["workers"]
        assert sum(w["in_flight_leases"] for w in workers) == 0
    finally:
        pipe.close()


async def test_auto_uses_the_batch_channel_and_falls_back_to_http_without_one(scheduler):
    pipe = SchedulerPipe(scheduler, timeout_s=5)
    try:
        status, payload = await pipe.schedule_raw({"model": "m"})
        assert status == 200 and pipe.kind == "ws"
        pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
    finally:
        pipe.close()
    # An echo worker has no /v1/channel (404) and no /v1/schedule either (404): the pipe
    # falls back to pipelined HTTP calls, whose 404 reads as an unknown model.
    worker, url = start_echo_worker()
    pipe = SchedulerPipe(url, timeout_s=5)
    try:
        with pytest.raises(UnknownModelError):
            await pipe.schedule_raw({"model": "m"})
        assert pipe.kind == "http"
    finally:
        pipe.close()
        worker.stop()
    # Forcing "ws" against a peer without the channel is an unavailable scheduler.
    worker, url = start_echo_worker()
    pipe = SchedulerPipe(url, timeout_s=5, channel="ws")
    try:
        with pytest.raises(SchedulerUnavailableError):
            await pipe.schedule_raw({"model": "m"})
    finally:
        pipe.close()
        worker.stop()


@pytest.mark.parametrize("channel", ["ws", "http"])
async def test_refused_connection_is_scheduler_unavailable(channel):
    pipe = SchedulerPipe(f"http://127.0.0.1:{free_port()}", timeout_s=1, channel=channel)
    with pytest.raises(SchedulerUnavailableError):
        await pipe.schedule_raw({"model": "m"})
    pipe.close()


@pytest.mark.parametrize("channel", ["auto", "http"])
async def test_silent_scheduler_times_out(channel):
    # A listening socket that never answers (a hung peer).
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        pipe = SchedulerPipe(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=0.2, channel=channel)
        with pytest.raises(SchedulerUnavailableError):
            await asyncio.wait_for(pipe.schedule_raw({"model": "m"}), 5)
        pipe.close()


async def test_parser_handles_answers_split_anywhere():
    pipe = SchedulerPipe("http://127.0.0.1:9", timeout_s=1)
    proto = _Pipe(pipe)
    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in range(3)]
    for f in futs:
        proto.pending.append((f, 0.0))
    proto.pending.insert(1, (None, 0.0))  # a fire-and-forget release in between
    answers = (
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"a":"one"}'
        b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n"
        b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 13\r\n\r\n{"wait":true}'
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}"
    )
    for i in range(0, len(answers), 5):
        proto.data_received(answers[i : i + 5])
    assert [f.result() for f in futs] == [(200, b'{"a":"one"}'), (503, b'{"wait":true}'), (404, b"{}")]
    assert not proto.pending and not proto.buf


async def test_ws_parser_handles_frames_split_anywhere_and_answers_pings():
    pipe = SchedulerPipe("http://127.0.0.1:9", timeout_s=1)
    proto = _WsPipe(pipe, b"")
    written: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(data)

    proto.transport = Transport()
    loop = asyncio.get_running_loop()
    a, b, c = (loop.create_future() for _ in range(3))
    proto.pending.append(([a, None], 0.0))  # a schedule call and a release in one batch
    proto.pending.append(([b, c], 0.0))
    big = b'{"pad":"' + b"x" * 300 + b'"}'
    first = b'[[200,{"lease_id":"l1"}],[204,null]]'
    second = b'[[404,{"error":{"message":"no"}}],[200,' + big + b"]]"

    def server_frame(payload: bytes, opcode: int = 0x82) -> bytes:
        n = len(payload)
        head = bytes((opcode, n)) if n < 126 else bytes((opcode, 126)) + n.to_bytes(2, "big")
        return head + payload

    stream = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"
        + server_frame(first)
        + server_frame(b"hi", 0x89)  # a ping
        + server_frame(second)
    )
    for i in range(0, len(stream), 7):
        proto.data_received(stream[i : i + 7])
    assert proto.handshake.done() and not proto.closed
    assert a.result() == [200, {"lease_id": "l1"}]
    assert b.result()[0] == 404 and c.result()[1]["pad"] == "x" * 300
    assert written == [ws_frame(b"hi", 0x8A)]
    assert not proto.pending and not proto.buf


def test_client_frames_carry_a_zero_mask_and_every_length_form():
    for n, head in (
        (5, b"\x82\x85"),
        (300, b"\x82\xfe\x01\x2c"),
        (70000, b"\x82\xff" + (70000).to_bytes(8, "big")),
    ):
        frame = ws_frame(b"a" * n)
        assert frame.startswith(head + b"\0\0\0\0") and frame.endswith(b"a" * n)
        assert len(frame) == len(head) + 4 + n


@pytest.mark.parametrize("channel", ["ws", "http"])
async def test_decision_for_a_cancelled_call_is_given_back(scheduler, channel):
    pipe = SchedulerPipe(scheduler, timeout_s=5, channel=channel)
    try:
        await pipe.schedule_raw({"model": "m"})  # connect first
        async with httpx.AsyncClient() as c:

            async def leases() -> int:
                return sum(
                    w["in_flight_leases"] for w in (await c.get(scheduler + "/v1/workers")).json()["workers"]
                )

            base = await leases()
            # Cancelled at different points: before the call is written, while its answer is
            # awaited, and after the answer came but before the caller resumed.
            tasks = []
            for k in range(12):
                for _ in range(3):
                    task = asyncio.ensure_future(pipe.schedule_raw({"model": "m"}))
                    for _ in range(k):
                        await asyncio.sleep(0)
                    task.cancel()
                    tasks.append(task)
            await asyncio.wait(tasks)
            assert any(t.cancelled() for t in tasks)
            for t in tasks:  # finished before the cancel: the caller holds the lease
                if not t.cancelled():
                    pipe.release_nowait({"lease_id": t.result()[1]["lease_id"], "ok": True})
            await asyncio.sleep(0.3)
            assert await leases() == base
    finally:
        pipe.close()


async def test_a_burst_larger_than_one_message_allows_is_split(scheduler):
    # 4,000 calls with 64 prefix fingerprints each made in one loop iteration: ~5.5 MB of
    # operations, more than the scheduler accepts in one channel message (4 MiB).
    pipe = SchedulerPipe(scheduler, timeout_s=20, channel="ws")
    hashes = [(1 << 62) + i for i in range(64)]
    try:
        results = await asyncio.gather(
            *(pipe.schedule_raw({"model": "m", "prefix_hashes": hashes}) for _ in range(4000))
        )
        assert [s for s, _ in results] == [200] * 4000
        for _, p in results:
            pipe.release_nowait({"lease_id": p["lease_id"], "ok": True})
        with pytest.raises(UnknownModelError):
            await pipe.schedule_raw({"model": "no-such-model"})  # after every release
    finally:
        pipe.close()


async def open_leases(scheduler: str) -> int:
    """The leases the scheduler holds open, over all its workers."""
    async with httpx.AsyncClient() as c:
        workers = (await c.get(scheduler + "/v1/workers")).json()["workers"]
    return sum(w["in_flight_leases"] for w in workers)


@pytest.mark.parametrize("channel", ["ws", "http"])
async def test_releases_not_yet_sent_when_the_connection_drops_go_on_the_next_one(scheduler, channel):
    """A release waits up to 2 ms for company before it is written. When the connection dropped
    in that window the release was lost, and its lease counted as load on the worker until it
    expired (10 minutes)."""
    pipe = SchedulerPipe(scheduler, timeout_s=5, channel=channel)

    try:
        base = await open_leases(scheduler)
        results = await asyncio.gather(*(pipe.schedule_raw({"model": "m"}) for _ in range(5)))
        assert await open_leases(scheduler) == base + 5
        for _, payload in results:
            pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
        dropped = pipe._pipe
        assert dropped is not None
        dropped.abort(SchedulerUnavailableError("connection reset"))  # before the releases went out
        for _ in range(100):
            if await open_leases(scheduler) == base:
                break
            await asyncio.sleep(0.05)
        assert await open_leases(scheduler) == base
        assert pipe._pipe is not dropped and pipe.kind == channel
    finally:
        pipe.close()


@pytest.mark.parametrize("instance", ["gw-1", None])
async def test_a_named_gateways_lost_channel_is_opened_again_without_a_call(scheduler, instance):
    """A gateway that names itself has its leases ended by the scheduler once its channel has
    stayed closed for the grace (scheduler/gateways.py): a lost channel is opened again at once,
    not at the next call (long requests running, there may be none for minutes). An unnamed
    pipe (as before) waits for its next call."""
    pipe = SchedulerPipe(scheduler, timeout_s=5, channel="ws", instance=instance)
    try:
        status, payload = await pipe.schedule_raw({"model": "m"})
        assert status == 200
        lost = pipe._pipe
        assert lost is not None
        lost.abort(SchedulerUnavailableError("connection reset"))  # nothing left unsent
        for _ in range(40):
            if pipe._pipe is not None:
                break
            await asyncio.sleep(0.05)
        if instance is None:
            assert pipe._pipe is None
        else:
            assert pipe._pipe is not None and pipe._pipe is not lost and not pipe._pipe.closed
        pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
    finally:
        pipe.close()


@pytest.mark.parametrize("channel", ["ws", "http"])
async def test_a_tls_reload_moves_the_calls_to_a_new_connection_and_those_in_flight_are_answered(
        scheduler, channel):
    """A reload (scheduler/tls_reload.py) puts a new context in the PeerContext: the connection
    made with the old one is retired at the next call. The calls written on it before (and a
    release waiting there for company) are still answered on it, then it closes; the calls after
    go on a new connection, made with the new context. None is lost. (The scheduler here is
    http://: the same check of the context's identity, no handshake; the HTTPS stack:
    tests/router/test_tls_reload.py.)"""
    peer = PeerContext(ssl.create_default_context())
    pipe = SchedulerPipe(scheduler, timeout_s=5, channel=channel, tls=peer)

    try:
        base = await open_leases(scheduler)
        status, first = await pipe.schedule_raw({"model": "m"})
        old = pipe._pipe
        assert status == 200 and old is not None
        owed_at_retire: list[int] = []
        retire = getattr(old, "retire", None)  # (None: a pipe that never retires a connection)

        def retire_and_count() -> None:
            assert retire is not None
            retire()
            owed_at_retire.append(len(old.pending))

        old.retire = retire_and_count  # type: ignore[method-assign]
        before = [asyncio.ensure_future(pipe.schedule_raw({"model": "m"})) for _ in range(20)]
        await asyncio.sleep(0)  # written on the old connection, or about to be
        pipe.release_nowait({"lease_id": first["lease_id"], "ok": True})  # waits there for company
        peer.current = ssl.create_default_context()  # as a reload does
        after = [asyncio.ensure_future(pipe.schedule_raw({"model": "m"})) for _ in range(20)]
        results = await asyncio.wait_for(asyncio.gather(*before, *after), 10)
        assert [s for s, _ in results] == [200] * 40
        new = pipe._pipe
        assert new is not None and new is not old and new.opened_with is peer.current
        assert owed_at_retire and owed_at_retire[0] > 0  # calls in flight at the switch
        assert pipe.kind == channel
        for _ in range(100):  # closed once its answers came
            if old.closed:
                break
            await asyncio.sleep(0.02)
        assert old.closed and not pipe._retiring
        for _, payload in results:
            pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
        for _ in range(100):  # every lease given back: the one released on the old connection too
            if await open_leases(scheduler) == base:
                break
            await asyncio.sleep(0.05)
        assert await open_leases(scheduler) == base
        # Steady again: the next calls stay on the new connection.
        status, payload = await pipe.schedule_raw({"model": "m"})
        assert status == 200 and pipe._pipe is new
        pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
    finally:
        pipe.close()


@pytest.mark.parametrize("channel", ["ws", "http"])
async def test_a_scheduler_at_an_ipv6_address(channel):
    """http://[::1]:port works, both wire forms, against the real scheduler."""
    w, wu = start_echo_worker()
    port = free_port()
    s = Proc(["-m", "scheduler", "--host", "::1", "--port", str(port), "--workers", wu,
              "--scrape-interval-ms", "100"], f"scheduler-{port}")
    url = f"http://[::1]:{port}"
    pipe = None
    try:
        wait_http(url + "/health", s)
        pipe = SchedulerPipe(url, timeout_s=5, channel=channel)
        status, payload = await pipe.schedule_raw({"model": "m", "prompt_tokens": 10})
        assert status == 200 and pipe.kind == channel
        pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
    finally:
        if pipe is not None:
            pipe.close()
        s.stop()
        w.stop()


async def test_the_host_header_brackets_an_ipv6_address():
    """An IPv6 literal in Host goes in brackets (RFC 9110): aiohttp takes it bare, but a proxy
    in front of the scheduler may not. What the channel sends, read off the socket."""
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = SchedulerPipe(f"http://[::1]:{port}", timeout_s=5, channel="http")
    try:
        with pytest.raises(UnknownModelError):  # the 404
            await pipe.schedule_raw({"model": "m"})
    finally:
        pipe.close()
        server.close()
    assert f"\r\nHost: [::1]:{port}\r\n".encode() in heads[0]


@dataclass
class _Conn:
    last_answer: float  # when the stand-in last answered on it (or accepted it)
    client_closed: float | None = None  # when it read the client's end of the connection


class IdleClosingScheduler:
    """A stand-in scheduler for the HTTP wire form whose keep-alive closes an idle connection
    after `keepalive_s` at the worst moment: as the client's next call crosses the close on the
    wire. So a call arriving on a connection idle that long is read by no one: the connection
    is dropped unanswered. Each call is answered `answer_delay_s` after it is read."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self.answer_delay_s = 0.0
        self.conns: list[_Conn] = []
        self.dropped = 0
        self.url = ""

    async def __aenter__(self) -> IdleClosingScheduler:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(time.monotonic())
        self.conns.append(conn)
        body = b'{"lease_id":"l1","worker_id":"w","worker_url":"http://127.0.0.1:9"}'
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    conn.client_closed = time.monotonic()
                    return
                length = re.search(rb"content-length: (\d+)", head.lower())
                await reader.readexactly(int(length.group(1)) if length else 0)
                if time.monotonic() - conn.last_answer >= self.keepalive_s:
                    self.dropped += 1
                    return  # closed by the keep-alive as the call came in
                await asyncio.sleep(self.answer_delay_s)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                conn.last_answer = time.monotonic()
        finally:
            writer.close()


def test_the_idle_close_is_well_below_the_schedulers_keepalive():
    assert IDLE_CLOSE_S <= DEFAULT_KEEPALIVE_TIMEOUT_S / 2


async def test_an_idle_http_connection_is_closed_here_before_the_scheduler_closes_it():
    """The scheduler closes an idle kept-alive connection after --keepalive-timeout-s; a call
    written as it did so failed (once: then retried, or round robin). The pipe closes its own
    idle connection first, so a call after any idle time goes out on a fresh connection and is
    answered at the first try. A call awaiting a slow answer is not idle: never closed."""
    async with IdleClosingScheduler(keepalive_s=0.5) as scheduler:
        pipe = SchedulerPipe(scheduler.url, timeout_s=5, channel="http", idle_close_s=0.2)
        try:
            scheduler.answer_delay_s = 0.4  # twice the idle close: a busy connection is kept
            assert (await pipe.schedule_raw({"model": "m"}))[0] == 200
            scheduler.answer_delay_s = 0.0
            await asyncio.sleep(0.8)  # idle longer than the scheduler's keep-alive
            status, payload = await pipe.schedule_raw({"model": "m"})
            assert status == 200 and payload["lease_id"] == "l1"
            assert pipe.kind == "http"
        finally:
            pipe.close()
        assert scheduler.dropped == 0
        assert len(scheduler.conns) == 2
        first = scheduler.conns[0]
        # Closed by the pipe about idle_close_s after its answer (a watchdog tick later at most),
        # before the scheduler's keep-alive.
        assert first.client_closed is not None
        assert 0.2 <= first.client_closed - first.last_answer < 0.5


async def test_the_batch_channel_outlives_the_schedulers_keepalive():
    """The WebSocket channel is no kept-alive HTTP connection: the scheduler's keep-alive never
    closes it, so the pipe keeps it however long it is idle (no idle close there)."""
    w, wu = start_echo_worker()
    try:
        s, su = start_scheduler([wu], "--keepalive-timeout-s", "0.3", "--scrape-interval-ms", "100")
    except BaseException:
        w.stop()
        raise
    pipe = SchedulerPipe(su, timeout_s=5, channel="ws", idle_close_s=0.2)
    try:
        status, payload = await pipe.schedule_raw({"model": "m"})
        assert status == 200 and pipe.kind == "ws"
        pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
        channel = pipe._pipe
        await asyncio.sleep(1.0)  # three keep-alives of the scheduler, five idle closes
        assert pipe._pipe is channel and channel is not None and not channel.closed
        status, payload = await pipe.schedule_raw({"model": "m"})
        assert status == 200 and pipe._pipe is channel
        pipe.release_nowait({"lease_id": payload["lease_id"], "ok": True})
    finally:
        pipe.close()
        s.stop()
        w.stop()
