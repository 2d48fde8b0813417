"""A bounded soak with failures injected: an operator's bad day in one run.

Four sim workers, the scheduler and two gateway replicas serve a steady closed-loop load of
chat completions (half streamed, half whole), spread over both gateways by a client that moves
a request to the other replica only when no answer came (benchmarks/chaos_client.py). At fixed
times of the run (benchmarks/chaos_faults.py):

    kill worker0     SIGKILL, restarted a few seconds later
    term worker1     SIGTERM: it drains and exits; restarted
    kill scheduler   SIGKILL, restarted (the gateways serve by round robin meanwhile), during
                     a surge of load above what the workers run at once, so that requests
                     are held in the gateways' queues and the scheduler's held calls
    kill worker3     (full mode) SIGKILL while the scheduler is away, restarted
    term gateway1    SIGTERM: it drains and exits; restarted
    stop worker2     SIGSTOP (a hung process), SIGCONT later
    kill gateway0    SIGKILL (a crash), restarted: its requests not yet answered move to the
                     other replica, those it was answering are cut

The workers run at most `--max-num-seqs` requests each (12 in full mode, 6 in quick), declared
to the scheduler, so that the surge saturates them; the steady load alone does not, even with
one worker out. `--no-saturate` runs without the surge and the caps (the run as it was before
they were added).

Every request's outcome is classed from what README.md and DESIGN.md promise
(benchmarks/chaos_outcomes.py): ok; a failure the design names as beyond it (a stream already
answering when its worker is SIGKILLed ends with an error event, ...); or `lost`, a failure
where the design says the product survives. Each fault is checked to have happened and its
target to have served again (benchmarks/chaos_checks.py). The gateways' held and in-flight
counts and the scheduler's open leases per worker are sampled all along
(benchmarks/chaos_probe.py): the requests held when the scheduler is killed must each end
whole, once, and every count must be back to 0 at the end; what the scheduler does with the
killed gateway's leases is reported (checked only with `--max-leases-left`). Printed: counts
per class per fault, TTFT before/during/after each fault; `--output` writes it all as JSON,
every request and sample included. Exit status 1 when a request was lost or a check failed.

    python -m benchmarks.chaos --output /tmp/chaos.json          # ~4 minutes
    python -m benchmarks.chaos --quick                           # well under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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

from benchmarks.chaos_checks import check_faults, end_of_run, gateway_kill_evidence, held_at_kill
from benchmarks.chaos_client import ChaosClient, Outcome, Surge, Workload
from benchmarks.chaos_faults import Fault, FaultRecord, Injector
from benchmarks.chaos_logs import GatewayLogs, log_lines_for
from benchmarks.chaos_outcomes import LOST, Settings, fault_views
from benchmarks.chaos_probe import ClusterProbe, Sample
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
    # Every worker's flags (its running cap, declared to the scheduler) and the load's surges.
    worker_args: list[str] = field(default_factory=list)
    surges: tuple[Surge, ...] = ()
    probe_period_s: float = 0.5
    # After the load: how long the gateways' counts (held, in flight) may take to reach 0.
    settle_timeout_s: float = 5.0

    def unsaturated(self) -> Mode:
        """The same run without the surges and the workers' caps."""
        return dataclasses.replace(self, worker_args=[], surges=())


def full_mode(model: str) -> Mode:
    """The services' defaults (the design's timeouts: round robin after 5 s without the
    scheduler, a hung worker down after 10 s), about 3.5 minutes of load. Workers of 12
    running requests (48 in all): the steady 32 fit even with one worker out; the surge's
    32 more, from 8 s before the scheduler's kill to 4 s after, hold about 16."""
    return Mode(
        load_s=200, tail_s=75, concurrency=32, requests=6000,
        workload=Workload(model, min_prompt_words=20, max_prompt_words=400, min_tokens=16, max_tokens=160),
        faults=[Fault(20, "kill", "worker0", 5), Fault(50, "term", "worker1", 3),
                Fault(80, "kill", "scheduler", 8),
                # Two at once: a worker dies while the gateways route by round robin alone.
                Fault(86, "kill", "worker3", 5),
                Fault(115, "term", "gateway1", 3), Fault(145, "stop", "worker2", 15),
                Fault(175, "kill", "gateway0", 3)],
        worker_args=["--max-num-seqs", "12"], surges=(Surge(72, 84, 32),),
        settle_timeout_s=10.0)


def quick_mode(model: str) -> Mode:
    """Short answers and the services' timeouts shortened (round robin after 1 s, a hung
    worker down after 2 s), so that every fault and its recovery fit in half a minute."""
    return Mode(
        load_s=31, tail_s=20, concurrency=16, requests=2000,
        workload=Workload(model, min_prompt_words=10, max_prompt_words=150, min_tokens=8, max_tokens=48),
        faults=[Fault(2, "kill", "worker0", 1.5), Fault(7, "term", "worker1", 0.5),
                Fault(12, "kill", "scheduler", 2.5), Fault(17.5, "term", "gateway1", 0.5),
                Fault(23, "stop", "worker2", 3.5), Fault(26, "kill", "gateway0", 0.5)],
        gateway_args=["--wait-schedule-timeout-ms", "1000", "--wait-schedule-try-period-ms", "200",
                      "--workers-refresh-ms", "500"],
        scheduler_args=["--dead-after-ms", "2000"],
        span_s=4.0,
        # Workers of 6 (24 in all) under the steady 16; 16 more from 3 s before the scheduler's
        # kill to 1 s after hold about 8.
        worker_args=["--max-num-seqs", "6"], surges=(Surge(9, 13, 16),),
        settle_timeout_s=3.0)


