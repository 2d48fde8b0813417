"""benchmarks/sampler_fuzz.py's WebSocket cases: one socket to the worker's `GET /v1/ws` carrying
two to four hostile completions / chat bodies (the HTTP plan's kind of case, from an rng of its
own), all sent before any answer is read (pipelined), then a valid request on the same socket.

The protocol (inference_worker/server/websocket.py): each request is answered in order, with
chunk objects, then exactly one terminal message: `{"type": "done", "id"}` or an OpenAI error
object. Checked: every message a JSON object (no NaN / Infinity), each answer's chunks of one id
and before its terminal, the i-th terminal the i-th request's; a valid body's terminal `done`
with every choice ended by stop or length and its usage (when sent) between min_tokens and
max_tokens; an invalid one's an error in the OpenAI shape whose type is a client error's
(`invalid_request_error`: the 4xx of HTTP; a `server_error` is the 5xx); and after them the
probe answered to its `done` (the socket still usable).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import aiohttp

from benchmarks.fuzz_checks import error_shape_problem
from benchmarks.fuzz_ws import message_problem
from benchmarks.sampler_fuzz_cases import (
    MODEL,
    Case,
    _length_problem,
    _non_finite,
    expectation,
    expected_choices,
    make_case,
)

PROBE = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
# Error types of a request's own fault (HTTP's 4xx); anything else (server_error) is the 5xx.
_CLIENT_ERROR_TYPES = {"invalid_request_error", "rate_limit_error"}


@dataclass
class WsSocketCase:
    index: int
    cases: list[Case]  # the bodies, in the order sent
    kind: str = "websocket"

    @property
    def labels(self) -> list[str]:
        return [f"[{c.kind}: {'; '.join(c.labels)}]" for c in self.cases]

    def encoded(self) -> bytes:
        return b"\n".join(c.encoded() for c in self.cases)


def ws_plan(seed: int, sockets: int, first_index: int) -> list[WsSocketCase]:
    """`sockets` cases, numbered from `first_index`, from an rng of their own (a seed's HTTP
    cases stay what they were)."""
    rng = random.Random(f"ws-{seed}")
    out = []
    for index in range(first_index, first_index + sockets):
        cases = []
        for i in range(rng.choice([2, 3, 3, 4])):
            case = make_case(rng, i)
            case.body["stream"] = True  # what the socket does with any body: expectation() sees it
            if rng.random() < 0.3:  # the worker's own field picking the API
                case.body["endpoint"] = "chat.completions" if case.kind == "chat" else "completions"
            cases.append(case)
        out.append(WsSocketCase(index, cases))
    return out


def answer_problem(case: Case, chunks: list[dict], terminal: str, error: str) -> str | None:
    """One request's answer on the socket: its chunks, its terminal ("done" or "error") and
    the error message's text."""
    expect = expectation(case)
    if terminal == "error":
        if expect == "ok":
            return f"a valid request answered with an error: {error[:300]}"
        if (problem := error_shape_problem(error.encode())) is not None:
            return problem
        err = json.loads(error)["error"]
        if err["type"] not in _CLIENT_ERROR_TYPES:
            return f"an error of type {err['type']} (a 5xx over HTTP): {error[:300]}"
        return None
    if terminal != "done":
        return f"ended with {terminal}"
    if expect == "bad":
        return "an invalid request answered to its done"
    finished: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                finished[choice["index"]] = choice["finish_reason"]
        usage = chunk.get("usage") or usage
    reasons = [finished.get(i) for i in range(expected_choices(case))]
    if any(r not in ("stop", "length") for r in reasons):
        return f"choices ended with {reasons}"
    return _length_problem(case, usage)


async def run_socket(session: aiohttp.ClientSession, base: str, sock: WsSocketCase,
                     timeout_s: float) -> tuple[int, str | None]:
    """(bodies answered, problem) for one socket case, within `timeout_s` in all."""
    answered = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.ws_connect(base.replace("http://", "ws://") + "/v1/ws",
                                          max_msg_size=0) as ws:
                for case in sock.cases:
                    await ws.send_str(case.encoded().decode())
                for i, case in enumerate([*sock.cases, Case(-1, "completions", PROBE)]):
                    if i == len(sock.cases):  # every answer in: the socket still serves
                        await ws.send_str(json.dumps(PROBE))
                    chunks, ids = [], set()
                    while True:
                        msg = await ws.receive()
                        if msg.type is not aiohttp.WSMsgType.TEXT:
                            return answered, (f"body {i}: the socket ended ({msg.type.name}, code "
                                              f"{ws.close_code}) with {len(sock.cases) + 1 - i} answers owed")
                        problem, terminal, chunk_id = message_problem(msg.data, False)
                        problem = problem or _non_finite(msg.data)
                        if problem:
                            return answered, f"body {i}: {problem}"
                        if terminal is None:
                            chunks.append(json.loads(msg.data))
                            ids.add(chunk_id)
                            continue
                        break
                    if len(ids) > 1:
                        return answered, f"body {i}: chunks of several answers {sorted(ids)} before one end"
                    if terminal == "error" and chunks:
                        terminal = "error after chunks"
                    if (problem := answer_problem(case, chunks, terminal, msg.data)) is not None:
                        return answered, f"body {i} ({'; '.join(case.labels)}): {problem}"
                    answered += 1
                return answered - 1, None
    except TimeoutError:
        return answered, f"no complete answer in {timeout_s} s (hang; {answered} bodies answered)"
    except (aiohttp.ClientError, ConnectionError) as exc:
        return answered, f"connection failed: {type(exc).__name__}: {exc}"
