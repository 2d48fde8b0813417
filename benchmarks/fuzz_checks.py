"""How benchmarks/api_fuzz.py sends one case and judges its answer: the statuses allowed, the
OpenAI error shape, a stream's proper end, and a dropped connection looked into before it counts."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.fuzz_cases import FRAMINGS, STORED_ID, Case, Endpoint, valid_body
from benchmarks.fuzz_procs import MAX_STREAM_BYTES

# ---- checking the answers ------------------------------------------------------------------

@dataclass
class Outcome:
    status: int  # 0: no answer
    problem: str | None  # a violation, or None
    note: str | None = None  # worth a look, not a violation


def error_shape_problem(data: bytes) -> str | None:
    """None when `data` is an OpenAI error body."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return f"error body is not JSON: {data[:200]!r}"
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return f"error body has no error object: {data[:200]!r}"
    missing = [k for k in ("message", "type", "param", "code") if k not in err]
    if missing or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"error object lacks {missing or 'a string message/type'}: {data[:200]!r}"
    return None


def _status_problem(endpoint: Endpoint, status: int, data: bytes) -> str | None:
    if status == 503 and endpoint.kind == "schedule":
        with contextlib.suppress(ValueError):
            if json.loads(data).get("wait") is True:
                return None  # the scheduler's "every worker is saturated", by its protocol
    if status >= 500 and status != 503:
        return f"status {status}: {data[:300]!r}"
    if status >= 400:
        return error_shape_problem(data)
    return None


def _batch_problem(data: bytes) -> str | None:
    try:
        answers = json.loads(data)
    except ValueError:
        return f"batch answer is not JSON: {data[:200]!r}"
    for i, (status, body) in enumerate(answers):
        if status == 503 and isinstance(body, dict) and body.get("wait") is True:
            continue
        if status >= 500 and status != 503:
            return f"batch operation {i}: status {status}"
        if status >= 400 and error_shape_problem(json.dumps(body).encode()):
            return f"batch operation {i}: {error_shape_problem(json.dumps(body).encode())}"
    return None


_TERMINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed", "error")


def stream_problem(endpoint: Endpoint, text: str) -> str | None:
    """None when an event stream ended properly: `data: [DONE]` (chat, completions) or a terminal
    event (the Responses API), else with an error event."""
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    if not events:
        return "stream with no events"
    last = events[-1]
    if last == "[DONE]":
        return None
    try:
        obj = json.loads(last)
    except ValueError:
        return f"stream ends with an unparsable event: {last[:200]!r}"
    if isinstance(obj, dict) and ("error" in obj or obj.get("type") in _TERMINAL_RESPONSE_EVENTS):
        return None
    return f"stream ends without [DONE] or an error: {last[:200]!r}"


async def send(client: httpx.AsyncClient, base: str, case: Case, timeout_s: float,
               stored_id: str = "resp_none") -> Outcome:
    url = base + case.endpoint.path + case.path_suffix.replace(STORED_ID, stored_id)
    # Text that is not ASCII goes as its UTF-8 bytes (httpx encodes str headers as ASCII).
    headers = {k: v if isinstance(v, bytes) or v.isascii() else v.encode() for k, v in case.headers.items()}
    content: Any = case.body.replace(STORED_ID.encode(), stored_id.encode()) if case.method not in (
        "GET", "OPTIONS") else None
    if case.framing and content is not None:
        added, content = FRAMINGS[case.framing](content)
        headers.update(added)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(case.method, url, headers=headers, content=content) as r:
                chunks, size = [], 0
                async for chunk in r.aiter_raw():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_STREAM_BYTES:
                        return Outcome(r.status_code, f"answer over {MAX_STREAM_BYTES} bytes")
                data = b"".join(chunks)
                if r.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                status = r.status_code
                problem = _status_problem(case.endpoint, status, data)
                if problem is None and status < 300 and status != 204 and case.method != "OPTIONS":
                    if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                        problem = stream_problem(case.endpoint, data.decode(errors="replace"))
                    elif case.endpoint.kind == "batch":
                        problem = _batch_problem(data)
                    else:
                        try:
                            json.loads(data)
                        except ValueError:
                            problem = f"2xx body is not JSON: {data[:200]!r}"
                if status == 200 and case.endpoint.kind in ("schedule", "batch"):
                    await release_leases(client, base, data)
                return Outcome(status, problem)
    except TimeoutError:
        return Outcome(0, f"no complete answer in {timeout_s} s (hang)")
    except httpx.LocalProtocolError as exc:
        return Outcome(-1, None if "header" in str(exc).lower() else f"client refused: {exc}")
    except httpx.HTTPError as exc:
        return Outcome(0, f"connection dropped without an answer: {type(exc).__name__}: {exc}")


