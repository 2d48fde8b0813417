"""Hostile sampling parameters against one real-model worker, with greedy canaries beside them.

    python -m benchmarks.sampler_fuzz --seed 1 --requests 300 [--responses 75 --ws-sockets 12]

Starts one `python -m inference_worker` (torch backend, SmolLM2 on CPU unless WORKER_TEST_MODEL /
WORKER_TEST_DEVICE say otherwise) on 127.0.0.1 with small limits (8 sequences, a 128-token
context, a small KV pool), so that its limits are reachable. Then sends N seeded requests, a few
at a time, each setting one to four sampling parameters to values at or past their edges
(temperatures of 0 and denormals, top_p / min_p that keep one token, top_k 0 / -1 / huge, a
logit bias on every token, penalties at their bounds or infinite, seeds at int64's ends,
thousands of stop strings, min_tokens against max_tokens, prompts and answers at the context
limit, n up to 128, echo with logprobs, guided-decoding options, out-of-vocabulary token ids,
NaN and Infinity literals, ...). Continuous batching puts them in the same forward and the same
sampler call as one another and as two greedy streaming "canary" requests (a completion and a
chat, temperature 0, a fixed prompt) that run all the while: their text must be the one they
gave alone before the run, every time.

Besides those completions and chat requests over HTTP (`--requests N`, the seed's plan as it
was): `--responses R` requests to the Responses API, the same values on its fields and on the
vLLM extras it passes on, streamed or whole, a quarter in the background (followed to their end)
and a quarter continuing a response stored before the run (sampler_fuzz_responses.py); and
`--ws-sockets W` WebSockets to /v1/ws, each carrying two to four hostile bodies pipelined, then
a valid one (sampler_fuzz_ws.py). All of them mixed in the same batches as the canaries.

Each hostile answer is checked: a 4xx in the OpenAI error shape where the request is invalid,
a proper answer (every choice ended by stop or length, numbers finite, streams ended by
[DONE] with no error event) where it is valid; never a 5xx or a hang. After the run: the worker
alive, a valid request answered, /metrics served, no traceback in its log. Every violation is
printed with a reproducer (`--replay I`: the same case alone, canaries beside it); the exit
status is 1 on any. Bounded: N + R requests and W sockets, each under --client-timeout-s (plus
the time the tokens it asks for take at 40 tokens/s), dispatch stops at --time-limit-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from benchmarks.fuzz_checks import stream_problem
from benchmarks.fuzz_procs import Proc
from benchmarks.fuzz_ws import interleave
from benchmarks.sampler_fuzz_cases import (
    CANARIES,
    ENDPOINTS,
    KV_BLOCKS,
    MODEL,
    WORKER_FLAGS,
    Case,
    plan,
)
from benchmarks.sampler_fuzz_responses import is_background, responses_plan
from benchmarks.sampler_fuzz_send import Outcome, post, send_any, store_seeds
from benchmarks.sampler_fuzz_ws import WsSocketCase, ws_plan


async def canary_text(client: httpx.AsyncClient, base: str, kind: str, timeout_s: float) -> str:
    """The streamed text of a canary; raises ValueError on any problem with its answer."""
    status, data, _ = await post(client, base + ENDPOINTS[kind].path, json.dumps(CANARIES[kind]).encode(),
                                 timeout_s)
    text = data.decode(errors="replace")
    if status != 200 or stream_problem(ENDPOINTS[kind], text):
        raise ValueError(f"status {status}: {text[-300:]!r}")
    parts, reasons = [], []
    for line in text.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        obj = json.loads(line[5:])
        if "error" in obj:
            raise ValueError(f"error event: {line[:300]}")
        for choice in obj["choices"]:
            delta = choice.get("text") if kind == "completions" else choice["delta"].get("content")
            parts.append(delta or "")
            reasons.append(choice.get("finish_reason"))
    if reasons[-1:] != ["length"]:
        raise ValueError(f"ended with {reasons[-1:]}, not length (ignore_eos, 12 tokens)")
    return "".join(p or "" for p in parts)


CANARY_PROBLEMS_KEPT = 6


@dataclass
class CanaryLog:
    runs: int = 0
    beside: int = 0  # runs that started with hostile requests in flight
    problems: list[str] = field(default_factory=list)


async def canary_loop(client: httpx.AsyncClient, base: str, kind: str, reference: str, stop: asyncio.Event,
                      log: CanaryLog, timeout_s: float, in_flight: list[int]) -> None:
    while not stop.is_set():
        beside = sorted(in_flight)
        log.beside += bool(beside)
        try:
            text = await canary_text(client, base, kind, timeout_s)
        except (ValueError, TimeoutError, httpx.HTTPError) as exc:
            log.problems.append(f"{kind} canary failed beside cases {beside}: {type(exc).__name__}: {exc}")
            if len(log.problems) >= CANARY_PROBLEMS_KEPT:
                return  # a dead engine fails each at once: the loop would spin
            continue
        finally:
            log.runs += 1
        if text != reference:
            log.problems.append(f"{kind} canary beside cases {beside} gave {text!r}, alone {reference!r}")


async def run_cases(base: str, cases: list[Case | WsSocketCase], concurrency: int, time_limit_s: float,
                    timeout_s: float) -> tuple[list[Outcome], CanaryLog, dict[str, str]]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client, \
            aiohttp.ClientSession() as session:
        stored_ids = await store_seeds(client, base, timeout_s)  # what previous_response_id names
        references = {}
        for kind in CANARIES:  # alone, twice: greedy must already agree with itself
            first, second = [await canary_text(client, base, kind, timeout_s) for _ in range(2)]
            if first != second:
                raise RuntimeError(f"the {kind} canary is not deterministic alone: {first!r} vs {second!r}")
            references[kind] = first
        stop, log, in_flight = asyncio.Event(), CanaryLog(), []
        canaries = [asyncio.create_task(canary_loop(client, base, kind, ref, stop, log, timeout_s, in_flight))
                    for kind, ref in references.items()]
        gate = asyncio.Semaphore(concurrency)
        deadline = time.monotonic() + time_limit_s

        async def one(case: Case | WsSocketCase) -> Outcome | None:
            async with gate:
                if time.monotonic() > deadline:
                    return None
                in_flight.append(case.index)
                try:
                    return await send_any(client, session, base, case, stored_ids, timeout_s)
                finally:
                    in_flight.remove(case.index)

        try:
            outcomes = [o for o in await asyncio.gather(*(one(c) for c in cases)) if o is not None]
        finally:
            stop.set()
            await asyncio.gather(*canaries)
        return outcomes, log, references


def statuses(outcomes: list[Outcome], kinds: Any) -> dict[int, int]:
    by_status: dict[int, int] = {}
    for o in outcomes:
        if o.case.kind in kinds:
            by_status[o.status] = by_status.get(o.status, 0) + 1
    return dict(sorted(by_status.items()))


def summary(outcomes: list[Outcome]) -> str:
    """What the Responses and WebSocket cases sent (the CI test checks they were)."""
    resp = [o.case for o in outcomes if o.case.kind == "responses"]
    socks = [o.case for o in outcomes if isinstance(o.case, WsSocketCase)]
    return (f"responses: {len(resp)} sent ({sum(bool(c.body.get('stream')) for c in resp)} streamed, "
            f"{sum(is_background(c) for c in resp)} background, "
            f"{sum('previous_response_id' in c.body for c in resp)} with previous_response_id); "
            f"statuses: {statuses(outcomes, ('responses',))}\n"
            f"websocket: {len(socks)} sockets, {sum(len(s.cases) for s in socks)} bodies pipelined, "
            f"{sum(o.status for o in outcomes if isinstance(o.case, WsSocketCase))} answered in order")


def preemptions(worker: Proc) -> str:
    """The worker's vllm:num_preemptions_total, for the summary (the run is harder with some)."""
    try:
        text = httpx.get(worker.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return "?"
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:num_preemptions_total")]
    return lines[0].rsplit(" ", 1)[-1] if lines else "?"


def after_run_problems(worker: Proc, timeout_s: float) -> list[str]:
    problems = []
    if not worker.alive():
        return [f"worker exited with {worker.p.returncode}"]
    try:
        r = httpx.post(worker.url + "/v1/completions", timeout=timeout_s,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0})
        if r.status_code != 200 or len(r.json()["choices"]) != 1:
            problems.append(f"a valid request after the run: {r.status_code} {r.text[:200]}")
        m = httpx.get(worker.url + "/metrics", timeout=timeout_s)
        if m.status_code != 200 or "vllm:num_requests_running" not in m.text:
            problems.append(f"/metrics after the run: {m.status_code}")
        h = httpx.get(worker.url + "/health", timeout=timeout_s)
        if h.status_code != 200:
            problems.append(f"/health after the run: {h.status_code}")
    except httpx.HTTPError as exc:
        problems.append(f"after the run: {type(exc).__name__}: {exc}")
    output = worker.output()
    if "Traceback" in output:
        at = output.index("Traceback")
        problems.append(f"traceback in the worker's log:\n{output[max(0, at - 500):at + 3000]}")
    return problems


