"""How benchmarks/sampler_fuzz.py sends each kind of case and reads its answer to its end:
completions and chat over HTTP, the Responses API (a background one followed until it ends),
and the WebSocket's sockets (sampler_fuzz_ws.py); each answer judged by its kind's checks."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
import httpx

from benchmarks.fuzz_checks import error_shape_problem
from benchmarks.sampler_fuzz_cases import (
    ENDPOINTS,
    MAX_MODEL_LEN,
    Case,
    _non_finite,
    answer_problem,
    expectation,
    expected_choices,
)
from benchmarks.sampler_fuzz_responses import (
    PATH,
    STORED,
    STORED_SEEDS,
    encoded,
    events_problem,
    is_background,
    response_problem,
    responses_expectation,
)
from benchmarks.sampler_fuzz_ws import WsSocketCase, run_socket


@dataclass
class Outcome:
    case: Case | WsSocketCase
    status: int  # a socket's: the bodies answered
    problem: str | None


async def post(client: httpx.AsyncClient, url: str, content: bytes, timeout_s: float
               ) -> tuple[int, bytes, str]:
    async with asyncio.timeout(timeout_s):
        async with client.stream("POST", url, content=content, timeout=timeout_s,  # the client's is less
                                 headers={"Content-Type": "application/json"}) as r:
            data = b"".join([chunk async for chunk in r.aiter_raw()])
            return r.status_code, data, r.headers.get("Content-Type", "")


# The slowest decoding a valid request met here: a 2-core CPU, four hostile requests and two
# canaries batched, ~50 tokens/s. A request for many tokens (up to the plan's TOKEN_BUDGET, as
# 8 prompts x n=128) gets the time they take on top of the client timeout: slow is no hang.
MIN_TOKENS_PER_S = 40.0
MAX_CHOICES = 1024  # the worker's limit on prompts x n


def work_s(case: Case) -> float:
    """The seconds the tokens a case asks for may take (none for an invalid one: refused at once)."""
    if (responses_expectation(case) if case.kind == "responses" else expectation(case)) == "bad":
        return 0.0
    b = case.body
    limit = {"responses": b.get("max_output_tokens"), "completions": b.get("max_tokens", 16),
             "chat": b.get("max_completion_tokens", b.get("max_tokens"))}[case.kind]
    choices = 1 if case.kind == "responses" else expected_choices(case)
    tokens = (limit if isinstance(limit, int) and limit > 0 else MAX_MODEL_LEN) * min(choices, MAX_CHOICES)
    return tokens / MIN_TOKENS_PER_S


async def send_case(client: httpx.AsyncClient, base: str, case: Case, timeout_s: float) -> Outcome:
    timeout_s += work_s(case)
    try:
        status, data, ctype = await post(client, base + ENDPOINTS[case.kind].path, case.encoded(), timeout_s)
    except TimeoutError:
        return Outcome(case, 0, f"no complete answer in {timeout_s} s (hang)")
    except httpx.HTTPError as exc:
        return Outcome(case, 0, f"connection dropped: {type(exc).__name__}: {exc}")
    try:
        return Outcome(case, status, answer_problem(case, status, data, ctype))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # an answer not in its shape
        return Outcome(case, status, f"unparsable answer ({type(exc).__name__}: {exc}): {data[:300]!r}")


async def send_any(client: httpx.AsyncClient, session: aiohttp.ClientSession, base: str,
                   case: Case | WsSocketCase, stored_ids: dict[str, str], timeout_s: float) -> Outcome:
    if isinstance(case, WsSocketCase):
        timeout_s += sum(work_s(c) for c in case.cases)
        return Outcome(case, *await run_socket(session, base, case, timeout_s))
    if case.kind == "responses":
        return Outcome(case, *await send_responses(client, base, case, stored_ids, timeout_s + work_s(case)))
    return await send_case(client, base, case, timeout_s)


async def send_responses(client: httpx.AsyncClient, base: str, case: Case, stored_ids: dict[str, str],
                         timeout_s: float) -> tuple[int, str | None]:
    """(status, problem) for one Responses case; a background one is followed to its end (GET,
    polled a few times a second, within `timeout_s` in all)."""
    expect, status = responses_expectation(case), 0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", base + PATH, content=encoded(case, stored_ids),
                                     headers={"Content-Type": "application/json"}, timeout=timeout_s) as r:
                data = b"".join([chunk async for chunk in r.aiter_raw()])
                status, ctype = r.status_code, r.headers.get("Content-Type", "")
            if status >= 500 or status < 200:
                return status, f"status {status}: {data[:300]!r}"
            if status >= 400:
                if expect == "ok":
                    return status, f"a valid request refused with {status}: {data[:300]!r}"
                return status, error_shape_problem(data)
            if expect == "bad":
                return status, f"an invalid request answered {status}: {data[:300]!r}"
            text = data.decode(errors="replace")
            if ctype.startswith("text/event-stream"):
                return status, events_problem(case, text)
            if (problem := _non_finite(text)) is not None:
                return status, problem
            obj = json.loads(text)
            if not is_background(case):
                return status, response_problem(case, obj)
            if (problem := response_problem(case, obj, live_ok=True)) is not None:
                return status, f"the background answer: {problem}"
            while obj.get("status") in ("queued", "in_progress"):
                await asyncio.sleep(0.2)  # a poll: GET is how a client learns a background answer ended
                r2 = await client.get(f"{base}{PATH}/{obj['id']}")
                if r2.status_code != 200:
                    return status, f"GET of the background response: {r2.status_code} {r2.text[:300]}"
                obj = r2.json()
            return status, response_problem(case, obj)
    except TimeoutError:
        return status, f"no complete answer in {timeout_s} s (hang)"
    except httpx.HTTPError as exc:
        return status, f"connection dropped: {type(exc).__name__}: {exc}"
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # not in its shape
        return status, f"unparsable answer ({type(exc).__name__}: {exc})"


async def store_seeds(client: httpx.AsyncClient, base: str, timeout_s: float) -> dict[str, str]:
    """Stores the responses that previous_response_id names (the second continues the first)."""
    ids: dict[str, str] = {}
    for placeholder, body in zip(STORED, STORED_SEEDS, strict=True):
        if "previous_response_id" in body:
            body = {**body, "previous_response_id": ids[body["previous_response_id"]]}
        r = await client.post(base + PATH, json=body, timeout=timeout_s)
        if r.status_code != 200 or r.json().get("status") not in ("completed", "incomplete"):
            raise RuntimeError(f"storing a response for previous_response_id: {r.status_code} {r.text[:300]}")
        ids[placeholder] = r.json()["id"]
    return ids
