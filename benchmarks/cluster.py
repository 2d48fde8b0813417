"""Process orchestration for routing experiments: sim/real workers, the scheduler and the gateway.

Every process runs in its own session (process group) on 127.0.0.1 with a free port, its output
goes to a log file, start-up waits are bounded, and stopping escalates SIGTERM -> SIGKILL on
the whole group, so nothing outlives an experiment even when it fails half way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.proc_cpu import cpu_seconds, tree_cpu_seconds

HOST = "127.0.0.1"


def free_port() -> int:
    """A port the OS considers free right now (bind to 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class StartupError(RuntimeError):
    pass


# free_port() gives a port that is free when asked; something else may take it before the
# process that was given it binds it (another listener, or an outgoing connection's ephemeral
# port: the range is the same). That process then exits at once, and the cluster is started
# again, every process on a new port (they know each other by URL), a few times at most.
PORT_RACE_TRIES = 3


def _lost_port_race(exc: StartupError) -> bool:
    # Ours (aiohttp) say "address already in use"; Rust's peers "Address already in use".
    return "address already in use" in str(exc).lower()


class ManagedProcess:
    """One child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(self.env or {})}
        log = self.log_path.open("ab")  # the child keeps its own copy of the descriptor
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=env
            )
        finally:
            log.close()

    def log_tail(self, n_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    @property
    def exited(self) -> bool:
        return self.proc is None or self.proc.returncode is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def send_signal(self, sig: int) -> int:
        """Send `sig` to the running process's whole group (a vLLM worker's engine runs in
        children, which a SIGKILL or SIGSTOP must reach too); returns the group leader's pid."""
        if self.proc is None or self.proc.returncode is not None:
            raise ProcessLookupError(f"{self.name} is not running")
        os.killpg(self.proc.pid, sig)
        return self.proc.pid

    async def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status once the process has ended (negative: the signal that ended it),
        or None if it still runs after timeout_s."""
        if self.proc is None:
            return None
        with contextlib.suppress(asyncio.TimeoutError):
            return await asyncio.wait_for(self.proc.wait(), timeout_s)
        return None

    async def wait_ready(self, url: str, timeout_s: float, session: aiohttp.ClientSession) -> None:
        """Poll `url` until it answers 200; fail early if the process dies, late past the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exited:
                raise StartupError(f"{self.name} exited during start-up:\n{self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise StartupError(f"{self.name} not ready at {url} after {timeout_s:.0f}s:\n{self.log_tail()}")

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the group, wait up to grace_s, then SIGKILL the group."""
        if self.proc is None or self.proc.returncode is not None:
            return
        pgid = self.proc.pid  # start_new_session makes the child its group's leader
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
                # A stopped process (SIGSTOP, as a fault injection leaves it) handles the
                # SIGTERM only once continued; without this it would wait out the grace.
                os.killpg(pgid, signal.SIGCONT)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), wait_s)
                return


@dataclass
class ClusterSpec:
    """What to start for one policy run."""

    profiles: list[str]  # one sim profile per worker (ignored by the torch and vllm backends)
    policy: str | None  # None: no scheduler, no gateway (the "baseline" run)
    model: str = "llama2"
    backend: str = "sim"
    time_scale: float = 1.0
    worker_args: list[list[str]] = field(default_factory=list)  # per worker; one entry applies to all
    scheduler_config: str | None = None
    scrape_interval_ms: int = 100
    gateway_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    # Tell the scheduler each worker's running cap (its --max-num-seqs in worker_args) up front,
    # as an operator's config would, instead of leaving it to be learnt.
    declare_running_caps: bool = False
    # Our gateway's replicas, all in front of the one scheduler (as behind a load balancer).
    gateways: int = 1
    log_dir: Path = Path("/tmp/routing-logs")
    startup_timeout_s: float = 120.0


class Cluster:
    """`async with Cluster(spec) as c:` gives c.worker_urls and c.gateway_url (None for baseline)."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self._forget_processes()

    def _forget_processes(self) -> None:
        """No process started or planned yet (again, after a start lost a port race)."""
        self.workers: list[ManagedProcess] = []
        self.worker_urls: list[str] = []
        self.scheduler: ManagedProcess | None = None
        self.scheduler_url: str | None = None
        self.gateway: ManagedProcess | None = None
        self.gateway_url: str | None = None
        # Every replica of our gateway, the first being `gateway` (spec.gateways).
        self.gateways: list[ManagedProcess] = []
        self.gateway_urls: list[str] = []
        # Process name -> the URL that answers 200 once it serves (for restart()).
        self.ready_urls: dict[str, str] = {}

    def _extra_worker_args(self, index: int) -> list[str]:
        args = self.spec.worker_args
        if not args:
            return []
        return args[index] if len(args) > 1 else args[0]

    def _worker_argv(self, index: int, port: int) -> list[str]:
        spec = self.spec
        if spec.backend == "vllm":
            from benchmarks.vllm_workers import vllm_worker_argv

            return vllm_worker_argv(spec.model, HOST, port) + self._extra_worker_args(index)
        argv = [sys.executable, "-m", "inference_worker", "--backend", spec.backend,
                "--served-model-name", spec.model, "--host", HOST, "--port", str(port)]
        if spec.backend == "sim":
            argv += ["--sim-profile", spec.profiles[index], "--time-scale", str(spec.time_scale)]
        return argv + self._extra_worker_args(index)

    def _declared_caps(self) -> dict[str, int]:
        """URL -> the --max-num-seqs its worker was started with (workers without one: left out)."""
        caps = {}
        for i, url in enumerate(self.worker_urls):
            args = self._extra_worker_args(i)
            for flag, value in itertools.pairwise(args):
                if flag == "--max-num-seqs":
                    caps[url] = int(value)
        return caps

    def _worker_env(self, index: int) -> dict[str, str] | None:
        if self.spec.backend != "vllm":
            return None
        from benchmarks.vllm_workers import vllm_worker_env

        return vllm_worker_env(index)

    async def __aenter__(self) -> Cluster:
        for attempt in range(1, PORT_RACE_TRIES + 1):
            try:
                await self._start()
                return self
            except StartupError as exc:
                await self.stop()
                if attempt == PORT_RACE_TRIES or not _lost_port_race(exc):
                    raise
                self._forget_processes()  # and start them all again, on new ports
            except BaseException:
                await self.stop()
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _start(self) -> None:
        spec = self.spec
        tag = spec.policy or "baseline"
        log_dir = spec.log_dir / tag.replace(":", "_")
        async with aiohttp.ClientSession() as session:
            for i in range(len(spec.profiles)):
                port = free_port()
                self.worker_urls.append(f"http://{HOST}:{port}")
                self.workers.append(ManagedProcess(f"worker{i}", self._worker_argv(i, port),
                                                   log_dir / f"worker{i}.log", env=self._worker_env(i)))
            ready = [(w, f"{u}/health") for w, u in zip(self.workers, self.worker_urls, strict=True)]
            if spec.policy is not None and spec.policy.startswith("peer:"):
                # A peer router may check its workers once at start-up: it starts after them.
                await self._start_all(ready, session)
                from benchmarks.routing_peers import peer_argv, peer_env  # optional peer routers

                port = free_port()
                self.gateway_url = f"http://{HOST}:{port}"
                argv, ready_path = peer_argv(spec.policy, port, self.worker_urls, spec.model, log_dir)
                self.gateway = ManagedProcess(tag, argv, log_dir / "peer.log", env=peer_env())
                await self._start_all([(self.gateway, self.gateway_url + ready_path)], session)
                return
            if spec.policy is not None:
                # Ours start beside the workers (the scheduler takes a worker in at its first
                # answered scrape, the gateway needs only the scheduler's URL): ~0.6 s less per run.
                ready += self._our_router(log_dir)
            await self._start_all(ready, session)
            if spec.policy is not None:
                await self._wait_scheduler_sees_workers(session)

    def _our_router(self, log_dir: Path) -> list[tuple[ManagedProcess, str]]:
        """The scheduler and the gateway in front of the workers, not started yet."""
        spec = self.spec
        sport = free_port()
        self.scheduler_url = f"http://{HOST}:{sport}"
        sargv = [sys.executable, "-m", "scheduler", "--host", HOST, "--port", str(sport),
                 "--workers", ",".join(self.worker_urls), "--policy", str(spec.policy),
                 "--scrape-interval-ms", str(spec.scrape_interval_ms)]
        if spec.scheduler_config:
            sargv += ["--config", spec.scheduler_config]
        if spec.declare_running_caps:
            sargv += ["--worker-max-running", json.dumps(self._declared_caps())]
        self.scheduler = ManagedProcess("scheduler", sargv + spec.scheduler_args, log_dir / "scheduler.log")
        for i in range(max(1, spec.gateways)):
            gport = free_port()
            gargv = [sys.executable, "-m", "router", "--host", HOST, "--port", str(gport),
                     "--scheduler", self.scheduler_url, "--workers", ",".join(self.worker_urls)]
            name = "gateway" if i == 0 else f"gateway{i}"
            self.gateways.append(ManagedProcess(name, gargv + spec.gateway_args, log_dir / f"{name}.log"))
            self.gateway_urls.append(f"http://{HOST}:{gport}")
        self.gateway, self.gateway_url = self.gateways[0], self.gateway_urls[0]
        return [(self.scheduler, f"{self.scheduler_url}/health"),
                *((g, f"{url}/health") for g, url in zip(self.gateways, self.gateway_urls, strict=True))]

    async def _start_all(self, ready: list[tuple[ManagedProcess, str]],
                         session: aiohttp.ClientSession) -> None:
        """Start every process, then wait until each answers its URL."""
        for proc, url in ready:
            self.ready_urls[proc.name] = url
            await proc.start()
        timeout_s = self.spec.startup_timeout_s
        await asyncio.gather(*(proc.wait_ready(url, timeout_s, session) for proc, url in ready))

    async def _wait_scheduler_sees_workers(self, session: aiohttp.ClientSession) -> None:
        """The first request must not race the first scrape: wait until every worker is healthy."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with session.get(f"{self.scheduler_url}/v1/workers",
                                       timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    body = await resp.json()
                    views = body.get("workers", [])
                    if len(views) == len(self.worker_urls) and all(v.get("healthy") for v in views):
                        return
            await asyncio.sleep(0.2)
        raise StartupError("scheduler did not report every worker healthy within 30s:\n"
                           + (self.scheduler.log_tail() if self.scheduler else ""))

    async def restart(self, proc: ManagedProcess, timeout_s: float | None = None) -> None:
        """Start one of this cluster's processes again, with its command line (so on its port:
        its peers know it by URL), after it has ended (killed, or stopped by a signal), and wait
        until it serves."""
        if not proc.exited:
            raise RuntimeError(f"{proc.name} is still running")
        url = self.ready_urls[proc.name]
        await proc.start()
        async with aiohttp.ClientSession() as session:
            await proc.wait_ready(url, timeout_s or self.spec.startup_timeout_s, session)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each part: "workers" (summed), "scheduler", "gateway"
        (ours or a peer router); a part that is absent or already gone is left out."""
        parts: dict[str, list[ManagedProcess]] = {"workers": self.workers}
        if self.scheduler is not None:
            parts["scheduler"] = [self.scheduler]
        if self.gateway is not None:
            parts["gateway"] = self.gateways or [self.gateway]
        out: dict[str, float] = {}
        for name, procs in parts.items():
            # A vLLM worker's engine runs in child processes: count the whole tree.
            read = tree_cpu_seconds if name == "workers" else cpu_seconds
            with contextlib.suppress(OSError):
                out[name] = sum(read(p.proc.pid) for p in procs if p.proc is not None)
        return out

    async def stop(self) -> None:
        # Front to back, so no process sees its upstream vanish while it still takes traffic.
        for proc in (*(self.gateways or [self.gateway]), self.scheduler):
            if proc is not None:
                await proc.stop()
        await asyncio.gather(*(w.stop() for w in self.workers))
