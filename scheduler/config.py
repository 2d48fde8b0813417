"""Scheduler configuration: CLI flags, SCHEDULER_* environment variables, optional YAML (--config)."""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.connection_limit import DEFAULT_KEEPALIVE_TIMEOUT_S, KEEPALIVE_HELP, MAX_CONNECTIONS_HELP
from scheduler.receive_timeout import DEFAULT_RECEIVE_TIMEOUT_S, receive_timeout_help
from scheduler.running_cap import is_positive_int
from scheduler.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S
from scheduler.settings_loader import clean_secret, known_log_level, load_settings
from scheduler.tls import CLIENT_HELP, RELOAD_HELP, SERVER_HELP, cert_reqs_value, options_problem
from scheduler.urls import http_url_problem


class SchedulerConfig(BaseSettings):
    """Every flag may also be set by the environment variable SCHEDULER_<FLAG>, e.g.
    SCHEDULER_SCRAPE_INTERVAL_MS, or in the YAML file --config names (field names, - or _).
    Precedence: flag, then environment, then file, then the default."""

    model_config = SettingsConfigDict(
        env_prefix="SCHEDULER_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m scheduler",
        extra="forbid",
    )

    config: str | None = Field(None, description="optional YAML file with any of these fields")
    host: str = "127.0.0.1"
    port: int = Field(8090, ge=0, le=65535)
    log_level: str = "info"
    request_receive_timeout_ms: int = Field(
        int(DEFAULT_RECEIVE_TIMEOUT_S * 1000), ge=1,
        description=receive_timeout_help(" (a held /v1/schedule call, a channel)"),
    )
    # Connections (scheduler/connection_limit.py): its clients are the gateways and workers.
    keepalive_timeout_s: float = Field(DEFAULT_KEEPALIVE_TIMEOUT_S, gt=0, le=86_400, allow_inf_nan=False,
                                       description=KEEPALIVE_HELP)
    max_connections: int | None = Field(None, ge=0, description=MAX_CONNECTIONS_HELP)

    # TLS (scheduler/tls.py): serving HTTPS, and calling https:// workers
    ssl_certfile: str | None = Field(None, description=SERVER_HELP["ssl_certfile"])
    ssl_keyfile: str | None = Field(None, description=SERVER_HELP["ssl_keyfile"])
    ssl_ca_certs: str | None = Field(None, description=SERVER_HELP["ssl_ca_certs"])
    ssl_cert_reqs: int | None = Field(None, ge=0, le=2, description=SERVER_HELP["ssl_cert_reqs"])
    worker_ca_file: str | None = Field(
        None, description="PEM bundle of the CAs that https:// workers' certificates are checked "
        "against (scrapes, health checks), instead of the system's: a private CA. The check is "
        "never off")
    ssl_client_certfile: str | None = Field(None, description=CLIENT_HELP["ssl_client_certfile"])
    ssl_client_keyfile: str | None = Field(None, description=CLIENT_HELP["ssl_client_keyfile"])
    ssl_reload_s: float = Field(5.0, ge=0, allow_inf_nan=False, description=RELOAD_HELP)

    # Discovery
    workers: str = Field("", description="static worker URLs, comma-separated")
    registration_token: str | None = Field(None, description="shared token for POST /v1/workers")
    # Why: whoever reaches the decision API can take leases or take any worker out of rotation
    # with a failure report; the gateways send this token (their --scheduler-token).
    gateway_token: str | None = Field(
        None, description="shared token the gateways must send (Authorization: Bearer) on the "
        "decision API: schedule, release, prefilled, renew, /v1/batch, /v1/channel and failure "
        "reports (else 401); unset: no check. GET /v1/workers, /health and /metrics stay open")
    # Why a token of its own: cordoning takes workers out of rotation, an operator's act, not
    # a gateway's; fail closed (403) while unset, as an open one would let anyone drain the pool.
    admin_token: str | None = Field(
        None, description="token operators send (Authorization: Bearer) to cordon and uncordon "
        "workers (POST /v1/workers/{id}/cordon, .../uncordon); unset: those calls are refused "
        "(403). Read at start: to rotate it without a restart, give --admin-token-file instead")
    # Why a file: an inline token is read once, so rotating it needed a restart
    # (scheduler/admin_auth.py AdminTokenFile).
    admin_token_file: str | None = Field(
        None, description="file holding the admin token (instead of --admin-token; trimmed): read "
        "at start (missing or empty: no token yet, the admin calls refused until it holds one), "
        "re-read when it changes (--admin-token-reload-s) and on SIGHUP; a file that then cannot "
        "be read, is empty or holds no token keeps the token in force and logs an ERROR")
    admin_token_reload_s: float = Field(
        5.0, ge=0, allow_inf_nan=False,
        description="seconds between looks at --admin-token-file (its stat, following symlinks: a "
        "Kubernetes Secret volume's swap is seen); 0: only on SIGHUP")
    # Why: in memory only, a scheduler that restarted (a crash, an OOM kill) forgot its cordons
    # and sent traffic to the workers an operator had taken out (scheduler/cordon_file.py).
    cordon_file: str | None = Field(
        None, description="JSON file that keeps the cordons across restarts: read at start "
        "(missing or empty: none; unreadable or corrupt: start-up stops, rather than put cordoned "
        "workers back in rotation) and rewritten whole after each cordon or uncordon (a temp "
        "file renamed over it; a write that fails is logged and the cordon holds in memory); "
        "unset: cordons are kept in memory only")
    # Finite: an infinite TTL went out as the registration answer's heartbeat_interval_s,
    # `Infinity`, which is no JSON.
    registration_ttl_s: float = Field(10.0, gt=0, allow_inf_nan=False,
                                      description="a registration expires without heartbeats")
    # Why: the scheduler scrapes a registered URL and every gateway sends clients' requests to
    # it, so whoever holds the token can aim both at any host the cluster reaches. Link-local
    # addresses (the cloud metadata service) are refused whatever this says.
    # A name is resolved at every heartbeat (scheduler/discovery/registration.py): DNS
    # rebinding is caught within the TTL, not prevented (the scraper and the gateways resolve
    # the name themselves, and a DNS server that answers each query differently can pass every
    # check): the DNS answering for those names is trusted.
    registration_allowed_networks: str = Field(
        "", description="networks a registered worker's address must be in, comma-separated CIDRs "
        "(e.g. the pod network, 10.0.0.0/8); a registration that names its host (a pod's, a "
        "Service's or a compose service's DNS name) is then taken when every address the name "
        "resolves to is in them (resolved within 2 s, else refused, 400), and the name is "
        "resolved again at every heartbeat: once it resolves outside, the registration is "
        "dropped (DNS rebinding), and while it does not resolve its heartbeats are refused (it "
        "lapses after --registration-ttl-s). Register IP addresses for no window between those "
        "checks; empty: any address but link-local ones, names unresolved")
    # Why a bound: every registered worker is scraped every scrape interval, so a registrar
    # gone wrong (a leaked token, a crash loop minting new ids) would grow the scrape load
    # without end; refused registrations say so instead.
    max_registered_workers: int = Field(
        1024, ge=1, description="self-registered workers kept at most; past it a new registration "
        "is refused (429) until one leaves or expires (heartbeats of those kept still go through)")
    worker_max_running: dict[str, int] = Field(
        default_factory=dict,
        description="running-request cap per worker (its --max-num-seqs / --max-running-requests), "
        "by worker id (host:port) or URL, YAML or JSON; the key \"*\" is every other worker's "
        "(e.g. a pool of identical engines discovered in Kubernetes). llm_aware keeps a worker at "
        "its cap out of the choice from the first request on (else the cap is learnt once "
        "requests queue there). A worker's own entry wins over a cap a registration or TGI's "
        "/info announces, and that announced cap wins over \"*\"")
    k8s_namespace: str | None = Field(None, description="watch EndpointSlices in this namespace")
    k8s_label_selector: str | None = Field(None, description="label selector of the EndpointSlices")
    k8s_port: str | None = Field(None, description="port name or number on the endpoints (default first)")
    k8s_scheme: Literal["http", "https"] = Field(
        "http", description="scheme of the workers discovered in Kubernetes (https: their "
        "certificates must name their pod IPs; see --worker-ca-file)")
    k8s_api_server: str | None = Field(None, description="override the API server URL (tests)")
    k8s_watch_timeout_s: int = Field(
        300, ge=1, le=3600,
        description="each EndpointSlice watch asks the API server to end it after this many seconds "
        "(timeoutSeconds, as client-go does); with no event for that long and a little more, the "
        "watch is dropped and the slices listed again: a connection that died without a close (a "
        "load balancer's idle drop, a lost node) would otherwise wait for events forever")

    # Scraping and health
    scrape_interval_ms: int = Field(100, ge=5, le=600_000)
    scrape_timeout_ms: int = Field(2000, ge=10, description="per scrape; generous: busy is not dead")
    fail_streak: int = Field(3, ge=1, description="connection failures in a row that take a worker out")
    failure_report_streak: int = Field(
        3, ge=1, description="gateway reports in a row of requests a worker failed with an answer "
        "(HTTP 5xx) or a timeout that take it out (a connection failure a gateway reports takes it "
        "out at once); one request the engine cannot serve must not take out every worker it is "
        "retried on")
    recover_streak: int = Field(2, ge=1, description="successes in a row before a half-open trial")
    dead_after_ms: int = Field(10_000, ge=100, description="no success for this long: out (silent host)")
    stale_after_ms: int = Field(2000, ge=10, description="older load data: treat the worker as saturated")
    models_refresh_ms: int = Field(5000, ge=100, description="how often /v1/models is re-read")
    startup_grace_s: float = Field(
        30.0, ge=0, allow_inf_nan=False,
        description="after start, until the pool is learnt (static workers' models read, the "
        "first Kubernetes list, --registration-ttl-s for registered workers) and at most this "
        "long, a model no known worker serves is answered 'no healthy worker' (503, retried), "
        "not 'no such model' (404): a restarted scheduler knows no worker yet",
    )
    model_gone_grace_s: float = Field(
        300.0, ge=0, allow_inf_nan=False,
        description="a model whose last worker left (its pod restarting, a rollout, a lapsed "
        "registration) is answered 'no healthy worker' (the gateway's 503, which clients retry) "
        "for this long before it is 'no such model' (404)",
    )
    scrape_only_used_series: bool = Field(
        True, description="ask vLLM and SGLang (prometheus_client pages) for the series the "
        "scheduler reads, `/metrics/?name[]=...`, instead of the whole page: a real vLLM's page "
        "costs its API server ~5.5 ms of CPU to render in full, ~1.1 ms filtered (a worker whose "
        "filtered scrape fails, lacks them or is not filtered goes back to whole pages)")

    # Decisions
    policy: str = Field("llm_aware", description="round_robin, random, least_request, power_of_two, "
                        "least_kv, prefix_affinity, session, llm_aware")
    policy_params: dict[str, Any] = Field(default_factory=dict, description="policy knobs (YAML or JSON)")
    # Why per policy: knobs tuned for one policy (e.g. llm_aware's prefill cap, which follows the
    # engines' step budget) can stay in a deployment's config while `policy` is switched; a flat
    # policy_params would be refused by any other policy. Every entry is checked at start-up.
    params_by_policy: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="knobs per policy name (YAML or JSON); the chosen policy's entry applies, "
        "under policy_params")
    # Why here and not in each gateway: every replica must place a session the same way.
    session_ttl_s: float = Field(
        DEFAULT_SESSION_TTL_S, gt=0, allow_inf_nan=False,
        description="a session (the gateways' --session-header) unused this long forgets its "
        "worker: its next request is placed as a new session's (scheduler/sessions.py)")
    max_sessions: int = Field(
        DEFAULT_MAX_SESSIONS, ge=1,
        description="sessions whose worker is kept at most; past it the least recently used is "
        "forgotten")
    lease_ttl_s: float = Field(600.0, gt=0, allow_inf_nan=False,
                               description="a lease never released expires after this")
    gateway_gone_grace_s: float = Field(
        5.0, ge=0, allow_inf_nan=False,
        description="a gateway that names itself (X-Gateway-Instance) and has had no channel open "
        "this long is gone: its leases end then, not at --lease-ttl-s (scheduler/gateways.py; 0: "
        "only at the TTL). Longer than a reconnect takes (a TLS reload, a cut connection)")
    visibility_lag_ms: float = Field(50.0, ge=0, allow_inf_nan=False,
                                     description="leases this close before a scrape: unseen")
    retry_after_ms: int = Field(0, ge=0, description="hint in wait answers (0: the scrape interval)")
    followup_hold_ms: float = Field(
        0.0, ge=0, le=5000,
        description="hold a finished request's KV this long for its follow-up turn (0: off; "
        "scheduler/reservations.py)")
    keep_room_after_s: float = Field(
        5.0, ge=0, le=3600, allow_inf_nan=False,
        description="a held large request (a tenth of a worker's KV pool or more) that fits a "
        "worker's whole pool but what is free on none "
        "of them, after waiting this long in its gateway's queue, has the worker nearest to "
        "holding it kept for it: nothing else is placed there until it is, so smaller requests "
        "(other gateways', other askers') cannot take the room it waits for forever (0: off; "
        "scheduler/kept_room.py)")
    # Why a bound: on a worker whose cache is nearly full admissions wait for KV, not prefill;
    # draining its backlog early only sends it prompts that then wait in its FCFS queue
    # instead of the gateway's (multi-turn chat: P99 TTFT +5 % unbounded, level at 0.8;
    # benchmarks/RESULTS.md, "First-token reports and a smaller prefill cap").
    prefilled_max_kv_usage: float = Field(
        0.8, gt=0, le=1.0,
        description="a gateway's first-token report drains its worker's prefill backlog only while "
        "the worker's KV usage is below this (1.0: always); above it the prompt counter drains it "
        "at the next scrape")

    # Why in the scheduler too: each gateway replica orders only its own queue. Tenants whose
    # connections land on different replicas meet here, where the replicas' held calls wait for
    # room; in arrival order each replica's head got one turn per request, whatever it cost.
    fair_share: bool = Field(
        True, description="hand freed room to the held call whose flow (the tenant the gateway "
        "names, with its --fair-share tokens) has been served the fewest weighted tokens over "
        "every gateway's traffic; off: in arrival order (scheduler/fair_share.py)")
    fair_output_token_weight: float = Field(
        2.0, ge=0, le=100, allow_inf_nan=False,
        description="an output token's weight against a prompt token's in the flows' counters "
        "(the gateways' --fair-output-token-weight)")

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, v: str) -> str:
        return known_log_level(v)

    @field_validator("ssl_cert_reqs", mode="before")
    @classmethod
    def _cert_reqs(cls, v: Any) -> Any:
        return cert_reqs_value(v)

    @field_validator("registration_token", "gateway_token", "admin_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        return clean_secret(v)

    @field_validator("cordon_file", "admin_token_file")
    @classmethod
    def _optional_path(cls, v: str | None) -> str | None:
        # Empty is unset: compose and the launchers pass ${VAR:-} through as "".
        if v is None:
            return None
        return v.strip() or None

    @field_validator("registration_allowed_networks")
    @classmethod
    def _networks(cls, v: str) -> str:
        for entry in (e.strip() for e in v.split(",")):
            if entry:
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError as exc:
                    raise ValueError(f"{entry!r} is not a network ({exc})") from None
        return v

    @property
    def registration_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(e.strip(), strict=False)
                for e in self.registration_allowed_networks.split(",") if e.strip()]

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from scheduler.policies import POLICIES

        if v not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(sorted(POLICIES))}")
        return v

    @field_validator("policy_params")
    @classmethod
    def _known_params(cls, v: dict[str, Any], info) -> dict[str, Any]:
        from scheduler.policies import validate_params

        policy = info.data.get("policy")
        if policy:
            validate_params(policy, v)
        return v

    @field_validator("params_by_policy")
    @classmethod
    def _known_params_by_policy(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from scheduler.policies import validate_params

        for name, params in v.items():
            validate_params(name, params)
        return v

    @property
    def effective_policy_params(self) -> dict[str, Any]:
        """What the chosen policy runs with: its params_by_policy entry, then policy_params."""
        return {**self.params_by_policy.get(self.policy, {}), **self.policy_params}

    @field_validator("workers", mode="before")
    @classmethod
    def _join_list(cls, v: Any) -> Any:
        return ",".join(str(x) for x in v) if isinstance(v, list | tuple) else v

    @field_validator("workers")
    @classmethod
    def _check_urls(cls, v: str) -> str:
        for url in (u.strip() for u in v.split(",")):
            problem = http_url_problem(url) if url else None
            if problem:
                raise ValueError(f"worker URL {problem}")
        return v

    @field_validator("k8s_api_server")
    @classmethod
    def _check_api_server(cls, v: str | None) -> str | None:
        problem = http_url_problem(v) if v else None  # else every watch failed, retried forever
        if problem:
            raise ValueError(f"URL {problem}")
        return v

    @field_validator("worker_max_running")
    @classmethod
    def _check_caps(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [key for key, cap in v.items() if not is_positive_int(cap)]
        if bad:
            raise ValueError(f"worker_max_running must be from 1 to 2**53 (given for {', '.join(bad)})")
        return {key.rstrip("/"): cap for key, cap in v.items()}

    def declared_running_cap(self, worker_id: str, url: str) -> int | None:
        """The cap configured for this worker by its id or its URL (not the "*" default)."""
        caps = self.worker_max_running
        return caps.get(worker_id, caps.get(url)) if caps else None

    @property
    def default_running_cap(self) -> int | None:
        """The "*" entry: the cap of a worker with no entry of its own and none announced."""
        return self.worker_max_running.get("*")

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        if bool(self.k8s_namespace) != bool(self.k8s_label_selector):
            raise ValueError("k8s_namespace and k8s_label_selector go together")
        if self.admin_token and self.admin_token_file:
            # Which would win is a guess either way: a rotated file beaten by a stale inline token.
            raise ValueError("admin_token and admin_token_file exclude each other: give one")
        problem = options_problem(self)  # e.g. a key without its certificate: not plain HTTP instead
        if problem:
            raise ValueError(problem)
        return self

    @property
    def worker_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.workers.split(",") if u.strip()]


def load_scheduler_config(argv: list[str] | None = None) -> SchedulerConfig:
    return load_settings(SchedulerConfig, argv)