def start_worker(start_timeout_s: float, kv_blocks: int = KV_BLOCKS) -> Proc:
    model = os.environ.get("WORKER_TEST_MODEL", MODEL)
    device = ("--device", os.environ["WORKER_TEST_DEVICE"]) if "WORKER_TEST_DEVICE" in os.environ else ()
    worker = Proc.start("worker", "inference_worker", "--model", model, "--served-model-name", MODEL,
                        "--host", "127.0.0.1", *WORKER_FLAGS, "--num-kv-blocks", str(kv_blocks), *device)
    try:
        worker.wait_ready(time.monotonic() + start_timeout_s)
    except BaseException:
        worker.stop()
        raise
    return worker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=200, help="completions and chat requests over HTTP")
    ap.add_argument("--responses", type=int, default=None, help="/v1/responses requests (default: N / 4)")
    ap.add_argument("--ws-sockets", type=int, default=None,
                    help="WebSockets of 2-4 pipelined bodies each (default: requests / 25, at least 1)")
    ap.add_argument("--time-limit-s", type=float, default=600.0, help="no case is sent after it")
    ap.add_argument("--concurrency", type=int, default=3, help="hostile requests at a time (2-4)")
    ap.add_argument("--client-timeout-s", type=float, default=180.0)
    ap.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help="the worker's KV pool (16-token blocks)")
    ap.add_argument("--replay", type=int, action="append", default=[],
                    help="send only the plan's case I (repeatable), canaries beside it")
    args = ap.parse_args(argv)
    n_resp = args.requests // 4 if args.responses is None else args.responses
    n_ws = max(1, args.requests // 25) if args.ws_sockets is None else args.ws_sockets
    # Numbered one after the other: the seed's HTTP cases as they were, then the Responses ones,
    # then the sockets; sent mixed, so that each kind meets the others in the batch.
    http = plan(args.seed, args.requests)
    responses = responses_plan(args.seed, n_resp, args.requests)
    sockets = ws_plan(args.seed, n_ws, args.requests + n_resp)
    by_index = [*http, *responses, *sockets]
    mixed = interleave(interleave(http, responses, max(1, args.requests // max(1, n_resp))),
                       sockets, max(1, (args.requests + n_resp) // max(1, n_ws)))
    cases = [by_index[i] for i in args.replay] if args.replay else mixed
    started = time.monotonic()
    worker = start_worker(180.0, args.kv_blocks)
    failed = True
    try:
        outcomes, canaries, references = asyncio.run(run_cases(
            worker.url, cases, args.concurrency, args.time_limit_s, args.client_timeout_s))
        after = after_run_problems(worker, args.client_timeout_s)
        preempted = preemptions(worker)
        violations = [o for o in outcomes if o.problem]
        failed = bool(violations or canaries.problems or after)
    finally:
        worker.stop()
        if failed:
            print(f"worker log kept: {worker.log}")
        else:
            worker.log.unlink(missing_ok=True)
    sent = sum(o.case.kind in ENDPOINTS for o in outcomes)
    print(f"sent {sent} requests in {time.monotonic() - started:.0f} s (seed {args.seed}, {args.concurrency} "
          f"at a time, {args.kv_blocks} KV blocks, {preempted} preemptions); "
          f"statuses: {statuses(outcomes, ENDPOINTS)}")
    print(summary(outcomes))
    print(f"canaries: {canaries.runs} runs, {canaries.beside} started beside hostile requests; "
          f"references {references}")
    for o in violations:
        c = o.case
        print(f"\nVIOLATION case {c.index} ({c.kind}; {'; '.join(c.labels)}): {o.problem}\n"
              f"  reproduce: python -m benchmarks.sampler_fuzz --seed {args.seed} --requests {args.requests} "
              f"--responses {n_resp} --ws-sockets {n_ws} --replay {c.index}\n"
              f"  body: {c.encoded()[:400].decode(errors='replace')}")
    for p in canaries.problems:
        print(f"\nVIOLATION canary: {p}")
    for p in after:
        print(f"\nVIOLATION after the run: {p}")
    print(f"\nviolations: {len(violations)} in answers, {len(canaries.problems)} canary, "
          f"{len(after)} after the run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
