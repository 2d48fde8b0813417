"""A bounded soak with failures injected: an operator's bad day in one run.

Four sim workers, the scheduler and two gateway replicas serve a steady closed-loop load of
chat completions (half streamed, half whole), spread over both gateways by a client that moves
a request to the other replica only when no answer came (benchmarks/chaos_client.py). At fixed
times of the run (benchmarks/chaos_faults.py):

    kill worker0     SIGKILL, restarted a few seconds later
    term worker1     SIGTERM: it drains and exits; restarted
    kill scheduler   SIGKILL, restarted (the gateways serve by round robin meanwhile)
    kill worker3     (full mode) SIGKILL while the scheduler is away, restarted
    term gateway1    SIGTERM: it drains and exits; restarted
    stop worker2     SIGSTOP (a hung process), SIGCONT later

Every request's outcome is classed from what README.md and DESIGN.md promise
(benchmarks/chaos_outcomes.py): ok; a failure the design names as beyond it (a stream already
answering when its worker is SIGKILLed ends with an error event, ...); or `lost`, a failure
where the design says the product survives. Each fault is checked to have happened and its
target to have served again (benchmarks/chaos_checks.py). Printed: counts per class per fault,
TTFT before/during/after each fault; `--output` writes it all as JSON, every request included.
Exit status 1 when a request was lost or a fault is not verified.

    python -m benchmarks.chaos --output /tmp/chaos.json          # ~3.5 minutes
    python -m benchmarks.chaos --quick                           # well under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.chaos_checks import check_faults
from benchmarks.chaos_client import ChaosClient, Outcome, Workload
from benchmarks.chaos_faults import Fault, FaultRecord, Injector
from benchmarks.chaos_logs import GatewayLogs, log_lines_for
from benchmarks.chaos_outcomes import LOST, Settings, fault_views
from benchmarks.chaos_report import checks_text, summarize, table
from benchmarks.cluster import Cluster, ClusterSpec

POLICY = "llm_aware"


@dataclass(frozen=True)
class Mode:
    """One shape of the soak: load, schedule and the services' flags."""

    load_s: float  # the load runs this long (or until `requests` were sent)
    tail_s: float  # then what is in flight has this long to end (the wall-clock cap: load + tail)
    concurrency: int
    requests: int
    workload: Workload
    faults: list[Fault]
    gateway_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    span_s: float = 10.0  # TTFT "before" and "after" a fault: requests begun this long around it


def full_mode(model: str) -> Mode:
    """The services' defaults (the design's timeouts: round robin after 5 s without the
    scheduler, a hung worker down after 10 s), about 3 minutes of load."""
    return Mode(
        load_s=185, tail_s=75, concurrency=32, requests=4000,
        workload=Workload(model, min_prompt_words=20, max_prompt_words=400, min_tokens=16, max_tokens=160),
        faults=[Fault(20, "kill", "worker0", 5), Fault(50, "term", "worker1", 3),
                Fault(80, "kill", "scheduler", 8),
                # Two at once: a worker dies while the gateways route by round robin alone.
                Fault(86, "kill", "worker3", 5),
                Fault(115, "term", "gateway1", 3), Fault(145, "stop", "worker2", 15)])


def quick_mode(model: str) -> Mode:
    """Short answers and the services' timeouts shortened (round robin after 1 s, a hung
    worker down after 2 s), so that every fault and its recovery fit in half a minute."""
    return Mode(
        load_s=30, tail_s=20, concurrency=16, requests=1500,
        workload=Workload(model, min_prompt_words=10, max_prompt_words=150, min_tokens=8, max_tokens=48),
        faults=[Fault(2, "kill", "worker0", 1.5), Fault(7, "term", "worker1", 0.5),
                Fault(12, "kill", "scheduler", 2.5), Fault(17.5, "term", "gateway1", 0.5),
                Fault(23, "stop", "worker2", 3.5)],
        gateway_args=["--wait-schedule-timeout-ms", "1000", "--wait-schedule-try-period-ms", "200",
                      "--workers-refresh-ms", "500"],
        scheduler_args=["--dead-after-ms", "2000"],
        span_s=4.0)


@dataclass
class RunResult:
    outcomes: list[Outcome]
    records: list[FaultRecord]
    wall_zero: float  # time.time() at the run clock's 0 (the logs' stamps are wall-clock)
    worker_ids: list[str]
    gateway_urls: list[str]
    log_dir: Path
    wall_s: float


