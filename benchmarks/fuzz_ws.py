"""benchmarks/api_fuzz.py's WebSocket cases: a socket to the gateway's or a worker's /v1/ws,
1-4 messages on it, and the checks of what comes back.

The protocol (inference_worker/server/websocket.py; the gateway relays it, router/ws_proxy.py):
each text message is a completions or chat body, answered with chunk objects and exactly one
terminal message, `{"type": "done", ...}` or an OpenAI error object; `{"type": "cancel"}` ends
the request being answered (its terminal is then `done` with `cancelled`) and is no request of
its own; a binary message is answered, in its turn, with an error. The socket stays usable
after an error.

What is sent: valid requests with one to three things broken (fuzz_cases.mutate's bodies),
text that is not JSON, binary frames, messages past the server's size limit (and just under
it), exact cancels however spelt and cancel look-alikes, a close frame with a message after it,
requests sent before the previous one's answer ended (pipelined, or after a long answer's first
chunk), and a socket closed by the client mid-answer.

The checks:
- every message from the server is a JSON text message: a chunk, a `done`, or an error in the
  OpenAI shape; none binary, none else;
- every request (text other than an exact cancel, or binary) gets exactly one terminal
  message, within the client timeout (else: a hang), and answers come one after the other:
  no chunk of an answer after an end came inside it, no two answers' chunks interleaved (the
  error has no id: a client pairs answers' ends with its requests by their order);
- then a valid request on the same socket is answered, to its `done` (the socket kept usable);
- or the server closed the socket with an allowed code: 1009 (message too big) only after a
  message past that server's limit (the gateway's --max-body-bytes, the worker's 16 MiB: the
  aiohttp reader refuses it before anything reads it, and RFC 6455 says so with 1009), 1000
  only in answer to the client's own close. Any other close, or a close with answers owed
  and no such cause, is a violation. (1001, going away, is the protocol's word for a
  stopping server: no server stops during the fuzz, so it is a violation here too.)
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.fuzz_cases import NON_JSON, STRINGS, Endpoint, mutate, valid_body
from benchmarks.fuzz_checks import error_shape_problem

# The servers' message limits as api_fuzz's stack runs them: the gateway's --max-body-bytes
# default (router/config.py) and the worker's max_msg_size (its websocket.py).
GATEWAY_MAX_MSG = 8 * 1024 * 1024
WORKER_MAX_MSG = 16 * 1024 * 1024
_CHUNK_OBJECTS = ("chat.completion.chunk", "text_completion")
_CANCEL = '{"type": "cancel"}'
# Cancel look-alikes: requests to the server (answered with an error), not cancels.
_ODD_CANCELS = ['{"type": "cancel", "id": "x"}', '{"type": "CANCEL"}', '{"type": ["cancel"]}',
                '"cancel"', '{"type": "cancel"', '{"cancel": true}', "cancel", '{"type": "cancel\\u0000"}',
                '{"type": "\\u0063ancel"}', " " * 60 + '{"type":"cancel"}']
# Exact cancels however spelt (JSON with one field, type "cancel", at most 64 characters).
_CANCELS = [_CANCEL, '{"type":"cancel"}', ' { "type" : "cancel" } ', '{"type": "cancel", "type": "cancel"}']
_BINARIES = [b"", b"\x00", b'{"model": "m", "prompt": "hi"}', b"\xff" * 100, bytes(range(256)) * 40]


@dataclass
class WsMsg:
    """One thing the client does on the socket.

    kind: "text" and "binary" are requests (each owed one terminal answer); "cancel" is an
    exact cancel (no answer of its own); "text-mid" is a request whose answer's first message
    is read before what follows is sent (it comes inside the answer); "close-mid" sends `data`
    (a request) and closes the socket at its first answer message; "close-then" sends a close
    frame, then `data` (which nothing answers)."""

    kind: str
    data: str | bytes
    what: str


@dataclass
class WsCase:
    server: str  # "gateway" or "worker"
    messages: list[WsMsg]
    pipelined: bool  # every message sent before any answer is read
    mutation: str = ""

    @property
    def name(self) -> str:
        return "gw ws" if self.server == "gateway" else "worker ws"

    @property
    def limit(self) -> int:
        return GATEWAY_MAX_MSG if self.server == "gateway" else WORKER_MAX_MSG

    def reproducer(self, base: str) -> str:
        def short(d: str | bytes) -> str:
            return repr(d) if len(d) <= 300 else f"{d[:150]!r}...({len(d)} chars)"
        msgs = "; ".join(f"{m.kind}({short(m.data)})" for m in self.messages)
        return f"GET {base}/v1/ws ({'pipelined' if self.pipelined else 'one at a time'}): {msgs}"


def _valid(rnd: random.Random, server: str) -> str:
    kind = rnd.choice(["chat", "completions"])
    body = valid_body(kind)
    if server == "worker" and rnd.random() < 0.3:  # the worker's own field picking the API
        body["endpoint"] = "chat.completions" if kind == "chat" else "/v1/completions"
    return json.dumps(body)


def _message(rnd: random.Random, server: str, limit: int) -> WsMsg:
    r = rnd.random()
    if r < 0.45:  # a valid request with one to three things broken (the HTTP fuzz's bodies)
        kind = rnd.choice(["chat", "completions"])
        case = mutate(Endpoint(f"ws {kind}", server, "/v1/ws", kind), rnd)
        what = case.mutation.split(" [")[0]  # its framing, headers, path: no such thing here
        try:
            return WsMsg("text", case.body.decode(), f"{kind}: {what}")
        except UnicodeDecodeError:  # a text frame carries UTF-8 only: these bytes go binary
            return WsMsg("binary", case.body, f"{kind}: {what} (binary: not UTF-8)")
    if r < 0.55:
        raw = rnd.choice(NON_JSON)
        try:
            return WsMsg("text", raw.decode(), f"non-json {raw[:30]!r}")
        except UnicodeDecodeError:
            return WsMsg("binary", raw, f"binary {raw[:30]!r}")
    if r < 0.6:
        s = rnd.choice(STRINGS)
        return WsMsg("text", s.encode("utf-8", "replace").decode(), "string")
    if r < 0.67:
        b = rnd.choice(_BINARIES)
        return WsMsg("binary", b, f"binary {len(b)} bytes")
    if r < 0.74:
        c = rnd.choice(_CANCELS)
        return WsMsg("cancel", c, f"cancel {c!r}")
    if r < 0.81:
        c = rnd.choice(_ODD_CANCELS)
        return WsMsg("text", c, f"odd cancel {c[:30]!r}")
    if r < 0.84:  # past the server's limit (1009 allowed), or just under it (an error answer)
        over = rnd.random() < 0.6
        size = limit + rnd.choice([1, 1000]) if over else limit - 200
        head = '{"model": "m", "max_tokens": 4, "prompt": "'
        return WsMsg("text", head + "a" * (size - len(head) - 2) + '"}',
                     f"huge {size} bytes ({'over' if over else 'under'} the limit {limit})")
    if r < 0.92:  # an answer long enough for a cancel or a second request to come inside it
        body = json.loads(_valid(rnd, server))
        body["max_tokens"] = rnd.choice([16, 32])
        return WsMsg("text", json.dumps(body), f"valid, {body['max_tokens']} tokens")
    return WsMsg("text", _valid(rnd, server), "valid")


def ws_case(rnd: random.Random) -> WsCase:
    server = rnd.choice(["gateway", "worker"])
    limit = GATEWAY_MAX_MSG if server == "gateway" else WORKER_MAX_MSG
    msgs = [_message(rnd, server, limit) for _ in range(rnd.choice([1, 1, 2, 2, 3, 4]))]
    if rnd.random() < 0.3:  # what follows comes while a long answer streams (a cancel, a second request, ...)
        body = {**json.loads(_valid(rnd, server)), "max_tokens": 32}
        msgs.insert(0, WsMsg("text-mid", json.dumps(body), "valid, 32 tokens, the rest inside its answer"))
    r = rnd.random()
    if r < 0.08:  # the client leaves while its answer streams
        body = {**valid_body("completions"), "max_tokens": rnd.choice([32, 100])}
        msgs.append(WsMsg("close-mid", json.dumps(body), "closed mid-answer"))
    elif r < 0.14:  # a close frame, then a message the closing socket must not answer
        msgs.append(WsMsg("close-then", _valid(rnd, server), "message after close"))
    pipelined = rnd.random() < 0.5
    case = WsCase(server, msgs, pipelined)
    case.mutation = f"{'pipelined' if pipelined else 'in turn'}: " + " | ".join(m.what for m in msgs)
    return case


def interleave(http: list[Any], ws: list[WsCase], every: int) -> list[Any]:
    """The WebSocket cases among the HTTP ones: one after each `every` HTTP cases (the rest at
    the end), so both run side by side through the whole run."""
    out: list[Any] = []
    it = iter(ws)
    for i, c in enumerate(http):
        out.append(c)
        if (i + 1) % every == 0 and (w := next(it, None)) is not None:
            out.append(w)
    out.extend(it)
    return out


# ---- sending one case and judging it -----------------------------------------------------

@dataclass
class WsOutcome:
    problem: str | None = None
    note: str | None = None
    counts: Counter = field(default_factory=Counter)  # done / cancelled / error / close <code>


def message_problem(data: Any, binary: bool) -> tuple[str | None, str | None, str | None]:
    """(problem, terminal kind, chunk id) for one server message: kind "done", "cancelled" or
    "error" when it ends an answer, None for a chunk (with its id)."""
    if binary:
        return f"a binary message from the server: {data[:100]!r}", None, None
    try:
        obj = json.loads(data)
    except ValueError:
        return f"a message that is not JSON: {data[:200]!r}", None, None
    if not isinstance(obj, dict):
        return f"a message that is no object: {data[:200]!r}", None, None
    if obj.get("type") == "done":
        if "id" not in obj:
            return f"a done message without its id: {data[:200]!r}", None, None
        return None, "cancelled" if obj.get("cancelled") else "done", None
    if "error" in obj:
        return error_shape_problem(data.encode()), "error", None
    if obj.get("object") in _CHUNK_OBJECTS and isinstance(obj.get("choices"), list):
        return None, None, str(obj.get("id"))
    return f"a message that is no chunk, done or error: {data[:200]!r}", None, None


class _Violation(Exception):
    pass


class _Socket:
    """The client's side of one case: what it sent, what it is owed, what came."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, case: WsCase, out: WsOutcome) -> None:
        self.ws, self.case, self.out = ws, case, out
        self.owed = 0  # terminal answers still owed
        self.over_limit = False  # a message past the server's limit went: 1009 allowed
        self.closing = False  # the client sent its close: 1000 allowed, nothing more owed
        # Answers come one after the other, in order: the chunks of the answer streaming now,
        # and the ids of those ended (a chunk of one after an end came inside it).
        self.streaming: str | None = None
        self.ended: set[str] = set()

    async def send(self, m: WsMsg) -> None:
        if m.kind == "close-then":
            # A close frame, then a text frame on the same connection: aiohttp's client sends
            # nothing after its close(), so both go through its frame writer (the server must
            # answer the close and ignore what follows).
            self.closing = True
            await self.ws._writer.send_frame(struct.pack("!H", 1000), aiohttp.WSMsgType.CLOSE)
            await self.ws._writer.send_frame(str(m.data).encode(), aiohttp.WSMsgType.TEXT)
            return
        data = m.data.encode() if isinstance(m.data, str) else m.data
        # Counted first: a refusal may be read before the send returns.
        self.over_limit |= len(data) >= self.case.limit
        self.owed += m.kind != "cancel"
        if isinstance(m.data, bytes):
            await self.ws.send_bytes(m.data)
        else:
            await self.ws.send_str(m.data)

    async def read(self, until_owed: int = 0, first_only: bool = False) -> bool:
        """Read the server's messages until `until_owed` answers are owed (-1: until the server
        closes), or (first_only) one message; False when the socket closed first."""
        while self.owed > until_owed:
            msg = await self.ws.receive()
            if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                return False
            problem, terminal, chunk_id = message_problem(msg.data, msg.type == aiohttp.WSMsgType.BINARY)
            if problem:
                raise _Violation(problem)
            if chunk_id is not None:
                if chunk_id in self.ended:
                    raise _Violation(f"a chunk of answer {chunk_id} after that answer's end: another "
                                     f"answer's end came inside it ({dict(self.out.counts)})")
                if self.streaming not in (None, chunk_id):
                    raise _Violation(f"answers {self.streaming} and {chunk_id} interleaved")
                self.streaming = chunk_id
            if terminal:
                if self.streaming is not None:
                    self.ended.add(self.streaming)
                    self.streaming = None
                if self.owed == 0:
                    raise _Violation(f"an answer's end with no request owed: {msg.data[:200]!r}")
                self.out.counts[terminal] += 1
                self.owed -= 1
            if first_only:
                return True
        return True

    def close_problem(self) -> str | None:
        """None when the server closed the socket with a code this case allows."""
        code = self.ws.close_code
        self.out.counts[f"close {code}"] += 1
        if (code == 1009 and self.over_limit) or (code == 1000 and self.closing):
            return None
        return f"socket closed by the server with code {code} ({self.owed} answer(s) owed)"


