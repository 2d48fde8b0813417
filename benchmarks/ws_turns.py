"""What the gateway adds to each request on a WebSocket, now that every request on a socket
takes a lease of its own (one scheduler round trip, `attach`, before it goes to the worker).

The same bounded load, in one run: S sockets, each sending R requests one after another
(16-token answers from zero-delay echo workers), straight to a worker, through the gateway in
round-robin mode (no scheduler: no leases) and through the gateway with the scheduler. It
reports each request's time from its message to its `done`, requests per second, and CPU per
request of the gateway and the scheduler (/proc). Targets are interleaved over `--repeat`
rounds; the table shows each target's median over the rounds.

    .venv/bin/python -m benchmarks.ws_turns --sockets 1,16 --requests 400 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp

from benchmarks.cluster import free_port
from benchmarks.gateway_overhead import spawn, start_echo_workers, stop_all, wait_ready
from benchmarks.proc_cpu import cpu_seconds

_BODY = json.dumps({"model": "m", "prompt": "Say something short please.", "max_tokens": 16})


async def _socket(session: aiohttp.ClientSession, url: str, n: int, lat: list[float]) -> int:
    """n requests in turn on one socket; returns how many did not end in `done`."""
    failed = 0
    async with session.ws_connect(url + "/v1/ws") as ws:
        for _ in range(n):
            t0 = time.perf_counter()
            await ws.send_str(_BODY)
            while True:
                msg = await ws.receive(timeout=30)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    return failed + 1
                if msg.data.startswith(('{"type":"done"', '{"error"')):  # the echo worker's, compact
                    failed += msg.data.startswith('{"error"')
                    break
            lat.append(time.perf_counter() - t0)
    return failed


async def run(url: str, sockets: int, requests: int, pids: dict[str, int]) -> dict:
    lat: list[float] = []
    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(_socket(s, url, 4, []) for _ in range(sockets)))  # warm up
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        per = max(1, requests // sockets)
        failed = await asyncio.wait_for(asyncio.gather(*(_socket(s, url, per, lat) for _ in range(sockets))),
                                        timeout=600)
        wall = time.perf_counter() - t0
        cpu = {k: round((cpu_seconds(p) - cpu0[k]) * 1000 / len(lat), 3) for k, p in pids.items()}
    lat.sort()
    return {"n": len(lat), "failed": sum(failed), "req_s": round(len(lat) / wall, 1),
            "mean_ms": round(statistics.fmean(lat) * 1000, 3), "p50_ms": round(lat[len(lat) // 2] * 1000, 3),
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000, 3),
            **{f"cpu_ms_per_req_{k}": v for k, v in cpu.items()}}


async def main_async(args: argparse.Namespace) -> list[dict]:
    logs = Path(args.log_dir)
    procs: list[subprocess.Popen] = []
    try:
        workers = await start_echo_workers(2, logs, procs)
        wurls = [u for u, _ in workers]
        sport, gport, rport = free_port(), free_port(), free_port()
        sched = spawn(["-m", "scheduler", "--port", str(sport), "--workers", ",".join(wurls)],
                      logs / "scheduler.log")
        procs.append(sched)
        surl = f"http://127.0.0.1:{sport}"
        await wait_ready(surl + "/health", sched)
        gw = spawn(["-m", "router", "--port", str(gport), "--scheduler", surl], logs / "gateway.log")
        rr = spawn(["-m", "router", "--port", str(rport), "--workers", ",".join(wurls)],
                   logs / "gateway_rr.log")
        procs += [gw, rr]
        for port, p in ((gport, gw), (rport, rr)):
            await wait_ready(f"http://127.0.0.1:{port}/health", p)
        targets = {
            "direct": (wurls[0], {}),
            "gateway round robin": (f"http://127.0.0.1:{rport}", {"gateway": rr.pid}),
            "gateway + scheduler": (f"http://127.0.0.1:{gport}", {"gateway": gw.pid, "scheduler": sched.pid}),
        }
        runs: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.repeat):
            for sockets in args.sockets:
                for name, (url, pids) in targets.items():
                    runs.setdefault((name, sockets), []).append(await run(url, sockets, args.requests, pids))
        rows = []
        for (name, sockets), rs in runs.items():
            row = {"target": name, "sockets": sockets}
            for key in rs[0]:
                row[key] = round(statistics.median(r[key] for r in rs), 3)
            rows.append(row)
        return rows
    finally:
        stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sockets", default="1,16", help="comma-separated socket counts")
    ap.add_argument("--requests", type=int, default=400, help="requests per target and socket count")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--log-dir", default="/tmp/ws_turns")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.sockets = [int(x) for x in args.sockets.split(",")]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(main_async(args))
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
