"""What the gateway (and the scheduler behind it) adds to a request.

The same bounded load is sent, in one run, straight to zero-delay workers
(benchmarks/echo_worker.py, round robin done by the load client) and through the
gateway: scheduled (scheduler + gateway) and, for reference, the gateway alone in
round-robin mode (no scheduler). Two shapes: non-stream requests and 16-chunk SSE
streams, at concurrency 32, plus a concurrency-1 probe for time to first chunk.
CPU per request comes from /proc/<pid>/stat (utime+stime) deltas of each process.
With --ab-tracing, one more gateway on the same scheduler exports its OpenTelemetry traces
(--otlp-traces-endpoint; every request traced unless --tracing-sample-ratio says otherwise)
to a local OTLP sink (benchmarks/otlp_sink.py): the cost of tracing, against the gateway
without it, in the same run.

    .venv/bin/python -m benchmarks.gateway_overhead --requests 2000 --streams 1000 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.cluster import free_port
from benchmarks.proc_cpu import cpu_seconds

REPO = Path(__file__).resolve().parents[1]


def spawn(
    args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **env} if env else None,
    )


async def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited")
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status < 500:
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


async def start_echo_workers(
    n: int, logs: Path, procs: list[subprocess.Popen], token_delay_ms: float = 0.0
) -> list[tuple[str, subprocess.Popen]]:
    """n echo workers (appended to `procs` at once, for stop_all), each answering /health."""
    workers = []
    for i in range(n):
        port = free_port()
        p = spawn(
            ["-m", "benchmarks.echo_worker", "--port", str(port), "--model", "m",
             "--token-delay-ms", str(token_delay_ms)],
            logs / f"echo{i}.log",
        )
        procs.append(p)
        workers.append((f"http://127.0.0.1:{port}", p))
    for u, p in workers:
        await wait_ready(u + "/health", p)
    return workers


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process, then wait for each (SIGKILL after 10 s)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


@dataclass
class Result:
    target: str
    shape: str
    n: int
    wall_s: float
    latencies: list[float]
    ttfts: list[float]
    errors: int
    cpu_ms: dict[str, float] = field(default_factory=dict)
    loadavg: float = 0.0

    def row(self) -> dict:
        lat = sorted(self.latencies)
        tt = sorted(self.ttfts)

        def pct(xs: list[float], p: float) -> float:
            return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")

        return {
            "target": self.target,
            "shape": self.shape,
            "n": self.n,
            "errors": self.errors,
            "req_s": round(self.n / self.wall_s, 1),
            "p50_ms": round(pct(lat, 0.5), 2),
            "p99_ms": round(pct(lat, 0.99), 2),
            "ttft_p50_ms": round(pct(tt, 0.5), 3),
            "ttft_p99_ms": round(pct(tt, 0.99), 3),
            **{f"cpu_ms_per_req_{k}": round(v, 3) for k, v in self.cpu_ms.items()},
            "loadavg_1m": self.loadavg,
        }


async def one(session: aiohttp.ClientSession, url: str, stream: bool, lat: list, ttft: list) -> bool:
    body = {"model": "m", "prompt": "Say something short please.", "max_tokens": 16}
    if stream:
        body["stream"] = True
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            await r.read()
            return False
        if stream:
            first = True
            async for _ in r.content.iter_any():
                if first:
                    ttft.append(time.perf_counter() - t0)
                    first = False
        else:
            await r.read()
            ttft.append(time.perf_counter() - t0)
    lat.append(time.perf_counter() - t0)
    return True


async def run_load(
    urls: list[str], n: int, conc: int, stream: bool, pids: dict[str, int], target: str
) -> Result:
    conn = aiohttp.TCPConnector(limit=conc, keepalive_timeout=60)
    lat: list[float] = []
    ttft: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=conn) as s:
        # warm up connections and caches
        await asyncio.gather(*(one(s, urls[i % len(urls)], stream, [], []) for i in range(conc)))
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        counter = iter(range(n))

        async def client() -> None:
            nonlocal errors
            for i in counter:
                try:
                    ok = await one(s, urls[i % len(urls)], stream, lat, ttft)
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                errors += not ok

        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(conc))), timeout=600)
        wall = time.perf_counter() - t0
        cpu = {k: (cpu_seconds(p) - cpu0[k]) * 1000 / n for k, p in pids.items()}
    res = Result(target, "stream16" if stream else "non-stream", n, wall, lat, ttft, errors, cpu)
    res.loadavg = round(os.getloadavg()[0], 1)  # other tenants of the machine, for reading the figures
    return res


async def main_async(args) -> list[dict]:
    logs = Path(args.log_dir)
    procs: list[subprocess.Popen] = []
    try:
        workers = await start_echo_workers(args.workers, logs, procs)
        wurls = [u for u, _ in workers]
        wpids = {f"worker{i}": p.pid for i, (_, p) in enumerate(workers)}

        sport = free_port()
        sched = None
        if args.skip_scheduler:
            return await _run_targets(args, wurls, wpids, None, None, logs, procs)
        sched = spawn(
            [
                "-m",
                "scheduler",
                "--port",
                str(sport),
                "--workers",
                ",".join(wurls),
                "--scrape-interval-ms",
                str(args.scrape_interval_ms),
            ],
            logs / "scheduler.log",
        )
        procs.append(sched)
        surl = f"http://127.0.0.1:{sport}"
        await wait_ready(surl + "/health", sched)
        rows = await _run_targets(args, wurls, wpids, sched, surl, logs, procs)
        if not args.skip_fallback:
            rows.append(await _fallback_switch(args, wurls, sched, sport, logs, procs))
        return rows
    finally:
        stop_all(procs)


async def _run_targets(args, wurls, wpids, sched, surl, logs, procs) -> list[dict]:
    gport, rport = free_port(), free_port()
    common: list[str] = []  # defaults: access log and 5 s stats line on, as deployed
    gw = None
    if sched is not None:
        gw = spawn(
            ["-m", "router", "--port", str(gport), "--scheduler", surl, *common], logs / "gateway.log"
        )
        procs.append(gw)
    gw_traced = sink_url = None
    if sched is not None and args.ab_tracing:
        # The same gateway with its traces on, sent to a collector stand-in of its own process.
        sink_port, tport = free_port(), free_port()
        sink = spawn(["-m", "benchmarks.otlp_sink", "--port", str(sink_port)], logs / "otlp_sink.log")
        procs.append(sink)
        sink_url = f"http://127.0.0.1:{sink_port}"
        await wait_ready(sink_url + "/health", sink)
        gw_traced = spawn(
            ["-m", "router", "--port", str(tport), "--scheduler", surl, *common,
             "--otlp-traces-endpoint", sink_url + "/v1/traces",
             "--otlp-traces-sample-ratio", str(args.tracing_sample_ratio)],
            logs / "gateway_traced.log",
        )
        procs.append(gw_traced)
        await wait_ready(f"http://127.0.0.1:{tport}/health", gw_traced)
    gw_http = None
    if sched is not None and args.ab_http_channel:
        # Same scheduler, the gateway's older wire form: HTTP/1.1-pipelined schedule/release.
        hport = free_port()
        gw_http = spawn(
            ["-m", "router", "--port", str(hport), "--scheduler", surl, *common],
            logs / "gateway_http_channel.log",
            env={"ROUTER_SCHEDULER_CHANNEL": "http"},
        )
        procs.append(gw_http)
        await wait_ready(f"http://127.0.0.1:{hport}/health", gw_http)
    rr = spawn(
        ["-m", "router", "--port", str(rport), "--workers", ",".join(wurls), *common],
        logs / "gateway_rr.log",
    )
    procs.append(rr)
    if gw is not None:
        await wait_ready(f"http://127.0.0.1:{gport}/health", gw)
    await wait_ready(f"http://127.0.0.1:{rport}/health", rr)
    await asyncio.sleep(1.0)  # first scrapes

    targets = [("direct", [u + "/v1/completions" for u in wurls], {})]
    if gw is not None:
        targets.append(
            (
                "gateway+scheduler",
                [f"http://127.0.0.1:{gport}/v1/completions"],
                {"gateway": gw.pid, "scheduler": sched.pid},
            )
        )
    if gw_traced is not None:
        targets.append(
            (
                f"gateway+scheduler, tracing on ({args.tracing_sample_ratio:g})",
                [f"http://127.0.0.1:{tport}/v1/completions"],
                {"gateway": gw_traced.pid, "scheduler": sched.pid},
            )
        )
    if gw_http is not None:
        targets.append(
            (
                "gateway+scheduler, HTTP-pipelined calls",
                [f"http://127.0.0.1:{hport}/v1/completions"],
                {"gateway": gw_http.pid, "scheduler": sched.pid},
            )
        )
    targets.append(
        (
            "gateway (round robin, no scheduler)",
            [f"http://127.0.0.1:{rport}/v1/completions"],
            {"gateway": rr.pid},
        )
    )
    targets += await external_routers(args, wurls, logs, procs)
    runs: list[dict] = []
    for rep in range(args.repeat):  # interleaved repeats: a burst of load from other tenants hits one
        for stream, n in ((False, args.requests), (True, args.streams)):
            for name, urls, pids in targets:
                res = await run_load(urls, n, args.concurrency, stream, {**pids, **wpids}, name)
                runs.append({**res.row(), "rep": rep})
                print(json.dumps(runs[-1]), flush=True)
        # concurrency-1 probe: time to first chunk without queueing in the client or the servers
        for name, urls, pids in targets:
            res = await run_load(urls, args.probe, 1, True, pids, name)
            runs.append({**res.row(), "shape": "stream16 c=1", "rep": rep})
            print(json.dumps(runs[-1]), flush=True)
    rows = _medians(runs)
    if sink_url is not None:
        await asyncio.sleep(6)  # the batch processor's 5 s delay: the last spans come in
        async with aiohttp.ClientSession() as s, s.get(sink_url + "/stats") as r:
            sunk = await r.json()
        # Every request through the traced gateway (warm-ups included) should be there.
        rows.append({"target": "otlp sink", **sunk})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _medians(runs: list[dict]) -> list[dict]:
    """One row per (target, shape): the median of each figure over the repeats."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        out.setdefault((r["target"], r["shape"]), []).append(r)
    rows = []
    for (target, shape), rs in out.items():
        row = {"target": target, "shape": shape, "repeats": len(rs)}
        for k in rs[0]:
            if k not in row and k != "rep" and isinstance(rs[0][k], int | float):
                med = statistics.median(r[k] for r in rs if k in r)
                row[k] = int(med) if isinstance(rs[0][k], int) else round(med, 3)
        rows.append(row)
    return rows


