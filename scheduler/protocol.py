"""Wire types between the gateway and the scheduler (JSON over HTTP).

`router` imports these and `scheduler.client`; nothing here imports the router.

POST /v1/schedule   ScheduleRequest  -> 200 ScheduleDecision
                                      -> 503 ScheduleWait   (every eligible worker saturated)
                                      -> 404 OpenAI error   (no worker serves the model)
POST /v1/release    LeaseRelease     -> 204
POST /v1/prefilled  LeasePrefilled   -> 204 (the request's first token came back: its prompt
                                            is prefilled) | 404 unknown, released or reported
POST /v1/renew      LeaseRenewal     -> 204 (the request still runs: its lease expires a TTL from
                                            now) | 404 unknown, released or expired
POST /v1/batch      [{"op": "schedule", ...ScheduleRequest (wait_ms 0)} | {"op": "release",
                    ...LeaseRelease} | {"op": "prefilled", ...LeasePrefilled} | {"op": "renew",
                    ...LeaseRenewal}, ...]
                    -> 200 [[status, answer body or null], ...] (same order)
GET  /v1/channel    WebSocket: one message per batch, as /v1/batch; a batch with a schedule
                    operation is answered by one message (scheduler/channel.py)
GET  /v1/workers    -> {"workers": [WorkerView, ...]}
POST /v1/workers    WorkerRegistration (Authorization: Bearer <registration token>); posting
                    again is the heartbeat -> 201 created / 200 refreshed
DELETE /v1/workers/{worker_id}                  (same token) -> 204
POST /v1/workers/{worker_id}/failure {"error", "refused"}  gateway saw a request fail there
                    ("error": its failure kind, e.g. "connect", "http_500", "draining";
                    "refused": true when the worker's port refused the connection) -> 204

prefix_hashes: cumulative fingerprints (hash i covers the prompt up to chunk i).
"""

from __future__ import annotations

import errno

from pydantic import BaseModel, Field

# Token counts (a schedule call's prompt_tokens, max_tokens, cached_tokens, a release's
# prompt_tokens + output_tokens) are load estimates: past any KV pool they all mean "more than
# fits". JSON allows ints of any length, and a gateway passes on a client's max_tokens (times n)
# and a worker's usage as they come: one past float's range raised OverflowError in the
# scheduler's arithmetic (a 500; on the channel, the end of the connection and of every call in
# flight on it). They are clamped to this, not refused: the request is the engine's to refuse.
MAX_TOKENS_COUNTED = 1 << 40
# Session keys are 63-bit (router/sessions.py): a signed 64-bit integer in any JSON reader.
MAX_SESSION_KEY = (1 << 63) - 1


# Why the scheduler took a worker out (WorkerView.down_cause, set while its state is "down"): the
# cause of its latest failure. A gateway gives up the answers it waits for on a down worker
# unless it went down REFUSED or DRAINING (router/down_watch.py).
REFUSED = "refused"  # its port refuses connections: nothing listens (it drains, or its process is gone)
# It answers new requests 503 "shutting down" and finishes those it took (SIGTERM): our worker
# before its port closes, vLLM's --shutdown-mode drain for its whole drain (its port stays
# open). Also the gateway's failure kind for such an answer (router/upstream_errors.py).
DRAINING = "draining"
CONNECTION_FAILED = "connection"  # connections reset, cut, or not made (an unreachable host, TLS)
UNRESPONSIVE = "unresponsive"  # timeouts, silence: connections taken and nothing answered (hung)
FAILING = "failing"  # it answers, with errors (HTTP 5xx to its scrapes, or to requests in a row)


def connection_refused(exc: BaseException) -> bool:
    """`exc` says the worker's host refused the connection: it is up and nothing listens on the
    port. (aiohttp's ClientConnectorError is an OSError with its cause's errno.)"""
    return isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED


