"""Which worker stores which response: the Responses API's state lives in one worker.

A worker that stores responses (vLLM with `VLLM_ENABLE_RESPONSES_API_STORE=1`, ours by
default) keeps them in its own process. So a request that continues one
(`previous_response_id`) must reach that worker, and so must `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel`: any other worker answers 404.

The gateway learns an answer's worker from the answer itself (the id of a whole response, or
of a stream's `response.created` event) into a bounded map, least recently used out first.
An id it has not seen (another gateway replica served that turn, or this one restarted) is
looked for on every known worker at once with `GET /v1/responses/{id}`; the first that has
it is its owner. A follow-up is then placed by the scheduler on that worker only
(ScheduleRequest.worker_id): it waits while the worker is full, like any request.

Concurrent calls on one unknown id share one round of probes, and an id nobody holds is not
asked about again for a second: a client polling an id that does not exist (or many clients
at once) costs the workers one GET each per second, not one per call.

A response lives in its worker's memory only, so it is lost with it: the worker restarted
(it answers 404 for an id it held), or it is unreachable and left the pool. Such an id is
remembered as lost (bounded like the owners), so that every later call on it, whatever the
path, says the response was lost and with which worker, instead of a bare "not found" once
the owner is forgotten. An id never seen here whose worker was lost is only "not found": no
worker holds it, and nothing tells the gateway it existed.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from ssl import SSLContext
from urllib.parse import quote

import aiohttp

from router.sse import usage_of_body
from router.tokens import RESPONSES_PATH
from scheduler.clip import clip
from scheduler.tls import PeerContext

# /v1/responses/{id} and what hangs under it (/cancel, /input_items): calls on a stored response.
STORED_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/[^/]+)?")
# The first id in a response object (whole, or in a stream's response.created event) is the
# response's own: both vLLM and our worker write it first, and item ids are not `resp_`.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]{1,256})"')
# How many response owners are remembered: an entry is ~200 bytes.
DEFAULT_MAX_OWNERS = 100_000
PROBE_TIMEOUT_S = 2.0
# How long an id that no worker holds is answered "missing" without asking again, and how many
# such ids are remembered.
MISSING_TTL_S = 1.0
MAX_MISSING = 10_000
# How many lost responses are remembered: ids polled after their worker went (an entry is
# ~150 bytes); past it, the oldest are only "not found".
MAX_LOST = 100_000
# Why a response was lost (Lost.cause), in the words of the error that says so.
DROPPED = "which no longer holds it (the worker restarted, or dropped or deleted the response)"
LEFT = "which left the pool"


@dataclass(frozen=True, slots=True)
class Owner:
    worker_id: str
    url: str
    # The stored conversation's length (the response's input plus output tokens; 0: not known
    # yet): its next turn holds that much KV on the worker again without prefilling it.
    tokens: int = 0
    # When the worker was last known in the pool with it (time.monotonic(): it answered a
    # request placed there, or a probe of the workers listed): a worker list older than that
    # may predate the worker's joining, and says nothing of its leaving.
    in_pool_at: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class Lost:
    """A response that was lost with its worker: `cause` is DROPPED or LEFT."""
    worker_id: str
    cause: str


def response_id_in(data: bytes) -> str | None:
    found = _RESPONSE_ID.search(data)
    if found is None:
        return None
    try:
        return found.group(1).decode()
    except UnicodeDecodeError:  # no id a client could send back (what a worker sends is not trusted)
        return None


def not_found_message(response_id: str) -> str:
    """vLLM's words for a response it does not hold."""
    return f"Response with id '{clip(response_id)}' not found."


def lost_message(response_id: str, lost: Lost) -> str:
    """vLLM's words, then why: a client polling a background response learns that it will
    never finish, and why."""
    return (f"{not_found_message(response_id)[:-1]}: it was lost with worker {lost.worker_id!r}, "
            f"{lost.cause}; a response lives in its worker's memory only.")