def _spawn_exe(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _external_cmd(name: str, exe: str, port: int, wurls: list[str]) -> list[str]:
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *wurls,
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_port()),
    ]
    return [exe, "launch", *common] if name == "sglang-router" else [exe, *common]


async def external_routers(args, wurls, logs, procs) -> list[tuple[str, list[str], dict]]:
    """Rust routers installed in a separate venv (--sglang-router / --vllm-router PATH), in
    round-robin mode, in front of the same workers. Any tokenizer download goes to a dead port."""
    out = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    for name, exe in (("sglang-router", args.sglang_router), ("vllm-router", args.vllm_router)):
        if not exe:
            continue
        port = free_port()
        p = _spawn_exe(_external_cmd(name, exe, port, wurls), logs / f"{name}.log", env)
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                try:
                    async with s.post(
                        url + "/v1/completions",
                        json={"model": "m", "prompt": "x", "max_tokens": 1},
                        timeout=aiohttp.ClientTimeout(total=2),
                    ) as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, TimeoutError, OSError):
                    pass
                await asyncio.sleep(0.2)
        out.append((f"{name} (round robin)", [url + "/v1/completions"], {"gateway": p.pid}))
    return out


async def _fallback_switch(args, wurls, sched, sport, logs, procs) -> dict:
    """Kill the scheduler under a steady trickle of requests, then restart it; time both switches.
    The gateway runs with the reference defaults (5000 ms timeout, 500 ms try period)."""
    gport = free_port()
    gw = spawn(
        [
            "-m",
            "router",
            "--port",
            str(gport),
            "--scheduler",
            f"http://127.0.0.1:{sport}",
            "--debug-headers",
            "--no-access-log",
        ],
        logs / "gateway_fallback.log",
    )
    procs.append(gw)
    url = f"http://127.0.0.1:{gport}"
    await wait_ready(url + "/health", gw)
    body = {"model": "m", "prompt": "x", "max_tokens": 4}
    out: dict = {"target": "fallback switch", "failed_requests": 0}
    async with aiohttp.ClientSession() as s:

        async def call() -> tuple[str, float]:
            t0 = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    out["failed_requests"] += 1
                return r.headers.get("x-router-policy", ""), time.perf_counter() - t0

        await asyncio.sleep(2.5)  # the gateway has fetched the scheduler's worker list
        assert (await call())[0] != "fallback_round_robin"
        sched.kill()
        sched.wait()
        t_kill = time.perf_counter()
        slowest = 0.0
        while time.perf_counter() - t_kill < 30:
            policy, took = await call()
            slowest = max(slowest, took)
            if policy == "fallback_round_robin":
                break
        out["kill_to_fallback_ms"] = round((time.perf_counter() - t_kill) * 1000, 1)
        out["slowest_request_during_switch_ms"] = round(slowest * 1000, 1)
        n_fb = 0
        t_fb = time.perf_counter()
        while time.perf_counter() - t_fb < 1.0:
            n_fb += (await call())[0] == "fallback_round_robin"
        out["fallback_requests_in_1s"] = n_fb
        new = spawn(
            ["-m", "scheduler", "--port", str(sport), "--workers", ",".join(wurls)],
            logs / "scheduler_restarted.log",
        )
        procs.append(new)
        await wait_ready(f"http://127.0.0.1:{sport}/health", new)
        t_up = time.perf_counter()
        while time.perf_counter() - t_up < 30:
            if (await call())[0] not in ("fallback_round_robin", ""):
                break
        out["scheduler_ready_to_scheduled_ms"] = round((time.perf_counter() - t_up) * 1000, 1)
        async with s.get(url + "/admin/state") as r:
            out["gateway_measured_switch_s"] = (await r.json())["last_switch_s"]
    print(json.dumps(out), flush=True)
    return out


