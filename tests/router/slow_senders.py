"""Raw-socket clients that send their request slowly or not at all, for the tests of
--request-receive-timeout-ms on the gateway (tests/router/test_slow_senders.py), the worker
(tests/worker/test_server_slow_senders.py) and the scheduler (tests/scheduler/test_slow_senders.py).

Each of them is bounded: every read waits at most a given time, every loop runs a fixed count.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

TIMEOUT_MS = 1500  # the services' --request-receive-timeout-ms in these tests
TIMEOUT_S = TIMEOUT_MS / 1000
# How long past the timeout a stalled client may wait for its answer or its close: a loaded
# 2-core machine is slow, but without the timeout the wait would be an hour or for ever.
SLACK_S = 3.0
HOST = "127.0.0.1"
BODY_WARNING = "request body from 127.0.0.1 not complete: "
STALLED = f"nothing received for {TIMEOUT_S:g} s"  # in the 408's message and the WARNING line
TOO_SLOW = f"bytes/s after the first {TIMEOUT_S:g} s"  # the same, for a body under the rate floor
MIN_BODY_RATE = 8 * 1024  # the services' floor past the timeout (scheduler/receive_timeout.py)
CHAT = "/v1/chat/completions"
HEAD_WARNING = "request head from 127.0.0.1 not complete within"


def post_head(path: str, length: int | None, *extra: str, close: bool = False) -> bytes:
    """A POST's head: Content-Length `length`, or chunked when None."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json", *extra]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# A body that stops short, three ways; each on a route that reads its body (`path`).
def short_content_length(path: str) -> bytes:
    return post_head(path, 1000) + b'{"model": "m", "messa'


def stalled_chunks(path: str) -> bytes:
    return post_head(path, None) + b'5\r\n{"mod\r\n'


def expect_continue(path: str) -> bytes:
    """`Expect: 100-continue` and a large length, then nothing: aiohttp answers 100 Continue."""
    return post_head(path, 1_000_000, "Expect: 100-continue")


STALLED_BODIES = [short_content_length, stalled_chunks, expect_continue]

# A request head that stops short (path: any route).
STALLED_HEADS = {
    "nothing": b"",
    "part of the request line": b"POST /v1/chat/compl",
    "part of the headers": f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nX-Slow: ".encode(),
}


@dataclass
class Stalled:
    """What a client that sent `data` and then nothing got back."""

    seconds: float  # from the last byte sent to the close, or to the bound
    raw: bytes  # everything the service sent
    closed: bool  # the service closed the connection (EOF or reset) within the bound
    answered_at: float | None  # seconds from the last byte sent to the final answer's first bytes

    def answer(self) -> tuple[int, dict]:
        """The final answer's status and JSON body (after any 100 Continue)."""
        status, body = final_answer(self.raw)
        return status, json.loads(body)