async def run_ws_case(session: aiohttp.ClientSession, base: str, case: WsCase, timeout_s: float) -> WsOutcome:
    out = WsOutcome()
    url = base.replace("http://", "ws://") + "/v1/ws"
    sock: _Socket | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with session.ws_connect(url, max_msg_size=0, autoclose=False) as ws:
                sock = _Socket(ws, case, out)
                open_ = True
                for m in case.messages:
                    if not case.pipelined or m.kind in ("close-mid", "close-then"):
                        open_ = await sock.read()  # the answers owed before, in turn
                        if not open_:
                            break
                    if m.kind == "text-mid":
                        await sock.send(WsMsg("text", m.data, m.what))
                        open_ = await sock.read(first_only=True)
                        if not open_:
                            break
                        continue
                    if m.kind == "close-mid":
                        await sock.send(WsMsg("text", m.data, m.what))
                        if await sock.read(first_only=True):  # an answer begins: the client goes
                            out.counts["closed mid-answer"] += 1
                            return out
                        open_ = False
                        break
                    try:
                        await sock.send(m)
                    except ConnectionError:  # it closed under us: how, the close frame says
                        open_ = await sock.read(-1)
                        break
                    if m.kind == "close-then":
                        open_ = await sock.read(-1)  # answers owed before it may still come
                        break
                    if not case.pipelined:
                        open_ = await sock.read()
                        if not open_:
                            break
                if open_:
                    open_ = await sock.read()
                if open_:  # every answer in: the socket still serves a valid request
                    done = out.counts["done"]
                    await sock.send(WsMsg("text", json.dumps(valid_body("completions")), "probe"))
                    open_ = await sock.read()
                    if open_ and out.counts["done"] == done:
                        return WsOutcome("a valid request after the case was not answered to its done "
                                         f"({dict(out.counts)})", counts=out.counts)
                    if open_:
                        out.counts["probe answered"] += 1
                        return out
                problem = sock.close_problem()
                return WsOutcome(problem, counts=out.counts) if problem else out
    except _Violation as v:
        return WsOutcome(str(v), counts=out.counts)
    except TimeoutError:
        owed = sock.owed if sock is not None else "?"
        return WsOutcome(f"no complete answer in {timeout_s} s (hang; {owed} answer(s) owed, "
                         f"got {dict(out.counts)})", counts=out.counts)
    except (aiohttp.ClientError, ConnectionError) as exc:
        return WsOutcome(f"connection failed: {type(exc).__name__}: {exc}", counts=out.counts)


async def final_ws_checks(bases: dict[str, str], timeout_s: float) -> list[str]:
    """After the run: a valid request on a new socket to each /v1/ws is answered to its done."""
    problems = []
    async with aiohttp.ClientSession() as session:
        for server, base in bases.items():
            case = WsCase(server, [WsMsg("text", json.dumps(valid_body("chat")), "valid")], False)
            out = await run_ws_case(session, base, case, timeout_s)
            if out.problem or out.counts["done"] != 2:
                problems.append(f"[{case.name}] a valid request after the run: {out.problem or out.counts}")
    return problems