class ScheduleRequest(BaseModel):
    model: str
    prompt_tokens: int = Field(0, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    # Fingerprints of successive fixed-size prefix chunks of the prompt, first chunk first. The
    # gateway sends at most 64 and the prefix index reads 1,024 (MAX_KEYS); a list of 300,000
    # cost the decision 0.1 s and its validation as much again: past 4,096, a 400.
    prefix_hashes: list[int] = Field(default_factory=list, max_length=4096)
    lora: str | None = None
    # Worker ids that already failed this request (retries).
    exclude: list[str] = Field(default_factory=list)
    # Hold the call up to this long when every worker is saturated.
    wait_ms: int = Field(0, ge=0, le=60_000)
    # Only take room the scheduler holds for this prompt's prefix (a follow-up reservation);
    # else answer wait. The gateway sets it for arrivals while its queue is not empty.
    reserved_only: bool = False
    # Only this worker: it holds state the request continues (a stored response its
    # `previous_response_id` names). Its saturation is waited out like any other; the wait's
    # reason says "pinned_worker_unavailable" while it is down and "pinned_worker_gone" once it
    # left the pool (the state went with it).
    worker_id: str | None = Field(None, min_length=1)
    # With worker_id: the request is already bound for that worker, on a connection the gateway
    # holds to it (a WebSocket's next request): the answer is a lease there whatever its load,
    # not a choice, so that its load counts from now and its release frees what it held. A
    # worker no longer in the pool is a wait, "pinned_worker_gone" (the request goes unleased).
    attach: bool = False
    # Of prompt_tokens, those the worker already holds (a stored conversation's history on the
    # worker it is pinned to): KV the request takes, but no prefill work.
    cached_tokens: int = Field(0, ge=0)
    # The tenant the gateway's queue counts it under (router/fairness.py: "id:" and up to 128
    # characters of the header, each spelled out in up to 6 when its bytes are not UTF-8, so
    # under 800). With it, held calls of a model are served in the order of their flows' token
    # counters over every gateway (scheduler/fair_share.py), not in arrival order.
    flow: str | None = Field(None, max_length=1024)
    # The request's priority in the gateway's queue (vLLM's field: lower first, 0 by default).
    # Held calls go in its order before their flows' (the gateway's askers, and other
    # gateways' heads, compete for freed room: without it a priority 5 request already asking
    # took room before a priority -1 one asking beside it).
    priority: int = 0
    # How long the request has waited in its gateway's queue. Held calls go in the order their
    # requests arrived, not their calls: a long poll that ends unanswered is asked again, and
    # went behind every call held since. Arrival, not the queue's place (arrival plus the
    # prompt's weight where the queue serves short prompts first): that order holds within a
    # tenant's flow only, and across replicas without flows (--fair-share requests) it gave
    # every turn to the replica of short prompts, where arrival order alternates the heads.
    waited_ms: int = Field(0, ge=0, le=86_400_000)
    # The client's session (the gateway's --session-header, or the body's prompt_cache_key): a
    # 63-bit digest of its value, never the value (it may be a user id). Policies that honour
    # sessions (llm_aware, session) keep a session's requests on one worker while it can take
    # them (scheduler/sessions.py); the others ignore it.
    session: int | None = Field(None, ge=0, le=MAX_SESSION_KEY)


class ScheduleDecision(BaseModel):
    worker_id: str
    url: str
    lease_id: str
    policy: str
    reason: dict = Field(default_factory=dict)


class ScheduleWait(BaseModel):
    wait: bool = True
    retry_after_ms: int


# A release's `error` when the request's client left (or nobody took the lease): ok, since the
# worker failed nothing, but it served nothing either, so it proves nothing about the worker.
CLIENT_LEFT = "client_disconnected"


class LeaseRelease(BaseModel):
    lease_id: str
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    # Set when the gateway saw the worker fail: "connect", "timeout", "http_5xx", ...
    error: str | None = None
    # The request goes on in the worker after the gateway's part ended (a background response
    # answered `queued`): its load stays counted until a scrape shows it, and nothing is freed.
    handed_off: bool = False


class LeasePrefilled(BaseModel):
    """Sent by the gateway when a streamed request's first token arrives: the worker has
    prefilled its prompt, which its prompt counter shows only at the next scrape."""

    lease_id: str


class LeaseRenewal(BaseModel):
    """Sent by the gateway for a request still running a while after its lease was issued (a
    long generation): the lease's expiry, meant for releases a gateway crash lost, moves to a
    TTL from now instead of ending a lease whose request goes on."""

    lease_id: str


class WorkerRegistration(BaseModel):
    url: str
    models: list[str] = Field(default_factory=list)
    engine: str | None = None  # "vllm", "sglang", "tgi", "triton", ... (else detected)
    worker_id: str | None = None
    # The worker's running-request cap (vLLM --max-num-seqs): held from the first request on.
    max_running: int | None = Field(None, ge=1)


class WorkerView(BaseModel):
    worker_id: str
    url: str
    healthy: bool
    dialect: str | None = None
    models: list[str] = Field(default_factory=list)
    snapshot: dict | None = None
    data_age_ms: float | None = None
    in_flight_leases: int = 0
    score: float | None = None
    # Added by the scheduler: circuit state ("up", "half_open", "down", "unknown"), why the
    # policy counts it saturated (None when it has room), and leases its data cannot show yet.
    state: str | None = None
    saturated: str | None = None
    unseen_leases: int = 0
    # An operator cordoned it (scheduler/cordons.py): healthy, yet no new request goes there,
    # not even by the gateway's round robin while the scheduler is away.
    cordoned: bool = False
    # Why it is down (REFUSED, UNRESPONSIVE, ...), None when it is not; absent from an older
    # scheduler's list (None: a gateway treats the worker as it did, possibly hung).
    down_cause: str | None = None


class WorkerList(BaseModel):
    """GET /v1/workers as the gateway reads it."""

    workers: list[WorkerView]
    # The scheduler started lately and may not know every worker yet (scheduler/startup.py).
    learning: bool = False