class ResponseOwners:
    def __init__(self, max_size: int = DEFAULT_MAX_OWNERS) -> None:
        self.max_size = max_size
        self._owners: OrderedDict[str, Owner] = OrderedDict()
        self._missing: OrderedDict[str, float] = OrderedDict()  # id -> when to ask again
        self._probing: dict[str, asyncio.Task[Owner | None]] = {}
        self._lost: OrderedDict[str, Lost] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def learn(self, response_id: str | None, worker_id: str, url: str, tokens: int = 0,
              in_pool_at: float | None = None) -> Owner | None:
        """Remember the response's worker (`in_pool_at`: see Owner; None: now)."""
        if response_id is None:
            return None
        in_pool_at = time.monotonic() if in_pool_at is None else in_pool_at
        owner = self._owners[response_id] = Owner(worker_id, url, tokens, in_pool_at)
        self._owners.move_to_end(response_id)
        self._missing.pop(response_id, None)
        self._lost.pop(response_id, None)
        if len(self._owners) > self.max_size:
            self._owners.popitem(last=False)
        return owner

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)

    def mark_lost(self, response_id: str, worker_id: str, cause: str) -> Lost:
        """The response is gone with its worker: forgotten as owned, remembered as lost."""
        self._owners.pop(response_id, None)
        self._missing.pop(response_id, None)
        lost = self._lost[response_id] = Lost(worker_id, cause)
        self._lost.move_to_end(response_id)
        if len(self._lost) > MAX_LOST:
            self._lost.popitem(last=False)
        return lost

    def lost(self, response_id: str) -> Lost | None:
        return self._lost.get(response_id)

    def get(self, response_id: str) -> Owner | None:
        """The worker remembered as storing the response."""
        owner = self._owners.get(response_id)
        if owner is not None:
            self._owners.move_to_end(response_id)
        return owner

    async def locate(
        self,
        response_id: str,
        workers: Iterable[tuple[str, str]],
        session: aiohttp.ClientSession,
        tls: PeerContext,
        headers: dict[str, str],
    ) -> Owner | None:
        """The first of `workers` ((worker_id, url) pairs) whose GET /v1/responses/{id}
        answers 200, remembered from then on. None: nobody has it. `tls`: the workers' context
        (its current one read as each probe starts)."""
        retry_at = self._missing.get(response_id)
        if retry_at is not None:
            if time.monotonic() < retry_at:
                return None
            del self._missing[response_id]
        probe = self._probing.get(response_id)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(response_id, list(workers), session, tls.request_ssl,
                                                      headers))
            self._probing[response_id] = probe
            probe.add_done_callback(lambda _: self._probing.pop(response_id, None))
        # Shielded: a caller that goes away does not stop the probe the others wait on.
        return await asyncio.shield(probe)

    async def _probe(self, response_id: str, workers: list[tuple[str, str]], session: aiohttp.ClientSession,
                     ssl: SSLContext | bool, headers: dict[str, str]) -> Owner | None:
        probes = [asyncio.ensure_future(self._holds(session, ssl, Owner(wid, url), response_id, headers))
                  for wid, url in workers]
        try:
            for next_done in asyncio.as_completed(probes):
                found = await next_done
                if found is not None:
                    return self.learn(response_id, found.worker_id, found.url, found.tokens)
        finally:
            for probe in probes:
                probe.cancel()
        self._missing[response_id] = time.monotonic() + MISSING_TTL_S
        if len(self._missing) > MAX_MISSING:
            self._missing.popitem(last=False)
        return None

    @staticmethod
    async def _holds(session: aiohttp.ClientSession, ssl: SSLContext | bool, worker: Owner, response_id: str,
                     headers: dict[str, str]) -> Owner | None:
        """The worker, with the response's length from its usage, if it stores the response."""
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        url = f"{worker.url}{RESPONSES_PATH}/{quote(response_id, safe='')}"
        try:
            async with session.get(url, headers=headers, timeout=timeout, ssl=ssl) as r:
                if r.status != 200:
                    return None
                prompt, output = usage_of_body(await r.read())
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None  # a worker down holds nothing it could serve now
        return Owner(worker.worker_id, worker.url, (prompt or 0) + (output or 0))
