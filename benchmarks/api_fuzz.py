"""Adversarial inputs against the product's HTTP APIs, on real processes.

Starts two sim workers, a scheduler over them and a gateway on 127.0.0.1, then sends `--requests`
seeded requests, each a valid OpenAI (or scheduler wire) request with one to three things broken:
a field of the wrong JSON type, missing or unknown, an extreme number (negative, 0, 1e308, NaN,
Infinity, a 400-digit int), an empty, huge or unencodable string, deep nesting, bytes that are not
UTF-8, a body that is not JSON, a wrong Content-Type or Content-Encoding, odd chat messages and
content parts, odd stream / stream_options / n / best_of / logprobs / stop / logit_bias / seed /
response_format / tools values, odd headers (X-Request-Id, Expect, huge ones, many), odd paths
and methods; one in seven also goes framed oddly (FRAMINGS: gzip, deflate, a Content-Encoding
that lies, a gzip bomb, chunked in paced pieces). They go to the gateway's /v1/chat/completions,
/v1/completions, /v1/responses (and its stored responses), /v1/embeddings, /tokenize and
/detokenize, straight to one worker's same endpoints, and to the scheduler's request endpoints
(/v1/schedule, /v1/release, /v1/prefilled, /v1/renew, /v1/batch, /v1/workers/{id}/failure,
POST /v1/workers). One case in eight (drawn after the HTTP ones, so a seed's HTTP cases stay
as they were; --no-ws leaves them out) opens a WebSocket to the gateway's or a worker's /v1/ws
and sends 1-4 messages on it: broken requests, text that is not JSON, binary frames, messages
past the size limit, odd cancels, a message after a close, requests before the previous answer
ended, a close mid-answer (benchmarks/fuzz_ws.py, which says what it checks and which close
codes it allows).

Each answer is checked:
- no 5xx, except 503 in the OpenAI error shape (a worker or gateway that is draining or out of
  room answers so by design, and clients retry it) and the scheduler's 503 `{"wait": true, ...}`
  on /v1/schedule and in /v1/batch (its wire protocol's "every worker is saturated":
  scheduler/protocol.py); every other status is allowed: 2xx, 404, 405, 408, 413, 417, ...;
- a 4xx body in the OpenAI error shape {"error": {"message", "type", "param", "code"}};
- a 2xx JSON body parses; a stream ends properly (`data: [DONE]`, or for /v1/responses a
  terminal event) or with an error event; /v1/batch's inner answers follow the same rules;
- an answer within `--client-timeout-s` (else: a hang), and no connection dropped unanswered.
  A drop is looked into before it counts (send_checked): a request answered on a new connection
  (its kept-alive one closed under it) or, sent in paced pieces, answered before its body ended
  (then the connection closed under the rest: a reset) is a note, not a violation.
After the run every process must be alive, a valid request to each endpoint must still get 200
(on a new socket to each /v1/ws: its done), and no process log may hold a 'Traceback'. Prints
counts per endpoint and status (for the sockets: what came) and each violation with its request
(method, URL, headers, body; a socket's messages); exits 1 on any violation, and then keeps the
processes' logs.

`python -m benchmarks.api_fuzz --seed 1 --requests 2000 --time-limit-s 300`
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import httpx

from benchmarks.fuzz_cases import ENDPOINTS, Case, mutate, valid_body
from benchmarks.fuzz_checks import release_leases, send_checked, stored_response, stream_problem
from benchmarks.fuzz_procs import Stack, sim_stack
from benchmarks.fuzz_ws import WsCase, final_ws_checks, interleave, run_ws_case, ws_case

# ---- the run ---------------------------------------------------------------------------------

@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)  # (endpoint, status)
    ws_counts: Counter = field(default_factory=Counter)  # (endpoint, what came: done, error, close <code>)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sent: int = 0
    ws_sent: int = 0


# One WebSocket case after each WS_EVERY HTTP ones: one in eight of the plan.
WS_EVERY = 7


def plan(seed: int, n: int, ws: bool = True) -> list[Case | WsCase]:
    """n HTTP cases, and (ws) one WebSocket case after each WS_EVERY of them. The WebSocket
    cases are drawn from the same RNG after the HTTP ones, so a seed's HTTP cases are the ones
    it had before they came."""
    rnd = random.Random(seed)
    http = [mutate(rnd.choice(ENDPOINTS), rnd) for _ in range(n)]
    return interleave(http, [ws_case(rnd) for _ in range(n // WS_EVERY)], WS_EVERY) if ws else list(http)


async def fuzz(stack: Stack, cases: list[Case | WsCase], time_limit_s: float, timeout_s: float,
               concurrency: int) -> Report:
    report = Report()
    stored_id = await stored_response(stack.gateway.url)
    bases = {"gateway": stack.gateway.url, "worker": stack.workers[0].url, "scheduler": stack.scheduler.url}
    deadline = time.monotonic() + time_limit_s
    queue: asyncio.Queue[Case | WsCase] = asyncio.Queue()
    for c in cases:
        queue.put_nowait(c)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client, \
            aiohttp.ClientSession() as ws_session:
        async def runner() -> None:
            while not queue.empty() and time.monotonic() < deadline:
                case = queue.get_nowait()
                if isinstance(case, WsCase):
                    base = bases[case.server]
                    ws_out = await run_ws_case(ws_session, base, case, timeout_s)
                    report.ws_sent += 1
                    for what, count in ws_out.counts.items():
                        report.ws_counts[(case.name, what)] += count
                    if ws_out.problem:
                        report.violations.append(f"[{case.name}] {case.mutation}: {ws_out.problem}\n"
                                                 f"    reproduce: {case.reproducer(base)}")
                    continue
                base = bases[case.endpoint.server]
                out = await send_checked(client, base, case, timeout_s, stored_id)
                report.sent += 1
                report.counts[(case.endpoint.name, out.status)] += 1
                if out.note:
                    report.notes.append(f"[{case.endpoint.name}] {case.mutation}: {out.note}")
                if out.problem:
                    report.violations.append(f"[{case.endpoint.name}] {case.mutation}: {out.problem}\n"
                                             f"    reproduce: {case.reproducer(base)}")
        await asyncio.gather(*(runner() for _ in range(concurrency)))
    return report


def final_checks(stack: Stack, timeout_s: float) -> list[str]:
    """Every process alive, a valid request to each endpoint answered, no traceback logged."""
    problems = [f"{p.name} is dead (exit {p.p.returncode})" for p in stack.procs if not p.alive()]
    with httpx.Client(timeout=timeout_s) as client:
        for ep in ENDPOINTS:
            if ep.kind in ("embeddings", "release", "prefilled", "renew", "failure", "register", "stored"):
                continue  # no valid call answers 200 here (no embeddings model; made-up leases)
            base = {"gateway": stack.gateway.url, "worker": stack.workers[0].url,
                    "scheduler": stack.scheduler.url}[ep.server]
            body = valid_body(ep.kind)
            try:
                r = client.post(base + ep.path, json=body)
                status = r.status_code
            except httpx.HTTPError as exc:
                problems.append(f"[{ep.name}] a valid request failed after the run: {exc!r}")
                continue
            if status != 200:
                problems.append(f"[{ep.name}] a valid request got {status} after the run: {r.text[:300]}")
            elif ep.kind in ("schedule", "batch"):
                asyncio.run(_release_after(base, r.content))
            if ep.kind == "chat" and status == 200:  # and a stream
                with client.stream("POST", base + ep.path, json={**body, "stream": True}) as s:
                    problem = stream_problem(ep, s.read().decode(errors="replace"))
                if problem:
                    problems.append(f"[{ep.name}] a valid stream after the run: {problem}")
        try:  # a response stored now is there to read (through the gateway: it finds its worker)
            rid = asyncio.run(stored_response(stack.gateway.url))
            r = client.get(f"{stack.gateway.url}/v1/responses/{rid}")
            if r.status_code != 200:
                problems.append(f"[gw stored] reading a stored response got {r.status_code}: {r.text[:300]}")
        except httpx.HTTPError as exc:
            problems.append(f"[gw stored] storing or reading a response failed after the run: {exc!r}")
    problems += asyncio.run(final_ws_checks({"gateway": stack.gateway.url, "worker": stack.workers[0].url},
                                            timeout_s))
    for p in stack.procs:
        out = p.output()
        at = out.find("Traceback")
        if at >= 0:
            problems.append(f"{p.name}'s log holds a Traceback:\n{out[max(0, at - 500):at + 3000]}")
    return problems


async def _release_after(base: str, data: bytes) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        await release_leases(client, base, data)


def print_report(report: Report, problems: list[str], elapsed_s: float) -> None:
    print(f"sent {report.sent} requests and {report.ws_sent} WebSocket cases in {elapsed_s:.1f} s")
    by_endpoint: dict[str, Counter] = {}
    for (name, status), count in report.counts.items():
        by_endpoint.setdefault(name, Counter())[status] = count
    print(f"{'endpoint':<20} answers by status (0: none, -1: the client would not send it)")
    for name in sorted(by_endpoint):
        statuses = ", ".join(f"{s}: {c}" for s, c in sorted(by_endpoint[name].items()))
        print(f"{name:<20} {statuses}")
    ws_by_endpoint: dict[str, Counter] = {}
    for (name, what), count in report.ws_counts.items():
        ws_by_endpoint.setdefault(name, Counter())[what] = count
    if ws_by_endpoint:
        print(f"{'WebSocket':<20} what came (answers' ends, probes answered, closes by code)")
    for name in sorted(ws_by_endpoint):
        print(f"{name:<20} " + ", ".join(f"{w}: {c}" for w, c in sorted(ws_by_endpoint[name].items())))
    print(f"violations: {len(report.violations)} in answers, {len(problems)} after the run")
    for v in report.violations:
        print("  " + v)
    for p in problems:
        print("  " + p)
    if report.notes:
        print(f"notes (not violations): {len(report.notes)}")
        for n in report.notes:
            print("  " + n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--time-limit-s", type=float, default=300.0, help="no request is sent past it")
    ap.add_argument("--client-timeout-s", type=float, default=20.0, help="past it, an answer is a hang")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--no-ws", action="store_true", help="HTTP cases only (no WebSocket cases)")
    args = ap.parse_args(argv)
    cases = plan(args.seed, args.requests, ws=not args.no_ws)
    t0 = time.monotonic()
    failed = False
    with sim_stack(keep_logs=lambda: failed) as stack:
        report = asyncio.run(fuzz(stack, cases, args.time_limit_s, args.client_timeout_s, args.concurrency))
        elapsed = time.monotonic() - t0
        problems = final_checks(stack, args.client_timeout_s)
        failed = bool(report.violations or problems)
    print_report(report, problems, elapsed)
    return 1 if report.violations or problems else 0


if __name__ == "__main__":
    sys.exit(main())