async def send_then_stall(port: int, data: bytes, bound_s: float) -> Stalled:
    """Connect, send `data`, send nothing more, and read until the service closes the connection
    or `bound_s` passes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        if data:
            writer.write(data)
            await writer.drain()
        start = time.monotonic()
        raw, closed, answered_at = await _read_until_closed(reader, start, bound_s)
        return Stalled(time.monotonic() - start, raw, closed, answered_at)
    finally:
        writer.close()


async def _read_until_closed(reader: asyncio.StreamReader, start: float, bound_s: float,
                             on_answer: Callable[[], object] | None = None
                             ) -> tuple[bytes, bool, float | None]:
    """Read what the service sends until it closes the connection (EOF or reset) or `bound_s`
    after `start`: (everything read, whether it closed, seconds from `start` to the final
    answer's first bytes). `on_answer` is called once those bytes are in."""
    raw = b""
    answered_at = None
    for _ in range(1000):  # reads; each waits for what is left of the bound
        left = bound_s - (time.monotonic() - start)
        if left <= 0:
            break
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            break
        except ConnectionError:
            return raw, True, answered_at
        if not chunk:
            return raw, True, answered_at
        raw += chunk
        if answered_at is None and _final_status_line(raw) is not None:
            answered_at = time.monotonic() - start
            if on_answer is not None:
                on_answer()
    return raw, False, answered_at


def _final_status_line(raw: bytes) -> bytes | None:
    rest = raw
    while rest.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
        rest = rest[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
    return rest.split(b"\r\n", 1)[0] if rest.startswith(b"HTTP/1.1 ") else None


def final_answer(raw: bytes) -> tuple[int, bytes]:
    """The status and body of the last answer in `raw` (an interim 100 Continue skipped)."""
    while raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
        raw = raw[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def assert_408(raw: bytes, closed: bool, *why: str) -> None:
    """A 408 in the OpenAI error shape whose message says one of `why`, and the connection
    closed."""
    status, answer = final_answer(raw)
    body = json.loads(answer)
    assert status == 408, raw
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == "request_timeout", body
    assert any(reason in body["error"]["message"] for reason in why), body
    assert closed, "the connection stayed open after the 408"


def assert_request_timeout(stalled: Stalled) -> None:
    """A 408 for a stall, about when the timeout ran out after the last byte. A body that stops
    after a few bytes is also under the rate floor, and the two deadlines are then less than
    a millisecond apart (the floor's: the timeout plus 5 bytes' worth at 8 KiB/s after the
    read began; the stall's: the timeout after those bytes came): on a loaded machine the bytes
    come that late and the floor's reason is the one given. Either is right; the stall's alone
    is checked where bytes came for longer first (check_stall_after_progress)."""
    assert stalled.answered_at is not None, f"no answer within {stalled.seconds:.1f} s: {stalled.raw!r}"
    assert_408(stalled.raw, stalled.closed, STALLED, TOO_SLOW)
    assert TIMEOUT_S * 0.8 <= stalled.answered_at <= TIMEOUT_S + SLACK_S, stalled.answered_at


def assert_dropped(stalled: Stalled) -> None:
    """Closed, with nothing sent, about when the timeout ran out."""
    assert stalled.closed, f"still open after {stalled.seconds:.1f} s"
    assert stalled.raw == b"", stalled.raw
    assert TIMEOUT_S * 0.8 <= stalled.seconds <= TIMEOUT_S + SLACK_S, stalled.seconds


async def read_answer(reader: asyncio.StreamReader, bound_s: float = 10.0) -> tuple[int, bytes]:
    """One answer with a Content-Length off a kept-alive connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), bound_s)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await asyncio.wait_for(reader.readexactly(length), bound_s)
    return int(head.split(b" ", 2)[1]), body


async def kept_alive_then_stalled(port: int, path: str, idle_s: float, bound_s: float) -> Stalled:
    """GET `path` twice on one connection, `idle_s` apart (an idle kept-alive connection is not
    a slow request: both must be answered), then send part of a third request's head and stall."""
    reader, writer = await asyncio.open_connection(HOST, port)
    get = f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    try:
        for i in range(2):
            if i:
                await asyncio.sleep(idle_s)
            writer.write(get)
            await writer.drain()
            status, _ = await read_answer(reader)
            assert status == 200, f"answer {i + 1} on the kept-alive connection: {status}"
        writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: ")
        await writer.drain()
        start = time.monotonic()
        try:
            rest = await asyncio.wait_for(reader.read(65536), bound_s)
        except TimeoutError:
            return Stalled(time.monotonic() - start, b"", False, None)
        except ConnectionError:
            rest = b""
        return Stalled(time.monotonic() - start, rest, not rest, None)
    finally:
        writer.close()


async def send_steadily(port: int, path: str, body: bytes, pieces: int,
                        gap_s: float) -> tuple[int, bytes, float]:
    """POST `body` in `pieces` pieces `gap_s` apart (a slow but steady client); the answer's
    status and body (`Connection: close`: read to the end) and the seconds the body took."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(post_head(path, len(body), close=True))
        await writer.drain()
        start = time.monotonic()
        size = -(-len(body) // pieces)
        for i in range(pieces):
            if i:
                await asyncio.sleep(gap_s)
            writer.write(body[i * size:(i + 1) * size])
            await writer.drain()
        took = time.monotonic() - start
        raw = await asyncio.wait_for(reader.read(), 30)
        status, answer = final_answer(raw)
        return status, answer, took
    finally:
        writer.close()


@dataclass
class Paced:
    """What a client that sent its body in pieces, some time apart, got back."""

    raw: bytes  # everything the service sent
    closed: bool  # the service closed the connection within the bound
    answered_at: float | None  # seconds from the head sent to the final answer's first bytes
    sent: list[tuple[float, int]]  # after each piece: seconds from the head sent, body bytes by then

    def sent_before_answer(self) -> tuple[float, int]:
        """The last piece sent before the answer came: when, and the body bytes sent by then."""
        before = [s for s in self.sent if self.answered_at is None or s[0] <= self.answered_at]
        return before[-1] if before else (0.0, 0)


def pieces_of(body: bytes, count: int) -> list[bytes]:
    size = -(-len(body) // count)
    return [body[i:i + size] for i in range(0, len(body), size)]


def padded(doc: dict, size: int) -> bytes:
    """`doc` as JSON, padded with spaces to `size` bytes: still the same JSON."""
    text = json.dumps(doc).encode()
    return text + b" " * (size - len(text))


async def send_paced(port: int, path: str, pieces: Sequence[bytes], gap_s: float, bound_s: float,
                     *, length: int | None, last_chunk: bool = True) -> Paced:
    """POST a body in `pieces`, `gap_s` apart (Content-Length `length`; chunked when None, each
    piece a chunk, and the last chunk after them when `last_chunk`), reading what the service
    sends meanwhile. Sending stops once an answer comes or the connection closes; reading once
    the connection closes or `bound_s` after the head was sent."""
    reader, writer = await asyncio.open_connection(HOST, port)
    sent: list[tuple[float, int]] = []
    start = time.monotonic()

    async def send() -> None:
        writer.write(post_head(path, length, close=True))
        total = 0
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(gap_s)
            writer.write(piece if length is not None else b"%x\r\n%s\r\n" % (len(piece), piece))
            if length is None and last_chunk and i == len(pieces) - 1:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
            total += len(piece)
            sent.append((time.monotonic() - start, total))

    sending = asyncio.create_task(send())
    try:
        # Once the service has answered, the rest of the body is not wanted.
        raw, closed, answered_at = await _read_until_closed(reader, start, bound_s, sending.cancel)
        return Paced(raw, closed, answered_at, sent)
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)  # a write to a closed connection fails
        writer.close()


def log_count(output: str, needle: str) -> int:
    return sum(1 for line in output.splitlines() if needle in line)


# ---- the checks each service's test module runs -----------------------------------------------
async def check_stalled_body(port: int, request: bytes, output: Callable[[], str],
                             answers: Callable[[], None]) -> None:
    """A body that stops short gets the 408 and one WARNING line (no traceback; `output`: the
    service's log so far), and the service still answers (`answers` checks it, in a thread)."""
    before = log_count(output(), BODY_WARNING)
    assert_request_timeout(await send_then_stall(port, request, TIMEOUT_S + SLACK_S))
    out = output()
    assert log_count(out, BODY_WARNING) == before + 1
    assert "Traceback" not in out
    await asyncio.to_thread(answers)


async def check_stalled_head(port: int, name: str, output: Callable[[], str],
                             answers: Callable[[], None]) -> None:
    """A head that stops short (STALLED_HEADS[name]) is dropped, with one WARNING line when any
    of it came, and the service still answers."""
    before = log_count(output(), HEAD_WARNING)
    assert_dropped(await send_then_stall(port, STALLED_HEADS[name], TIMEOUT_S + SLACK_S))
    out = output()
    assert log_count(out, HEAD_WARNING) == before + (1 if STALLED_HEADS[name] else 0)
    assert "Traceback" not in out
    await asyncio.to_thread(answers)


def _long_stream(base_url: str) -> tuple[list[str], float]:
    body = {"model": "m", "prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return events, time.monotonic() - start


def _ten_megabytes(base_url: str) -> tuple[int, float]:
    """10 MB at loopback speed (a model nobody serves: a 404 once it is read)."""
    body = json.dumps({"model": "none-such", "messages": [{"role": "user", "content": "x" * 10_000_000}]})
    start = time.monotonic()
    r = httpx.post(base_url + CHAT, content=body.encode(), timeout=30,
                   headers={"Content-Type": "application/json"})
    return r.status_code, time.monotonic() - start


async def check_answers_beside_a_stalled_body(base_url: str, port: int) -> None:
    """An OpenAI server (the gateway, the worker) serving model "m" at ~12 ms a token: a slow
    but steady body, a 10 MB body and a 300-token stream that outlasts the timeout all pass,
    beside a stalled body that gets its 408 (without the timeout the test fails there)."""
    steady = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 600}],
                         "max_tokens": 2}).encode()
    stream, big, slow, stalled = await asyncio.gather(
        asyncio.to_thread(_long_stream, base_url),
        asyncio.to_thread(_ten_megabytes, base_url),
        # 6 pieces 0.1 s apart: ~0.5 s, within the 1.5 s
        send_steadily(port, CHAT, steady, pieces=6, gap_s=0.1),
        send_then_stall(port, short_content_length(CHAT), TIMEOUT_S + SLACK_S),
    )
    assert_request_timeout(stalled)
    status, answer, took = slow
    assert status == 200 and json.loads(answer)["choices"], answer
    assert took > 0.4
    big_status, big_s = big
    assert big_status == 404 and big_s < TIMEOUT_S, (big_status, big_s)  # read whole, and quickly
    events, stream_s = stream
    assert events[-1] == "[DONE]" and stream_s > TIMEOUT_S * 1.5, (events[-2:], stream_s)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]
    assert not [e for e in events if '"error"' in e]