async def send_checked(client: httpx.AsyncClient, base: str, case: Case, timeout_s: float,
                       stored_id: str) -> Outcome:
    """send(); a connection dropped unanswered is sent again once, on a new connection. A server
    may close a kept-alive connection between two requests (HTTP lets it), and a request sent
    on it as it closes is lost: clients retry then. The same request dropped on a fresh
    connection too is the violation; answered there, a note."""
    out = await send(client, base, case, timeout_s, stored_id)
    if out.status != 0 or out.problem is None or "dropped" not in out.problem:
        return out
    if case.framing.startswith("chunked") or (case.framing and len(case.body) > 1 << 20):
        return await _answered_mid_body(base, case, timeout_s, out)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as fresh:
        again = await send(fresh, base, case, timeout_s, stored_id)
    if again.problem is None:
        again.note = f"{out.problem}; on a new connection: {again.status}"
    return again


async def _answered_mid_body(base: str, case: Case, timeout_s: float, dropped: Outcome) -> Outcome:
    """A body sent in paced pieces (or a large one), the connection dropped: a server that
    refuses a request while its body still comes (a decoding error, a header it cannot parse)
    answers, then closes the connection, and the client's next bytes meet a reset, which may
    discard the answer before the client reads it. Sent again in three pieces, reading after
    each: a 4xx in the OpenAI shape there is a note (the answer was sent); anything else the
    violation."""
    host, port = base.removeprefix("http://").split(":")
    added, framed = FRAMINGS[case.framing](case.body)
    data = framed if isinstance(framed, bytes) else case.body  # a paced one: its pieces' bytes
    headers = {**case.headers, **added, "Host": host, "Transfer-Encoding": "chunked"}
    head = f"{case.method} {case.endpoint.path}{case.path_suffix} HTTP/1.1\r\n".encode()
    for k, v in headers.items():
        head += k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()) + b"\r\n"
    step = max(1, len(data) // 3)
    chunks = [b"%x\r\n%b\r\n" % (len(p), p) for p in
              (data[i:i + step] for i in range(0, len(data), step))] + [b"0\r\n\r\n"]
    chunks[0] = head + b"\r\n" + chunks[0]
    raw = b""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                for chunk in chunks:
                    writer.write(chunk)
                    try:
                        raw = await asyncio.wait_for(reader.read(1 << 20), 2.0)
                        break  # answered (or closed) before the next piece
                    except TimeoutError:
                        continue
                while raw and b"\r\n\r\n" in raw and not raw.rstrip().endswith(b"}"):
                    more = await reader.read(1 << 20)
                    if not more:
                        break
                    raw += more
            finally:
                writer.close()
    except (TimeoutError, OSError) as exc:
        return Outcome(0, f"{dropped.problem}; sent again piece by piece: {exc!r}")
    status_line, _, rest = raw.partition(b"\r\n")
    parts = status_line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    body = rest.partition(b"\r\n\r\n")[2]
    problem = _status_problem(case.endpoint, status, body) if status else "no answer"
    if status < 400 or problem:
        return Outcome(status, f"{dropped.problem}; sent again piece by piece: {status} {problem or ''}")
    return Outcome(status, None, f"answered {status} while the body still came, then the connection "
                                 "closed under the rest of the upload (a reset)")


async def stored_response(gateway: str) -> str:
    """A response the worker stores, for the stored-response calls to name."""
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(gateway + "/v1/responses", json={**valid_body("responses"), "store": True})
        r.raise_for_status()
        return r.json()["id"]


async def release_leases(client: httpx.AsyncClient, base: str, data: bytes) -> None:
    """Give back leases the fuzz took (schedule calls that got a worker): left, they would hold
    room until their TTL and the gateway's requests would queue behind them."""
    with contextlib.suppress(ValueError, httpx.HTTPError):
        obj = json.loads(data)
        bodies = [obj] if isinstance(obj, dict) else [b for _, b in obj if isinstance(b, dict)]
        for b in bodies:
            if "lease_id" in b:
                await client.post(base + "/v1/release", json={"lease_id": b["lease_id"], "ok": True})
