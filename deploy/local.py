"""The whole stack on one machine: `python -m deploy.local` (what `make run` starts).

N workers, the scheduler and the gateway run as child processes on 127.0.0.1;
the launcher waits for each /health, prints how to call the gateway, forwards
the children's logs, and stops everything it started on Ctrl-C / SIGTERM or
as soon as any child dies (then it exits non-zero).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from deploy.processes import ManagedProcess, ServiceSpec, StartupError, Supervisor, port_is_free, print_line

HOST = "127.0.0.1"
LOCAL_PREFILL_CAP = 1024  # llm_aware max_prefill_backlog for our worker (see build_specs)
# What a child needs, after its --shutdown-timeout, to cut what is left and exit (see
# drain_timeout).
EXIT_MARGIN_S = 2.0
# A worker that dies again this soon after the launcher restarted it is in a crash loop: the
# stack stops (see keep_workers_up).
RESTART_MIN_UPTIME_S = 30.0
# SIGHUP too: closing the terminal (or an ssh session ending) hangs up `make run`. Its default
# action ended the launcher alone, and the children, each in its own session, kept running
# with their ports held: the next `make run` found every port in use.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The gateway's admin token (its /metrics and /admin/* then want it as a Bearer token), in the
# file that deploy/prometheus/prometheus.yml sends it from (credentials_file): one file for both,
# so an operator who protects the gateway does not get 401 scrapes and LLMGatewayDown. Empty:
# no token. Git ignores it.
DEFAULT_ADMIN_TOKEN_FILE = Path(__file__).resolve().parent / "prometheus" / "gateway-admin-token"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deploy.local",
        description="Start N inference workers, the scheduler and the gateway on 127.0.0.1.",
        epilog="SCHEDULER_GATEWAY_TOKEN (or ROUTER_SCHEDULER_TOKEN) in the environment: the token "
        "the scheduler's decision API then wants, given to the gateway too; unset: none.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, help="number of inference workers")
    p.add_argument("--backend", choices=["torch", "sim"], default="torch",
                   help="torch: the real model on CPU/GPU; sim: calibrated GPU latency model")
    p.add_argument("--sim-profile", default=None, help="sim backend profile (e.g. tiny, llama2-7b-a10)")
    p.add_argument("--model", default="smollm2", help="worker model: alias or local HF directory")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    p.add_argument("--gateway-port", type=int, default=8000)
    p.add_argument("--scheduler-port", type=int, default=8090)
    p.add_argument("--base-worker-port", type=int, default=8001, help="worker i listens on this + i")
    p.add_argument("--policy", default="llm_aware", help="scheduler policy name")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="every worker's running-request cap, also declared to the scheduler "
                        "(default: the worker's own, 64 for torch, the profile's for sim, "
                        "which the scheduler then learns)")
    p.add_argument("--time-scale", type=float, default=None, help="sim backend: stretch simulated time")
    p.add_argument("--admin-token-file", type=Path, default=DEFAULT_ADMIN_TOKEN_FILE,
                   help="the gateway's admin token for /metrics and /admin/* (empty file: none); "
                        "deploy/prometheus/prometheus.yml sends the default file's, which is created "
                        "empty when missing")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds each stage may take to answer /health")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping a child; the gateway and "
                        "the workers get this less 2 s to finish the requests in flight")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        p.error("--max-num-seqs must be at least 1")
    if (args.sim_profile or args.time_scale) and args.backend != "sim":
        p.error("--sim-profile and --time-scale need --backend sim")
    # Finite (a nan passed every comparison: --grace-period nan killed at once, --startup-timeout
    # nan failed every stage with no reason given).
    if args.time_scale is not None and not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        p.error("--time-scale must be a finite number > 0")
    if not (args.startup_timeout > 0 and math.isfinite(args.startup_timeout)):
        p.error("--startup-timeout must be a finite number of seconds > 0")
    if not (args.grace_period >= 0 and math.isfinite(args.grace_period)):
        p.error("--grace-period must be a finite number of seconds >= 0")
    # A port out of range was an OverflowError traceback (checking it is free); 0 (any free
    # port) left the launcher waiting for /health on port 0 until --startup-timeout.
    for flag, port in (("--gateway-port", args.gateway_port), ("--scheduler-port", args.scheduler_port),
                       ("--base-worker-port", args.base_worker_port)):
        if not 1 <= port <= 65535:
            p.error(f"{flag} must be from 1 to 65535")
    if args.base_worker_port + args.workers - 1 > 65535:
        p.error(f"--base-worker-port {args.base_worker_port} leaves no room for {args.workers} workers "
                "below port 65536")
    args.served_model_name = args.served_model_name or args.model
    try:
        args.admin_token = read_admin_token(args.admin_token_file)
        args.scheduler_token = read_scheduler_token(os.environ)
    except ValueError as exc:
        p.error(str(exc))
    return args


def read_scheduler_token(env: Mapping[str, str]) -> str:
    """The token the scheduler's decision API wants (its --gateway-token) and the gateway sends
    (its --scheduler-token): SCHEDULER_GATEWAY_TOKEN, or ROUTER_SCHEDULER_TOKEN, from the
    launcher's environment; "" for none. One value for both children: each inherited only its
    own variable, and a token set for one side alone made every scheduler call a 401."""
    values = {name: (env.get(name) or "").strip()
              for name in ("SCHEDULER_GATEWAY_TOKEN", "ROUTER_SCHEDULER_TOKEN")}
    given = {v for v in values.values() if v}
    if len(given) > 1:
        raise ValueError("SCHEDULER_GATEWAY_TOKEN and ROUTER_SCHEDULER_TOKEN are both set and differ: "
                         "the scheduler and the gateway here share one token; set one of them")
    token = given.pop() if given else ""
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise ValueError("SCHEDULER_GATEWAY_TOKEN must hold one token (no spaces or control characters)")
    return token


def read_admin_token(path: Path) -> str:
    """The token in `path` ("" for none). The default file is created empty when missing, so
    that Prometheus, which reads it at every scrape of the gateway, finds it."""
    token = ""
    if path == DEFAULT_ADMIN_TOKEN_FILE and not path.exists():
        with contextlib.suppress(OSError):  # a read-only checkout: then no token, as before
            path.touch(mode=0o600)
    if path.exists() or path != DEFAULT_ADMIN_TOKEN_FILE:
        try:
            # Prometheus sends the file's text with surrounding whitespace trimmed: so is it here.
            token = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--admin-token-file: cannot read {path}: {exc}") from None
    if any(ch.isspace() for ch in token):
        raise ValueError(f"--admin-token-file: {path} must hold one token (no spaces or line breaks)")
    # The gateway would take the variable's token and Prometheus would send the file's: every
    # scrape a 401. One source, the file.
    inherited = os.environ.get("ROUTER_ADMIN_TOKEN", "")
    if inherited and inherited != token:
        raise ValueError(f"ROUTER_ADMIN_TOKEN is set but {path} does not hold it: the gateway's token "
                         "comes from --admin-token-file here (Prometheus sends that file's); write the "
                         "token there and unset ROUTER_ADMIN_TOKEN")
    return token


def drain_timeout(grace_s: float) -> float:
    """The --shutdown-timeout of the gateway and the workers: their requests in flight finish,
    or are cut with a `shutting_down` error, before the launcher's SIGKILL. With their own
    defaults (gateway 50 s, worker 30 s) against the 10 s grace period, a Ctrl-C during a long
    stream killed the gateway mid-stream: the client's connection dropped with no error."""
    return max(0.0, grace_s - EXIT_MARGIN_S)