# ---- the body's rate: pauses are timed, and a floor past the timeout ----------------------------
async def check_steady_body_outlasting_the_timeout(port: int, path: str, doc: dict,
                                                   answered: Callable[[int, bytes], None]) -> None:
    """A body of `doc` padded to 32 KiB, sent in 8 pieces 0.4 s apart: each pause well under the
    timeout, the whole upload (~2.8 s) longer than it, ~10 KiB/s above the floor. It is all
    sent and answered as usual (`answered` checks the status and body)."""
    body = padded(doc, 32 * 1024)
    paced = await send_paced(port, path, pieces_of(body, 8), 0.4, 30, length=len(body))
    last_at, total = paced.sent_before_answer()
    assert total == len(body), f"answered after {total} of {len(body)} bytes: {paced.raw[:300]!r}"
    assert last_at > TIMEOUT_S * 1.5, paced.sent  # the upload outlasted the timeout
    assert paced.answered_at is not None, paced.raw
    answered(*final_answer(paced.raw))


async def check_stall_after_progress(port: int, path: str, output: Callable[[], str]) -> None:
    """36 KiB sent steadily for longer than the timeout (6 pieces 0.4 s apart, ~15 KiB/s), then
    nothing, short of its Content-Length: the 408 for the stall comes about the timeout after
    the last byte (not counted from the start), with one WARNING line."""
    before = log_count(output(), BODY_WARNING)
    sent = padded({"model": "m"}, 36 * 1024)
    paced = await send_paced(port, path, pieces_of(sent, 6), 0.4, 2.0 + TIMEOUT_S + SLACK_S,
                             length=len(sent) + 1024)
    last_at, total = paced.sent_before_answer()
    assert total == len(sent), f"answered after {total} of {len(sent)} bytes: {paced.raw[:300]!r}"
    assert paced.answered_at is not None, f"no answer: {paced.raw!r}"
    assert_408(paced.raw, paced.closed, STALLED)
    assert TIMEOUT_S * 0.8 <= paced.answered_at - last_at <= TIMEOUT_S + SLACK_S, (paced.answered_at, last_at)
    out = output()
    assert log_count(out, BODY_WARNING) == before + 1
    assert "Traceback" not in out


