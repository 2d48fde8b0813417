"""Gateway configuration: CLI flags, ROUTER_* environment variables, optional YAML (--config).

Defaults are the reference product's (max_queue_size 128, retry_count 2,
wait_schedule_timeout 5000 ms, wait_schedule_try_period 500 ms).
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from router.fairness import DEFAULT_FAIRNESS_HEADER
from scheduler.connection_limit import DEFAULT_KEEPALIVE_TIMEOUT_S, KEEPALIVE_HELP, MAX_CONNECTIONS_HELP
from scheduler.receive_timeout import DEFAULT_RECEIVE_TIMEOUT_S, receive_timeout_help
from scheduler.settings_loader import clean_secret, known_log_level
from scheduler.tls import CLIENT_HELP, RELOAD_HELP, SERVER_HELP, cert_reqs_value, options_problem
from scheduler.urls import http_url_problem


class RouterConfig(BaseSettings):
    """Every flag may also be set by the environment variable ROUTER_<FLAG>, e.g.
    ROUTER_MAX_QUEUE_SIZE, or in the YAML file --config names (field names, - or _).
    Precedence: flag, then environment, then file, then the default."""

    model_config = SettingsConfigDict(
        env_prefix="ROUTER_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m router",
        extra="forbid",
    )

    config: str | None = Field(None, description="optional YAML file with any of these fields")

    # Listening
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    base_path: str = Field(
        "", description="extra URL prefix also served, e.g. /api/predict/{group}.{service}_llm_gateway"
    )
    # TLS (scheduler/tls.py): the gateway terminates it itself, as vLLM does, so clients' API
    # keys and prompts do not cross the network in clear.
    ssl_certfile: str | None = Field(
        None, description=SERVER_HELP["ssl_certfile"] + "; --metrics-port is served with the same "
        "certificate and client-certificate rule")
    ssl_keyfile: str | None = Field(None, description=SERVER_HELP["ssl_keyfile"])
    ssl_ca_certs: str | None = Field(None, description=SERVER_HELP["ssl_ca_certs"])
    ssl_cert_reqs: int | None = Field(None, ge=0, le=2, description=SERVER_HELP["ssl_cert_reqs"])
    ssl_reload_s: float = Field(5.0, ge=0, allow_inf_nan=False, description=RELOAD_HELP)

    # Scheduler and workers
    scheduler: str | None = Field(None, description="scheduler base URL, e.g. http://127.0.0.1:8090")
    workers: str = Field("", description="comma-separated worker URLs always usable in fallback mode")
    worker_ca_file: str | None = Field(
        None, description="PEM bundle of the CAs that https:// workers' certificates are checked "
        "against, instead of the system's: a private CA. The check is never off")
    scheduler_ca_file: str | None = Field(
        None, description="the same for an https:// --scheduler")
    ssl_client_certfile: str | None = Field(None, description=CLIENT_HELP["ssl_client_certfile"]
                                            + " (workers, the scheduler)")
    ssl_client_keyfile: str | None = Field(None, description=CLIENT_HELP["ssl_client_keyfile"])
    scheduler_timeout_ms: int = Field(2000, ge=10, description="timeout of one scheduler call")
    scheduler_token: str | None = Field(
        None, description="Bearer token sent on every call to the scheduler (its --gateway-token); "
        "a token it refuses (401) is logged as an ERROR and the gateway serves by round robin "
        "until the scheduler takes it")
    scheduler_pipelining: bool = Field(
        True,
        description="batch each loop iteration's schedule/release calls into one message on one "
        "persistent connection (off: one SchedulerClient HTTP request per call)",
    )
    scheduler_channel: Literal["auto", "ws", "http"] = Field(
        "auto",
        description="pipelined channel: ws (scheduler's /v1/channel), http (pipelined HTTP/1.1), "
        "auto (ws, else http for a scheduler without the channel)",
    )
    report_prefilled: bool = Field(
        True,
        description="tell the scheduler when a streamed request's first token arrives (its prompt is "
        "prefilled), so its prefill backlog drains then instead of at the worker's next scrape "
        "(the scheduler acts on it only below its prefilled_max_kv_usage; see benchmarks/RESULTS.md)",
    )
    lease_renew_ms: int = Field(
        120_000, ge=0,
        description="a request still running this long after its lease was issued has the lease "
        "renewed, and again each such period, so a long generation outlives the scheduler's "
        "lease TTL (keep it well under the scheduler's --lease-ttl-s; 0: never renew)",
    )
    scheduler_probe_ms: int = Field(100, ge=10, description="while it is down, how often to probe it")
    workers_refresh_ms: int = Field(2000, ge=50, description="refresh period of the cached /v1/workers")
    models_cache_ms: int = Field(1000, ge=0, description="how long GET /v1/models answers are cached")

    tokenizer: str | None = Field(
        None,
        description="tokenizer.json (or its directory) for exact prompt token counts; else ~4 chars/token",
    )

    # Queue, retries, fallback (reference product names)
    max_queue_size: int = Field(128, ge=0, description="requests that may wait for a worker; more get 429")
    queue_timeout_ms: int = Field(60_000, ge=1, description="a request waiting longer gets 429")
    queue_ms_per_prompt_token: float = Field(
        1.0, ge=0, le=1000,
        description="0: the queue is FIFO; above 0, shorter prompts go first: a prompt of N tokens "
        "queues as if it had arrived N x this many ms later (1: the setting measured in "
        "benchmarks/RESULTS.md)",
    )
    fair_queueing: bool = Field(
        True,
        description="queued requests of one priority are taken from each flow (tenant: the "
        "fairness header's value, else the API key) in turn, so one tenant's flood does not queue "
        "the others behind it; off: one line for all",
    )
    fair_share: Literal["requests", "tokens"] = Field(
        "tokens",
        description="what a flow's turn in the queue is: the flow served the fewest tokens goes "
        "next (tokens: prompt tokens plus --fair-output-token-weight x output tokens, counted per "
        "model), so that a tenant of long prompts and answers does not get the most GPU time by "
        "taking as many turns as one of short ones; or one request each (requests, the Gateway "
        "API Inference Extension's round robin)",
    )
    fair_output_token_weight: float = Field(
        2.0, ge=0, le=100,
        description="with --fair-share tokens: what an output token counts against a prompt token "
        "(a decode step reads every weight for one token per sequence; 2 as in VTC)",
    )
    fairness_header: str = Field(
        DEFAULT_FAIRNESS_HEADER,
        description="the request header that names a request's flow (the Gateway API Inference "
        "Extension's); without it, the API key does. A client that can set it chooses its flow: "
        "have a trusted proxy in front set it, or give each client its own API key and set this "
        "to '' (flows by API key only)",
    )
    # Why off by default: as with production-stack's --session-key, the operator names the
    # header its clients send; no header is sessions' by convention.
    session_header: str = Field(
        "",
        description="request header naming a request's session (e.g. x-session-id): the scheduler "
        "keeps a session's requests on one worker while it can take them (llm_aware: unless it is "
        "busier than the best by its session_slack; the session policy: always while it is in "
        "rotation). A request without it is a session by the body's prompt_cache_key (OpenAI's "
        "field) if it has one. The scheduler is sent a digest of the value, never the value. "
        "Empty: off",
    )
    queue_askers: int = Field(
        1, ge=1, le=64,
        description="queued requests (best first) that ask the scheduler at once: above 1, room "
        "the head's prompt does not fit goes to the next request that fits",
    )
    followup_pass_ms: float = Field(
        0.0, ge=0, le=60_000,
        description="an arrival may take room the scheduler holds for its prefix (a follow-up turn, "
        "scheduler --followup-hold-ms) ahead of queued requests while the oldest of those asking "
        "has waited less than this (0: never passes)",
    )
    schedule_wait_ms: int = Field(
        1000, ge=1, le=60_000, description="long-poll length of one queued call"
    )
    retry_count: int = Field(2, ge=0, le=10, description="other workers tried before the first byte")
    wait_schedule_timeout_ms: int = Field(
        5000, ge=0, description="scheduler unreachable this long: round robin over known workers"
    )
    wait_schedule_try_period_ms: int = Field(
        500, ge=10, description="while it is unreachable, requests retry the scheduler this often"
    )
    fallback_cooldown_ms: int = Field(
        2000, ge=10, description="passive health: how long a failed worker rests"
    )

    # Stopping
    shutdown_timeout: float = Field(
        50.0, ge=0, le=3600, allow_inf_nan=False,
        description="on SIGTERM/SIGINT, seconds for the requests in flight (streams and "
        "WebSocket answers alike, one deadline for all) to finish before they are cut; keep it "
        "below the orchestrator's grace period (Kubernetes: terminationGracePeriodSeconds 60 "
        "less the 5 s preStop sleep)",
    )

    # Client timeout
    request_receive_timeout_ms: int = Field(
        int(DEFAULT_RECEIVE_TIMEOUT_S * 1000), ge=1,
        description=receive_timeout_help(", however long it streams"),
    )
    # Client connections (scheduler/connection_limit.py); --metrics-port is not capped, so an
    # overloaded gateway can still be scraped.
    keepalive_timeout_s: float = Field(DEFAULT_KEEPALIVE_TIMEOUT_S, gt=0, le=86_400, allow_inf_nan=False,
                                       description=KEEPALIVE_HELP)
    max_connections: int | None = Field(
        None, ge=0, description=MAX_CONNECTIONS_HELP + ", halved: each client request also holds a "
        "connection to its worker")

    # Upstream timeouts
    connect_timeout_ms: int = Field(2000, ge=1, description="connecting to a worker")
    first_byte_timeout_ms: int = Field(
        60_000, ge=1, description="a stream's first byte from its worker (then: retried elsewhere)"
    )
    request_timeout_ms: int = Field(
        1_800_000, ge=1,
        description="the longest wait for a non-stream answer, which its worker sends whole when "
        "the generation ends: past it, a 504 upstream_timeout (not retried: it would take as "
        "long elsewhere); one whose worker the scheduler reports down is retried at once",
    )
    idle_stream_timeout_ms: int = Field(
        60_000, ge=1, description="max gap between two upstream chunks of a stream"
    )

    # Security
    api_key_file: str | None = Field(
        None, description="file with the accepted API keys, one per line or comma-separated, '#' "
        "lines comments; re-read when it changes (--api-key-reload-s) and on SIGHUP")
    api_key_reload_s: float = Field(
        5.0, ge=0, allow_inf_nan=False,
        description="seconds between looks at --api-key-file (its stat, following symlinks: a "
        "Kubernetes Secret volume's swap is seen); a changed file's keys take effect for new "
        "requests, one unreadable or with no key keeps the keys in force; 0: only on SIGHUP")
    api_keys: str = Field("", description="accepted API keys, comma-separated or one per line "
                          "(prefer --api-key-file, or ROUTER_API_KEYS from a secret)")
    forward_api_key: bool = Field(False, description="pass the client's Authorization header upstream")
    upstream_api_key: str | None = Field(None, description="Bearer key the gateway sends to workers")
    admin_token: str | None = Field(None, description="Bearer token required for /metrics and /admin/*")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    ws_heartbeat_s: float = Field(
        30.0, gt=0, le=3600, allow_inf_nan=False,
        description="WebSocket ping interval, both to clients and to workers: a peer that has not "
        "answered a ping within half of it is taken as gone (a worker then as failed, its "
        "requests' leases released); below a load balancer's idle timeout keeps sockets open",
    )
    cors_allowed_origins: str = Field(
        "",
        description="browser origins allowed to call the API (CORS), comma-separated, e.g. "
        "https://chat.example.com, or * for any; empty: none (no CORS headers at all)",
    )

    # Observability
    debug_headers: bool = Field(False, description="add the scheduling decision to response headers")
    allow_metrics: bool = Field(True, description="serve Prometheus /metrics")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve /metrics on its own port (in HTTPS, as the API port, "
        "with --ssl-certfile)")
    access_log: bool = True
    otlp_traces_endpoint: str | None = Field(
        None,
        description="export the gateway's own OpenTelemetry traces (a span per request, with its "
        "queue wait, scheduler calls and upstream attempts) to this OTLP/HTTP collector URL, e.g. "
        "http://otel-collector:4318/v1/traces (a URL without a path gets /v1/traces); the "
        "worker is then sent the gateway's span as its parent. Needs pip install '.[tracing]'. "
        "Off: no tracing code runs, and the client's traceparent goes on unchanged",
    )
    otlp_traces_sample_ratio: float = Field(
        1.0, ge=0, le=1, allow_inf_nan=False,
        description="share of the traces begun at the gateway that are kept; a request with a "
        "client's traceparent follows the client's sampled flag (parent-based)",
    )
    # Finite: inf was taken, and the stats line never came.
    log_stats_interval: float = Field(5.0, gt=0, allow_inf_nan=False,
                                      description="seconds between stats log lines")
    log_level: str = "INFO"

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, v: str) -> str:
        return known_log_level(v)

    @field_validator("ssl_cert_reqs", mode="before")
    @classmethod
    def _cert_reqs(cls, v: object) -> object:
        return cert_reqs_value(v)

    @field_validator("admin_token", "upstream_api_key", "scheduler_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        return clean_secret(v)

    @field_validator("scheduler", "workers")
    @classmethod
    def _http_urls(cls, v: str | None) -> str | None:
        for url in (v or "").split(","):
            problem = http_url_problem(url.strip()) if url.strip() else None
            if problem:
                raise ValueError(f"URL {problem}")
        return v

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_url(cls, v: str | None) -> str | None:
        v = (v or "").strip() or None  # empty (an unset variable in a manifest): off
        problem = http_url_problem(v) if v else None
        if problem:
            raise ValueError(f"URL {problem}")
        return v

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, v: str) -> str:
        for origin in (o.strip() for o in v.split(",")):
            if not origin or origin == "*":
                continue
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], no path) or *")
        return v

    @property
    def cors_origins(self) -> list[str]:
        return [o.strip() for o in self.cors_allowed_origins.split(",") if o.strip()]

    @field_validator("fairness_header", "session_header")
    @classmethod
    def _header_name(cls, v: str, info) -> str:
        # No request carries a header whose name holds a space or a control character: a typo
        # like that silently keyed every flow by API key (or turned sessions off).
        if v and not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", v):
            off = "flows by API key only" if info.field_name == "fairness_header" else "no sessions"
            raise ValueError(f"{v!r} is not an HTTP header name ('' for {off})")
        return v

    @field_validator("base_path")
    @classmethod
    def _base_path(cls, v: str) -> str:
        if v and not v.startswith("/"):
            raise ValueError("must start with '/'")
        if v:
            # Its {name} parts are aiohttp's route variables: one it cannot parse ("/{x") was a
            # traceback when the routes were added, after the config was taken.
            from aiohttp import web

            try:
                for route in ("/v1/models/{model_id}", "/v1/{tail:.+}"):  # as build_app adds them
                    web.UrlDispatcher().add_resource(v.rstrip("/") + route)
            except ValueError as exc:
                raise ValueError(f"not a usable path ({exc})") from None
        return v.rstrip("/")

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        if not self.scheduler and not self.worker_urls:
            raise ValueError("give --scheduler or --workers (or both)")
        problem = options_problem(self)  # e.g. a key without its certificate: not plain HTTP instead
        if problem:
            raise ValueError(problem)
        return self

    @property
    def worker_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.workers.split(",") if u.strip()]


def load_router_config(argv: list[str] | None = None) -> RouterConfig:
    from scheduler.settings_loader import load_settings

    return load_settings(RouterConfig, argv)