@dataclass
class RunResult:
    outcomes: list[Outcome]
    records: list[FaultRecord]
    wall_zero: float  # time.time() at the run clock's 0 (the logs' stamps are wall-clock)
    worker_ids: list[str]
    gateway_urls: list[str]
    log_dir: Path
    wall_s: float
    samples: list[Sample]  # the probe's, every period and the end's
    end: Sample | None  # the last look, after the load (None: the run was cut before it)
    idle_s: float | None  # when the gateways held and ran nothing after the load (None: not seen)
    leases_zero_s: float | None  # ... and the scheduler counted no open lease (None: not seen)


async def soak(mode: Mode, args: argparse.Namespace) -> RunResult:
    spec = ClusterSpec(profiles=[args.profile] * args.workers, policy=POLICY, model=args.model,
                       time_scale=1.0, gateways=2, log_dir=Path(args.log_dir),
                       gateway_args=["--debug-headers", *mode.gateway_args],
                       scheduler_args=mode.scheduler_args,
                       worker_args=[mode.worker_args] if mode.worker_args else [],
                       declare_running_caps=bool(mode.worker_args))
    log_dir = spec.log_dir / POLICY
    for old in log_dir.glob("*.log"):  # the processes append: a previous run's lines would mix in
        old.unlink()
    t_start = time.monotonic()
    end: Sample | None = None
    idle_s = leases_zero_s = None
    async with Cluster(spec) as cluster:
        clock, wall_zero = time.monotonic(), time.time()
        assert cluster.scheduler_url is not None
        async with ClusterProbe(cluster.gateway_urls, cluster.scheduler_url, clock,
                                mode.probe_period_s) as probe:

            async def look(_fault: Fault) -> dict[str, Any]:
                return (await probe.sample()).as_dict()

            client = ChaosClient(cluster.gateway_urls, mode.workload, mode.concurrency, clock)
            injector = Injector(cluster, mode.faults, clock, before_signal=look)
            stop, probe_stop = asyncio.Event(), asyncio.Event()
            load = asyncio.ensure_future(client.run(mode.requests, stop, mode.surges))
            faults = asyncio.ensure_future(injector.run())
            sampling = asyncio.ensure_future(probe.run(probe_stop))
            tasks = {load, faults}
            pending: set[asyncio.Future] = set()
            try:
                await asyncio.wait({load}, timeout=mode.load_s)
                stop.set()  # no new request; those in flight end, or are cut at the cap below
                cap = clock + mode.load_s + mode.tail_s - time.monotonic()
                _, pending = await asyncio.wait(tasks, timeout=max(cap, 0.0))
                probe_stop.set()
                await sampling
                if not pending:  # every request ended: every count should go back to 0
                    end, idle_s, leases_zero_s = await probe.settled(mode.settle_timeout_s)
            finally:
                for task in (*tasks, sampling):
                    task.cancel()
                await asyncio.gather(*tasks, sampling, return_exceptions=True)
            if pending:
                print(f"[chaos] wall-clock cap reached: {len(pending)} task(s) cut", file=sys.stderr)
        worker_ids = [url.split("://", 1)[1] for url in cluster.worker_urls]
        gateway_urls = list(cluster.gateway_urls)
    # The gateways flush their access logs as they stop: read them after the cluster is down.
    return RunResult(client.outcomes, injector.records, wall_zero, worker_ids, gateway_urls, log_dir,
                     time.monotonic() - t_start, probe.samples, end, idle_s, leases_zero_s)


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


def _surging_at(mode: Mode, t: float | None) -> bool:
    return t is not None and any(s.start_s <= t <= s.end_s for s in mode.surges)


def evaluate(run: RunResult, mode: Mode, max_leases_left: int | None = None) -> dict[str, Any]:
    settings = Settings()
    views = fault_views(run.records, run.worker_ids)
    logs = GatewayLogs(run.log_dir, run.wall_zero)
    summary = summarize(run.outcomes, views, settings, logs.retries, mode.span_s)
    checks = check_faults(run.records, run.outcomes, run.worker_ids, POLICY, logs, settings.settle_s)
    classes = {c["id"]: c["class"] for c in summary["classes"]}
    for rec, check in zip(run.records, list(checks), strict=True):
        if rec.signal_s is None:
            continue
        if rec.fault.target == "scheduler":
            checks.append(held_at_kill(rec, run.outcomes, classes, logs, run.samples,
                                       expect_held=_surging_at(mode, rec.signal_s)))
        elif rec.fault.target.startswith("gateway") and rec.fault.action == "kill":
            check.evidence.update(gateway_kill_evidence(rec, run.outcomes, classes, run.samples,
                                                        settings.lease_ttl_s))
    checks.append(end_of_run(run.end, run.idle_s, run.leases_zero_s, logs, max_leases_left))
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
                     "worker_args": mode.worker_args,
                     "surges": [dataclasses.asdict(s) for s in mode.surges],
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
        "samples": [s.as_dict() for s in run.samples],
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
    p.add_argument("--no-saturate", action="store_true",
                   help="no surge and no running cap on the workers: the load never saturates them, "
                   "so nothing is held when the scheduler is killed")
    p.add_argument("--max-leases-left", type=int, default=None,
                   help="fail when the scheduler still counts more open leases than this once every "
                   "request ended (default: only report them; a SIGKILLed gateway's leases last "
                   "the scheduler's --lease-ttl-s by design)")
    args = p.parse_args(argv)
    mode = quick_mode(args.model) if args.quick else full_mode(args.model)
    if args.no_saturate:
        mode = mode.unsaturated()
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
    result = evaluate(run, mode, args.max_leases_left)
    doc = report(run, mode, result, args, started, (load_before, os.getloadavg()[0]))
    if args.output:
        Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if not result["lost"] and all(c.passed for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
