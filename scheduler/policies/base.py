"""The policy interface and what every policy shares.

A policy sees the candidates (workers that serve the model, routable, not excluded)
and picks one, or returns None to say "every candidate is saturated: hold the
request". `refresh(worker)` runs whenever a worker's inputs change (new scrape,
lease issued or released) so that per-decision work stays a single pass of cheap
comparisons: the decision is on every request's path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from scheduler.policies.prefix_index import PrefixIndex
from scheduler.registry import WorkerState
from scheduler.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S, SessionTable


class Request:
    """The scheduler's view of one request (decoded from ScheduleRequest without pydantic)."""

    __slots__ = ("attach", "cached_tokens", "exclude", "flow", "keys", "lora", "max_tokens", "model",
                 "pin", "prefix_hashes", "priority", "prompt_tokens", "reserved_only", "session")

    def __init__(self, model: str, prompt_tokens: int = 0, max_tokens: int | None = None,
                 prefix_hashes: list[int] | None = None, lora: str | None = None,
                 exclude: frozenset[str] | None = None, reserved_only: bool = False,
                 pin: str | None = None, cached_tokens: int = 0, flow: str | None = None,
                 attach: bool = False, priority: int = 0, session: int | None = None) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.prefix_hashes = prefix_hashes or ()
        self.lora = lora
        self.exclude = exclude
        # Place only into room reserved for this prompt's prefix, else wait (the gateway asks
        # so for an arrival while others queue: a follow-up may pass them, nothing else).
        self.reserved_only = reserved_only
        # The one worker this request may go to (ScheduleRequest.worker_id).
        self.pin = pin
        # Of prompt_tokens, those its worker already holds: no prefill work (ScheduleRequest).
        self.cached_tokens = cached_tokens
        # Its tenant in the gateway's queue, when the gateway counts token turns
        # (ScheduleRequest.flow): held calls go in the order of their flows' counters.
        self.flow = flow
        # Already bound for `pin` (ScheduleRequest.attach): a lease there, not a choice.
        self.attach = attach
        # Its priority in the gateway's queue (ScheduleRequest.priority): held calls go in its
        # order, lower first.
        self.priority = priority
        # Its session's key (ScheduleRequest.session), for the policies that keep sessions on
        # a worker (scheduler/sessions.py).
        self.session = session
        # Its prefix index keys, once a policy has computed them (Policy.prefix_keys).
        self.keys: Sequence[int] | None = None


class Pick(NamedTuple):
    worker: WorkerState
    score: float
    detail: dict[str, Any]


@dataclasses.dataclass
class PolicyEnv:
    """What the service shares with its policy."""

    stale_after_s: float = 1.0
    prefix_index: PrefixIndex = dataclasses.field(default_factory=PrefixIndex)
    default_max_tokens: int = 256
    sessions: SessionTable = dataclasses.field(
        default_factory=lambda: SessionTable(DEFAULT_SESSION_TTL_S, DEFAULT_MAX_SESSIONS))


@dataclasses.dataclass
class NoParams:
    pass


class Policy:
    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    # Does this policy ever answer "wait"? (plain policies never do)
    holds: ClassVar[bool] = False

    def __init__(self, params: dict[str, Any] | None = None, env: PolicyEnv | None = None) -> None:
        self.p = build_params(self.Params, params or {}, self.name)
        self.env = env or PolicyEnv()

    def refresh(self, w: WorkerState) -> None:
        """Recompute w.score (lower is better) and w.saturated after its inputs changed."""
        w.score = load_of(w)

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        raise NotImplementedError

    def on_issued(self, req: Request, w: WorkerState, now: float) -> str | None:
        """A lease went to w (prefix-aware policies remember where prefixes live). A policy
        that keeps sessions records the request's session there and returns whether it was
        kept, moved or new (the decision's reason says so); None: no session recorded."""
        return None

    def record_session(self, req: Request, w: WorkerState, now: float) -> str | None:
        """on_issued's part for the policies that keep sessions: the session is w's now."""
        if req.session is None:
            return None
        return self.env.sessions.record(req.session, w.worker_id, now)

    def kv_need(self, req: Request) -> float:
        """KV tokens a new lease counts as taken until a scrape shows the worker's own usage:
        by default the request's whole span (prompt + max_tokens)."""
        return req.prompt_tokens + self.max_tokens(req)

    def prefix_keys(self, req: Request) -> Sequence[int]:
        """The request's fingerprints as the shared prefix index keys them: scoped by model and
        adapter, and bounded (PrefixIndex.keys)."""
        keys = req.keys
        if keys is None:  # once per request: a decision reads them up to four times
            keys = req.keys = self.env.prefix_index.keys(req.prefix_hashes, (req.model, req.lora))
        return keys

    def max_tokens(self, req: Request) -> int:
        """The request's answer limit, or the default the engines apply when none is given."""
        return req.max_tokens if req.max_tokens is not None else self.env.default_max_tokens


def load_of(w: WorkerState) -> float:
    """Requests on the worker: what it reported, reconciled with leases it cannot show yet."""
    return w.running_eff + w.waiting_eff


def build_params(cls: type, values: dict[str, Any], policy: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    clean: dict[str, Any] = {}
    for key, value in values.items():
        f = fields.get(key)
        if f is None:
            raise ValueError(f"unknown parameter policy_params.{key} for policy {policy} "
                             f"(known: {', '.join(fields) or 'none'})")
        clean[key] = _coerce(value, f.type, key)
    return cls(**clean)


def _coerce(value: Any, type_name: Any, key: str) -> Any:
    t = str(type_name)
    try:
        if t.startswith("bool"):
            # Spelled out both ways: anything else was taken as false, so a typo ("ture") in,
            # say, hold_when_saturated turned the hold off without a word.
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if value is None and "None" in t:
            return None
        if t.startswith("int"):
            return int(value)
        if t.startswith("float"):
            # Infinity too: a weight of inf times a term of 0 is NaN, and a NaN score makes
            # every comparison false, so picks would follow the workers' order, not their load.
            # "No cap" is spelled 0 where a cap has that meaning.
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
            return out
    except (TypeError, ValueError):
        raise ValueError(f"invalid value for policy_params.{key}: {value!r} (expected {t})") from None
    return value