def print_table(rows: list[dict]) -> None:
    cols = [
        "target",
        "shape",
        "n",
        "errors",
        "req_s",
        "p50_ms",
        "p99_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "cpu_ms_per_req_gateway",
        "cpu_ms_per_req_scheduler",
        "loadavg_1m",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        if "n" in r:
            print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    for r in rows:
        if r.get("target") in ("fallback switch", "otlp sink"):
            print(f"{r['target']}:", json.dumps(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--probe", type=int, default=300, help="concurrency-1 streams per target")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved repeats; the table shows medians")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--scrape-interval-ms", type=int, default=100)
    ap.add_argument("--log-dir", default="/tmp/gateway_overhead")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-scheduler", action="store_true", help="only direct and round-robin gateway")
    ap.add_argument(
        "--sglang-router", default=None, help="path of an installed sglang-router executable"
    )
    ap.add_argument("--vllm-router", default=None, help="path of an installed vllm-router executable")
    ap.add_argument(
        "--ab-http-channel",
        action="store_true",
        help="also a gateway using HTTP-pipelined scheduler calls instead of the batch channel",
    )
    ap.add_argument(
        "--ab-tracing",
        action="store_true",
        help="also the gateway with --otlp-traces-endpoint to a local OTLP sink",
    )
    ap.add_argument("--tracing-sample-ratio", type=float, default=1.0,
                    help="with --ab-tracing: its --otlp-traces-sample-ratio (the load sends no traceparent)")
    ap.add_argument("--skip-fallback", action="store_true", help="skip the scheduler kill/restart phase")
    args = ap.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    try:
        import uvloop

        rows = uvloop.run(main_async(args))
    except ImportError:  # pragma: no cover
        rows = asyncio.run(main_async(args))
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
