"""The chaos soak's load: a closed loop of chat completions, streamed and whole, spread over
several gateway replicas, each request's fate written down as the client saw it.

A request goes to one replica (round robin by index) and moves to the next only when no
answer came at all: the connection was refused, reset or closed before a status line (as a
load balancer in front of replicas retries a request no replica took; a SIGKILLed gateway's
requests still waiting for their worker end that way). Anything after a status line is the
answer, kept as it came: a stream whose gateway dies after its first event is cut, not
replayed (a load balancer cannot replay half an answer either).

A surge (`Surge`) adds clients for a while on top of the steady ones, so that the load
exceeds what the workers run at once and requests wait in the gateways' queues and the
scheduler's held calls (the steady load alone never saturates the cluster).

Every answer is checked whole: the sim workers run each request to `max_tokens`
(`ignore_eos`), so an answer of fewer tokens, or a stream without its `[DONE]`, is a failure
even with a 200.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

# No answer from this replica: the request never reached a gateway that took it.
NO_ANSWER = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# How long a request keeps looking for a replica that answers (both gone at once would be a
# run that lost its front door, which the schedule never does).
FAILOVER_WINDOW_S = 15.0
FAILOVER_PAUSE_S = 0.2  # after every replica refused in a row


@dataclass
class Workload:
    """What each request asks, drawn from one seed so that runs compare."""

    model: str
    stream_share: float = 0.5
    min_prompt_words: int = 20
    max_prompt_words: int = 400
    min_tokens: int = 16
    max_tokens: int = 160
    seed: int = 0

    def request(self, index: int) -> tuple[bool, dict[str, Any]]:
        """(streamed?, the body) of request `index`."""
        rng = random.Random(f"{self.seed}-{index}")
        stream = rng.random() < self.stream_share
        words = rng.randint(self.min_prompt_words, self.max_prompt_words)
        prompt = " ".join(f"w{rng.randrange(5000)}" for _ in range(words))
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": rng.randint(self.min_tokens, self.max_tokens),
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return stream, body


@dataclass(frozen=True)
class Surge:
    """`extra` more clients in a closed loop from `start_s` to `end_s` of the run (requests
    sent then; those in flight at `end_s` end as usual)."""

    start_s: float
    end_s: float
    extra: int


@dataclass
class Outcome:
    """One request as its client saw it; times are seconds on the run's clock."""

    index: int
    request_id: str
    stream: bool
    max_tokens: int
    start_s: float
    end_s: float | None = None
    # Replicas tried, in order (indexes into the gateway list); the last one answered, if any did.
    gateways: list[int] = field(default_factory=list)
    no_answer: list[str] = field(default_factory=list)  # why each earlier replica gave none
    status: int | None = None  # the HTTP status (None: no replica answered)
    worker: str | None = None  # x-router-worker
    policy: str | None = None  # x-router-policy (--debug-headers)
    started: bool = False  # a stream's 200 and at least one event reached the client
    ttft_s: float | None = None  # first content token (streams only)
    max_gap_s: float = 0.0  # a stream's longest wait between two events (a stalled worker's mark)
    tokens: int = 0  # content tokens received (usage's count when it came)
    usage_tokens: int | None = None
    done: bool = False  # a stream's [DONE], or a whole answer read
    error_code: str | None = None  # the OpenAI error's code (or type) in the body or last event
    error_message: str | None = None
    error_s: float | None = None  # when the error (event, body or cut) came
    transport_error: str | None = None  # the connection failed after the answer began
    unfinished: bool = False  # still running at the run's wall-clock cap
    surge: bool = False  # sent by a surge's client, not a steady one
    queue_ms: float | None = None  # x-router-queue-ms: how long its gateway looked for a worker

    @property
    def gateway(self) -> int | None:
        return self.gateways[-1] if self.gateways and self.status is not None else None

    @property
    def ok(self) -> bool:
        return (self.status == 200 and self.done and self.error_code is None
                and self.transport_error is None and self.tokens == self.max_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gateway": self.gateway, "ok": self.ok}


def _error_of(doc: Any) -> tuple[str, str] | None:
    """(code, message) of an OpenAI error document, else None."""
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
        return None
    err = doc["error"]
    code = err.get("code") if isinstance(err.get("code"), str) else err.get("type")
    return str(code), str(err.get("message", ""))[:300]


class ChaosClient:
    """`await client.run(count, stop)` keeps `concurrency` requests in flight until `count`
    were sent or `stop` is set (plus each surge's while it lasts), and returns one Outcome per
    request sent."""

    def __init__(self, gateway_urls: list[str], workload: Workload, concurrency: int,
                 clock: float, request_timeout_s: float = 300.0) -> None:
        self.gateway_urls = gateway_urls
        self.workload = workload
        self.concurrency = concurrency
        self.clock = clock  # time.monotonic() of the run's 0
        self.request_timeout_s = request_timeout_s
        self.outcomes: list[Outcome] = []
        self.id_prefix = f"chaos-{uuid.uuid4().hex[:6]}-"
        self._indexes = itertools.count()  # shared by every client loop: one id per request

    def now(self) -> float:
        return time.monotonic() - self.clock

    async def run(self, count: int, stop: asyncio.Event, surges: tuple[Surge, ...] = ()) -> list[Outcome]:
        # Connections are not shared across requests' fates: a replica that went away leaves
        # no pooled connection for the next request to trip on (a fresh one is refused at once).
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def loop(until_s: float = float("inf"), surge: bool = False) -> None:
                while not stop.is_set() and self.now() < until_s:
                    index = next(self._indexes)
                    if index >= count:
                        return
                    await self._one(session, index, surge)

            async def surging(s: Surge) -> None:
                await asyncio.sleep(max(0.0, s.start_s - self.now()))
                await asyncio.gather(*(loop(s.end_s, True) for _ in range(s.extra)))

            await asyncio.gather(*(loop() for _ in range(self.concurrency)), *(surging(s) for s in surges))
        return self.outcomes

    async def _one(self, session: aiohttp.ClientSession, index: int, surge: bool = False) -> None:
        stream, body = self.workload.request(index)
        out = Outcome(index=index, request_id=f"{self.id_prefix}{index}", stream=stream,
                      max_tokens=body["max_tokens"], start_s=self.now(), surge=surge)
        self.outcomes.append(out)
        try:
            await self._send(session, out, body)
        except asyncio.CancelledError:
            out.unfinished = True  # cut by the run's cap: the caller cancelled it
            raise
        finally:
            out.end_s = self.now()

    async def _send(self, session: aiohttp.ClientSession, out: Outcome, body: dict[str, Any]) -> None:
        n = len(self.gateway_urls)
        headers = {"x-request-id": out.request_id}
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        give_up = time.monotonic() + FAILOVER_WINDOW_S
        for attempt in itertools.count():
            g = (out.index + attempt) % n
            out.gateways.append(g)
            url = f"{self.gateway_urls[g]}/v1/chat/completions"
            try:
                resp = await session.post(url, json=body, headers=headers, timeout=timeout)
            except NO_ANSWER as exc:
                out.no_answer.append(f"gateway{g}: {type(exc).__name__}: {exc}"[:200])
                if time.monotonic() > give_up:
                    out.error_code, out.error_s = "no_gateway_answered", self.now()
                    return
                if (attempt + 1) % n == 0:
                    await asyncio.sleep(FAILOVER_PAUSE_S)
                continue
            except TimeoutError:
                out.error_code, out.error_s = "client_timeout", self.now()
                return
            async with resp:
                out.status = resp.status
                out.worker = resp.headers.get("x-router-worker")
                out.policy = resp.headers.get("x-router-policy")
                queue_ms = resp.headers.get("x-router-queue-ms")
                out.queue_ms = float(queue_ms) if queue_ms is not None else None
                try:
                    if out.stream and resp.status == 200 and resp.content_type == "text/event-stream":
                        await self._read_stream(resp, out)
                    else:
                        await self._read_whole(resp, out)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    out.transport_error = f"{type(exc).__name__}: {exc}"[:300]
                    out.error_s = self.now()
            return

    async def _read_whole(self, resp: aiohttp.ClientResponse, out: Outcome) -> None:
        raw = await resp.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            out.error_code, out.error_message = "unreadable_body", raw[:300].decode(errors="replace")
            out.error_s = self.now()
            return
        if (err := _error_of(doc)) is not None or resp.status != 200:
            out.error_code, out.error_message = err or (f"http_{resp.status}", "")
            out.error_s = self.now()
            return
        usage = doc.get("usage") or {}
        out.usage_tokens = usage.get("completion_tokens")
        out.tokens = out.usage_tokens or 0
        out.done = True

    async def _read_stream(self, resp: aiohttp.ClientResponse, out: Outcome) -> None:
        content = 0
        last = None
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            out.started = True
            now = self.now()
            if last is not None:
                out.max_gap_s = max(out.max_gap_s, now - last)
            last = now
            if payload == b"[DONE]":
                out.done = True
                break
            doc = json.loads(payload)
            if (err := _error_of(doc)) is not None:
                out.error_code, out.error_message = err
                out.error_s = self.now()
                continue  # the gateway still ends the stream with [DONE]
            for choice in doc.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    content += 1
                    if out.ttft_s is None:
                        out.ttft_s = self.now() - out.start_s
            usage = doc.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                out.usage_tokens = int(usage["completion_tokens"])
        out.tokens = out.usage_tokens if out.usage_tokens is not None else content
        if not out.done and out.error_code is None:
            out.transport_error, out.error_s = "stream ended without [DONE]", self.now()