async def soak(mode: Mode, args: argparse.Namespace) -> RunResult:
    spec = ClusterSpec(profiles=[args.profile] * args.workers, policy=POLICY, model=args.model,
                       time_scale=1.0, gateways=2, log_dir=Path(args.log_dir),
                       gateway_args=["--debug-headers", *mode.gateway_args],
                       scheduler_args=mode.scheduler_args)
    log_dir = spec.log_dir / POLICY
    for old in log_dir.glob("*.log"):  # the processes append: a previous run's lines would mix in
        old.unlink()
    t_start = time.monotonic()
    async with Cluster(spec) as cluster:
        clock, wall_zero = time.monotonic(), time.time()
        client = ChaosClient(cluster.gateway_urls, mode.workload, mode.concurrency, clock)
        injector = Injector(cluster, mode.faults, clock)
        stop = asyncio.Event()
        load = asyncio.ensure_future(client.run(mode.requests, stop))
        faults = asyncio.ensure_future(injector.run())
        tasks = {load, faults}
        try:
            await asyncio.wait({load}, timeout=mode.load_s)
            stop.set()  # no new request; those in flight end, or are cut at the cap below
            cap = clock + mode.load_s + mode.tail_s - time.monotonic()
            _, pending = await asyncio.wait(tasks, timeout=max(cap, 0.0))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if pending:
            print(f"[chaos] wall-clock cap reached: {len(pending)} task(s) cut", file=sys.stderr)
        worker_ids = [url.split("://", 1)[1] for url in cluster.worker_urls]
        gateway_urls = list(cluster.gateway_urls)
    # The gateways flush their access logs as they stop: read them after the cluster is down.
    return RunResult(client.outcomes, injector.records, wall_zero, worker_ids, gateway_urls, log_dir,
                     time.monotonic() - t_start)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def evaluate(run: RunResult, mode: Mode) -> dict[str, Any]:
    settings = Settings()
    views = fault_views(run.records, run.worker_ids)
    logs = GatewayLogs(run.log_dir, run.wall_zero)
    summary = summarize(run.outcomes, views, settings, logs.retries, mode.span_s)
    checks = check_faults(run.records, run.outcomes, run.worker_ids, POLICY, logs, settings.settle_s)
    lost = [c for c in summary["classes"] if c["class"] == LOST]
    evidence = log_lines_for(run.log_dir, [c["id"] for c in lost[:50]])
    for c in lost[:50]:
        c["log_lines"] = evidence[c["id"]]
    return {"summary": summary, "views": views, "checks": checks, "lost": lost}


def report(run: RunResult, mode: Mode, result: dict[str, Any], args: argparse.Namespace,
           started: datetime, load: tuple[float, float]) -> dict[str, Any]:
    summary, checks, lost = result["summary"], result["checks"], result["lost"]
    print(table(summary, result["views"]))
    print()
    print(checks_text(checks))
    if lost:
        print(f"\n{len(lost)} LOST request(s):")
        for c in lost[:20]:
            print(f"  {c['id']} ({c['fault'] or 'no fault'}): {c['failure']}")
            for line in c.get("log_lines", [])[:4]:
                print(f"      {line}")
    print(f"\n{len(run.outcomes)} requests in {run.wall_s:.0f} s wall (cluster start and stop included); "
          f"logs in {run.log_dir}", file=sys.stderr)
    return {
        "scenario": {"command": " ".join(sys.argv), "mode": "quick" if args.quick else "full",
                     "args": vars(args), "started_utc": started.isoformat(timespec="seconds"),
                     "commit": _git_commit(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
                     "loadavg_1m_before_after": load, "wall_s": run.wall_s,
                     "load_s": mode.load_s, "tail_s": mode.tail_s, "concurrency": mode.concurrency,
                     "requests_cap": mode.requests, "workload": vars(mode.workload),
                     "gateway_args": ["--debug-headers", *mode.gateway_args],
                     "scheduler_args": mode.scheduler_args, "worker_ids": run.worker_ids,
                     "gateway_urls": run.gateway_urls, "log_dir": str(run.log_dir)},
        "faults": [r.as_dict() for r in run.records],
        "checks": [{"fault": c.fault, "passed": c.passed, "checks": c.checks, "evidence": c.evidence}
                   for c in checks],
        "totals": summary["totals"],
        "rows": summary["rows"],
        "fault_windows": summary["fault_windows"],
        "ttft_around_faults": summary["ttft_around_faults"],
        "ttft_phases": summary["ttft_phases"],
        "lost": lost,
        "requests": [{**o.as_dict(), **c} for o, c in zip(run.outcomes, summary["classes"], strict=True)],
    }


async def _cancel_on_signals(coro):
    """SIGTERM/SIGINT cancel the run, so the cluster's process groups are stopped, not orphaned."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    return await task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the short schedule (well under a minute)")
    p.add_argument("--profile", default="llama2-7b-a10", help="the sim workers' profile")
    p.add_argument("--workers", type=int, default=4, help="sim workers (the schedule hits worker0..3)")
    p.add_argument("--model", default="llama2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/chaos-logs")
    p.add_argument("--output", help="write the report, every request included, as JSON")
    args = p.parse_args(argv)
    mode = quick_mode(args.model) if args.quick else full_mode(args.model)
    hit = sorted({f.target for f in mode.faults if f.target.startswith("worker")})
    if args.workers <= max(int(t[len("worker"):]) for t in hit):
        p.error(f"--workers {args.workers}: this schedule hits {', '.join(hit)}")
    mode.workload.seed = args.seed
    started = datetime.now(UTC)
    load_before = os.getloadavg()[0]
    try:
        run = asyncio.run(_cancel_on_signals(soak(mode, args)))
    except asyncio.CancelledError:
        print("[chaos] interrupted: workers, scheduler and gateways stopped", file=sys.stderr)
        return 130
    result = evaluate(run, mode)
    doc = report(run, mode, result, args, started, (load_before, os.getloadavg()[0]))
    if args.output:
        Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if not result["lost"] and all(c.passed for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