def worker_urls(args: argparse.Namespace) -> list[str]:
    return [f"http://{HOST}:{args.base_worker_port + i}" for i in range(args.workers)]


def build_specs(args: argparse.Namespace) -> tuple[list[ServiceSpec], ServiceSpec, ServiceSpec]:
    """The command lines of every child: (workers, scheduler, gateway)."""
    py = sys.executable
    drain = ["--shutdown-timeout", f"{drain_timeout(args.grace_period):g}"]
    workers = []
    for i, url in enumerate(worker_urls(args)):
        argv = [py, "-m", "inference_worker", "--backend", args.backend, "--model", args.model,
                "--served-model-name", args.served_model_name,
                "--host", HOST, "--port", str(args.base_worker_port + i), *drain]
        if args.sim_profile:
            argv += ["--sim-profile", args.sim_profile]
        if args.time_scale is not None:
            argv += ["--time-scale", str(args.time_scale)]
        if args.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(args.max_num_seqs)]
        workers.append(ServiceSpec(f"worker-{i}", argv, f"{url}/health", {"HF_HUB_OFFLINE": "1"}))
    scheduler_url = f"http://{HOST}:{args.scheduler_port}"
    scheduler_argv = [py, "-m", "scheduler", "--host", HOST, "--port", str(args.scheduler_port),
                      "--workers", ",".join(worker_urls(args)), "--policy", args.policy,
                      # Half of our worker's 2048-token engine step (README, "Routing policies");
                      # other policies ignore it.
                      "--params-by-policy",
                      json.dumps({"llm_aware": {"max_prefill_backlog": LOCAL_PREFILL_CAP}})]
    if args.max_num_seqs is not None:
        scheduler_argv += ["--worker-max-running", json.dumps({"*": args.max_num_seqs})]
    # Both always set, in the environment (not on command lines, which the launcher logs and `ps`
    # shows): "" (no token) overrides one inherited from the launcher's environment.
    scheduler = ServiceSpec("scheduler", scheduler_argv, f"{scheduler_url}/health",
                            {"SCHEDULER_GATEWAY_TOKEN": args.scheduler_token})
    gateway = ServiceSpec(
        "gateway",
        [py, "-m", "router", "--host", HOST, "--port", str(args.gateway_port),
         "--scheduler", scheduler_url, "--workers", ",".join(worker_urls(args)), *drain],
        f"http://{HOST}:{args.gateway_port}/health",
        # In its environment, not on its command line, which the launcher logs and `ps` shows.
        # Always set: "" (no token) overrides one inherited from the launcher's environment.
        {"HF_HUB_OFFLINE": "1", "ROUTER_ADMIN_TOKEN": args.admin_token,
         "ROUTER_SCHEDULER_TOKEN": args.scheduler_token},
    )
    return workers, scheduler, gateway