async def check_body_under_the_rate_floor(port: int, path: str, output: Callable[[], str],
                                          *, chunked: bool) -> None:
    """16 KiB at once, then 64 bytes every 0.3 s (~210 bytes/s, far under the floor; each pause
    well under the timeout): a 408 once the time passes the timeout plus the bytes received
    over the floor, not before (the 16 KiB earned 2 s past the timeout) nor much after."""
    before = log_count(output(), BODY_WARNING)
    burst = padded({"model": "m"}, 16 * 1024)
    pieces = [burst] + [b" " * 64] * 40  # 12 s of them at most: far past the bound below
    earliest = TIMEOUT_S + len(burst) / MIN_BODY_RATE
    paced = await send_paced(port, path, pieces, 0.3, earliest + 1 + SLACK_S, last_chunk=False,
                             length=None if chunked else len(burst) + 64 * 41)
    assert paced.answered_at is not None, f"no answer within {earliest + 1 + SLACK_S:g} s: {paced.sent[-1]}"
    _, total = paced.sent_before_answer()
    latest = TIMEOUT_S + total / MIN_BODY_RATE
    assert earliest <= paced.answered_at <= latest + SLACK_S, (paced.answered_at, earliest, latest)
    assert_408(paced.raw, paced.closed, TOO_SLOW)
    out = output()
    assert log_count(out, BODY_WARNING) == before + 1
    assert "Traceback" not in out
