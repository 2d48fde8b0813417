"""What a SIGKILLed gateway leaves in the scheduler, and how long it stays.

Real processes on 127.0.0.1: two echo workers (tokens 100 ms apart, so a 600-token answer runs
a minute), a scheduler over them (100 ms scrapes, running cap `--cap` per worker, as vLLM's
--max-num-seqs declared), gateway A. `--requests` long streams go through A; A is SIGKILLed
with all of them in flight (its clients' and workers' connections drop, the workers stop those
answers); gateway B starts. Printed every second for `--observe-s`: per worker, the open leases,
the worker's own running count, why the policy counts it saturated, and how requests sent
through B fared (each a 4-token answer: status and seconds). The scheduler's lease TTL is its
default (600 s) unless `--lease-ttl-s` says otherwise.

`python -m benchmarks.gateway_crash_leases --requests 80 --cap 40 --observe-s 20`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from tests.router.procs import poll_until, start_echo_worker, start_gateway, start_scheduler


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int, started: list[int]) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": max_tokens, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            started.append(r.status_code)
            async for _ in r.aiter_lines():
                pass
    except httpx.HTTPError:
        pass  # the gateway was killed under it


async def _probe(url: str) -> tuple[int, float]:
    """One short request through the new gateway: (status, seconds)."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        try:
            r = await client.post(url + "/v1/completions",
                                  json={"model": "m", "prompt": "x", "max_tokens": 4})
            return r.status_code, time.monotonic() - t0
        except httpx.HTTPError:
            return 0, time.monotonic() - t0


def _view(surl: str) -> list[dict]:
    body = httpx.get(surl + "/v1/workers", timeout=5).json()
    return [{"worker": w["worker_id"], "leases": w["in_flight_leases"], "unseen": w["unseen_leases"],
             "running": (w["snapshot"] or {}).get("running"), "saturated": w["saturated"]}
            for w in body["workers"]]


def _series(surl: str, prefix: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(surl + "/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def run(args: argparse.Namespace) -> None:
    procs = []
    try:
        workers = [start_echo_worker(token_delay_ms=100) for _ in range(2)]
        procs += [p for p, _ in workers]
        sched, surl = start_scheduler([u for _, u in workers], "--scrape-interval-ms", "100",
                                      "--worker-max-running", json.dumps({"*": args.cap}),
                                      "--lease-ttl-s", str(args.lease_ttl_s), *args.scheduler_flag)
        procs.append(sched)
        gw_a, url_a = start_gateway("--scheduler", surl)
        procs.append(gw_a)
        started: list[int] = []
        client = httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10),
                                   limits=httpx.Limits(max_connections=None))
        tasks = [asyncio.create_task(_stream(client, url_a, 600, started)) for _ in range(args.requests)]
        await asyncio.to_thread(poll_until, lambda: sum(w["leases"] for w in _view(surl)) >= args.requests,
                                "every request leased", 60)
        await asyncio.sleep(1.0)  # every worker's scrape shows them running
        print("before the kill:", _view(surl))
        t_kill = time.monotonic()
        gw_a.kill()
        gw_b, url_b = start_gateway("--scheduler", surl)
        procs.append(gw_b)
        print(f"gateway B up {time.monotonic() - t_kill:.1f} s after the kill")
        probes: list[asyncio.Task] = []
        for _ in range(args.observe_s):
            probes.append(asyncio.create_task(_probe(url_b)))
            await asyncio.sleep(1.0)
            t = time.monotonic() - t_kill
            done = [p.result() for p in probes if p.done()]
            print(f"t={t:5.1f}s workers={_view(surl)} probes done={len(done)}/{len(probes)} "
                  f"ok={sum(1 for s, _ in done if s == 200)} "
                  f"max_s={max((d for _, d in done), default=0):.1f}")
        print("metrics:", _series(surl, "scheduler_worker_in_flight_leases"),
              _series(surl, "scheduler_gateway"), _series(surl, "scheduler_lease_releases_total"))
        for p in probes:
            p.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *probes, return_exceptions=True)
        await client.aclose()
    finally:
        for p in procs:
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--cap", type=int, default=40, help="each worker's declared running cap")
    ap.add_argument("--observe-s", type=int, default=20)
    ap.add_argument("--lease-ttl-s", type=float, default=600.0)
    ap.add_argument("--scheduler-flag", action="append", default=[], help="passed on to the scheduler")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