def busy_ports(args: argparse.Namespace) -> list[str]:
    named = [(args.gateway_port, "gateway"), (args.scheduler_port, "scheduler")]
    named += [(args.base_worker_port + i, f"worker-{i}") for i in range(args.workers)]
    ports = [port for port, _ in named]
    dupes = sorted({port for port in ports if ports.count(port) > 1})
    problems = [f"port {port} is given to more than one service" for port in dupes]
    problems += [f"port {port} ({name}) is already in use" for port, name in named if not port_is_free(port)]
    return problems


def banner(args: argparse.Namespace) -> str:
    base = f"http://{HOST}:{args.gateway_port}/v1"
    body = json.dumps({"model": args.served_model_name, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Say hello in one sentence."}]})
    workers = ", ".join(f"{url}/metrics" for url in worker_urls(args))
    gateway_auth = f" (Bearer token from {args.admin_token_file})" if args.admin_token else ""
    # The gateway reads its API keys from the environment it inherits: with keys set, the
    # examples must send one (as pasted, they got a 401).
    keyed = bool(os.environ.get("ROUTER_API_KEYS") or os.environ.get("ROUTER_API_KEY_FILE"))
    curl_auth = " -H \"Authorization: Bearer $API_KEY\"" if keyed else ""
    api_key = 'os.environ["API_KEY"]' if keyed else '"unused"'
    key_note = "\n(API keys are on: set API_KEY to one of ROUTER_API_KEYS first)\n" if keyed else ""
    return f"""
================================================================================
LLM router ready: {base}
  model "{args.served_model_name}", {args.workers} {args.backend} worker(s), policy {args.policy}
{key_note}
curl:
  curl -s {base}/chat/completions -H 'Content-Type: application/json'{curl_auth} \\
    -d '{body}'

openai (Python):
  {"import os; " if keyed else ""}from openai import OpenAI
  client = OpenAI(base_url="{base}", api_key={api_key})
  reply = client.chat.completions.create(model="{args.served_model_name}", max_tokens=32,
      messages=[{{"role": "user", "content": "Say hello in one sentence."}}])
  print(reply.choices[0].message.content)

metrics: gateway http://{HOST}:{args.gateway_port}/metrics{gateway_auth},
         scheduler http://{HOST}:{args.scheduler_port}/metrics (workers: /v1/workers),
         workers {workers}
Press Ctrl-C to stop everything.
================================================================================""".lstrip("\n")


async def keep_workers_up(supervisor: Supervisor, worker_names: set[str], stop: asyncio.Event,
                          health_timeout_s: float) -> bool:
    """Watch the children until `stop` is set (False) or the stack cannot go on (True).

    A worker that dies is started again, as compose (`restart: unless-stopped`) and Kubernetes
    do: the scheduler takes it out of rotation and back once it answers, and the others serve
    meanwhile. One worker's crash stopped the whole stack, the gateway cutting the streams that
    healthy workers were serving. A worker that dies again within RESTART_MIN_UPTIME_S of its
    restart (a crash loop), or the scheduler or the gateway dying, stops the stack."""
    restarted_at: dict[str, float] = {}
    announcers: set[asyncio.Task] = set()

    async def announce_healthy(child: ManagedProcess) -> None:
        with contextlib.suppress(StartupError):
            async with httpx.AsyncClient(trust_env=False) as client:
                await child.wait_healthy(client, health_timeout_s)
            print_line(f"[launcher] {child.name} is healthy again at {child.spec.health_url}")

    try:
        while (dead := await supervisor.watch(stop)) is not None:
            code = dead.proc.returncode if dead.proc else None
            up_s = time.monotonic() - restarted_at.get(dead.name, -math.inf)
            if dead.name not in worker_names:
                print_line(f"[launcher] error: {dead.name} exited with code {code}; stopping the rest")
                return True
            if up_s < RESTART_MIN_UPTIME_S:
                print_line(f"[launcher] error: {dead.name} exited with code {code} again {up_s:.0f} s "
                           "after its restart; stopping the rest")
                return True
            print_line(f"[launcher] {dead.name} exited with code {code}; starting it again (the others "
                       "serve meanwhile)")
            await supervisor.restart(dead)
            restarted_at[dead.name] = time.monotonic()
            task = asyncio.create_task(announce_healthy(dead))
            announcers.add(task)
            task.add_done_callback(announcers.discard)
        return False
    finally:
        for task in list(announcers):
            task.cancel()
        await asyncio.gather(*announcers, return_exceptions=True)


async def run(args: argparse.Namespace) -> int:
    problems = busy_ports(args)
    if problems:
        for problem in problems:
            print_line(f"[launcher] error: {problem}")
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(grace_s=args.grace_period)
    workers, scheduler, gateway = build_specs(args)

    async def start_all() -> None:
        for stage in ([*workers], [scheduler], [gateway]):
            await supervisor.start_stage(stage, args.startup_timeout)

    try:
        startup = asyncio.create_task(start_all())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([startup, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():
            print_line("[launcher] interrupted during start-up")
            startup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await startup
            return 0
        stopper.cancel()
        try:
            startup.result()
        except StartupError as exc:
            print_line(f"[launcher] error: {exc}")
            return 1
        print_line(banner(args))
        if await keep_workers_up(supervisor, {spec.name for spec in workers}, stop, args.startup_timeout):
            return 1
        print_line("[launcher] stopping")
        return 0
    finally:
        for sig in STOP_SIGNALS:  # a second Ctrl-C skips the grace period
            loop.add_signal_handler(sig, supervisor.kill_all)
        await supervisor.stop_all()
        print_line("[launcher] all processes stopped")


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
