"""Worker configuration: CLI flags, WORKER_* environment variables, optional YAML (--config)."""

from __future__ import annotations

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference_worker.server.connection_limit import (
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    KEEPALIVE_HELP,
    MAX_CONNECTIONS_HELP,
)
from inference_worker.server.receive_timeout import DEFAULT_RECEIVE_TIMEOUT_S, receive_timeout_help
from inference_worker.server.tls import (
    CLIENT_HELP,
    RELOAD_HELP,
    SERVER_HELP,
    cert_reqs_value,
    options_problem,
)
from inference_worker.settings_loader import clean_secret, load_settings


class WorkerConfig(BaseSettings):
    """Every flag may also be set by the environment variable WORKER_<FLAG>, e.g.
    WORKER_MAX_NUM_SEQS, or in the YAML file --config names (field names, - or _).
    Precedence: flag, then environment, then file, then the default."""

    model_config = SettingsConfigDict(
        env_prefix="WORKER_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m inference_worker",
        extra="forbid",
    )

    config: str | None = Field(None, description="optional YAML file with any of these fields")

    # Model and backend
    backend: Literal["torch", "sim"] = Field("torch", description="real model, or the sim latency model")
    model: str = Field("smollm2", description="alias 'smollm2' or a local Hugging Face model directory")
    served_model_name: str | None = Field(None, description="model name in the API (default: --model)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    # Engine limits
    max_model_len: int = Field(2048, ge=16)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=2, description="size of the KV pool in blocks")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="size of the KV pool in bytes")
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = Field(
        True,
        description="split long prompts across steps and mix them with decodes (vLLM V1); off: "
        "prefill-only steps with whole prompts, as vLLM V0 (--max-num-batched-tokens then "
        "defaults to max(--max-model-len, 2048))",
    )
    enforce_eager: bool = Field(
        False,
        description="on CUDA, run every step eagerly (vLLM's flag); default: decode-only steps "
        "replay CUDA graphs captured at start-up, one per padded batch and context size",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="order of the waiting queue (vLLM's flag): fcfs, or priority (a request's "
        "`priority` field, lower first, then arrival; preemption takes the worst priority)",
    )

    # Observability
    # Finite: inf was taken, and the stats line never came.
    log_stats_interval: float = Field(5.0, gt=0, allow_inf_nan=False,
                                      description="seconds between stats log lines")
    hide_legacy_metrics: bool = Field(False, description="hide the vLLM v0 compatibility aliases")

    # Server
    host: str = "127.0.0.1"
    port: int = Field(8001, ge=1, le=65535)
    # TLS (server/tls.py), vLLM's flags
    ssl_certfile: str | None = Field(None, description=SERVER_HELP["ssl_certfile"])
    ssl_keyfile: str | None = Field(None, description=SERVER_HELP["ssl_keyfile"])
    ssl_ca_certs: str | None = Field(None, description=SERVER_HELP["ssl_ca_certs"])
    ssl_cert_reqs: int | None = Field(None, ge=0, le=2, description=SERVER_HELP["ssl_cert_reqs"])
    ssl_reload_s: float = Field(5.0, ge=0, allow_inf_nan=False, description=RELOAD_HELP)
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM/SIGINT, seconds to let the requests in flight finish (new ones "
        "get 503) before they are ended with a 503 error; 0: at once (vLLM's default). A second "
        "signal ends them at once",
    )
    request_receive_timeout_ms: int = Field(
        int(DEFAULT_RECEIVE_TIMEOUT_S * 1000), ge=1,
        description=receive_timeout_help(", however long it streams"),
    )
    # Connections (server/connection_limit.py)
    keepalive_timeout_s: float = Field(DEFAULT_KEEPALIVE_TIMEOUT_S, gt=0, le=86_400, allow_inf_nan=False,
                                       description=KEEPALIVE_HELP)
    max_connections: int | None = Field(None, ge=0, description=MAX_CONNECTIONS_HELP)

    responses_store_size: int = Field(
        1024,
        ge=0,
        description="Responses API answers kept for previous_response_id and GET "
        "/v1/responses/{id}, least recently used out first; 0: none (vLLM keeps none unless "
        "VLLM_ENABLE_RESPONSES_API_STORE=1, and then every one)",
    )

    # Registration with a scheduler (see scheduler issue)
    register_with: str | None = Field(None, description="scheduler URL to self-register with")
    registration_token: str | None = None
    advertise_url: str | None = Field(
        None, description="URL the scheduler should use (default http://host:port, https:// with "
        "--ssl-certfile)")
    scheduler_ca_file: str | None = Field(
        None, description="PEM bundle of the CAs that an https:// --register-with scheduler's "
        "certificate is checked against, instead of the system's: a private CA. The check is never off")
    ssl_client_certfile: str | None = Field(None, description=CLIENT_HELP["ssl_client_certfile"]
                                            + " (the scheduler registered with)")
    ssl_client_keyfile: str | None = Field(None, description=CLIENT_HELP["ssl_client_keyfile"])

    # Sim backend
    sim_profile: str = Field("tiny", description="profile name or path to a profile YAML")
    # Finite: an infinite stretch was taken (its engine clock, monotonic / time_scale, stands
    # still at 0, and a simulated step lasts forever).
    time_scale: float = Field(1.0, gt=0, allow_inf_nan=False,
                              description="stretch every simulated duration by this factor")

    @field_validator("registration_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        return clean_secret(v)

    @field_validator("ssl_cert_reqs", mode="before")
    @classmethod
    def _cert_reqs(cls, v: object) -> object:
        return cert_reqs_value(v)

    @field_validator("register_with", "advertise_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        # A typo here would only show as registration warnings, forever: stop start-up instead.
        # (The scheduler checks what it is given the same way; the worker imports nothing of it.)
        if v is None:
            return v
        try:
            parts = urlsplit(v)
            _ = parts.port  # a port out of range or not a number raises ValueError
        except ValueError as exc:
            raise ValueError(f"{v!r} is not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http(s) URL with a host")
        # What the scheduler refuses (scheduler/urls.py), refused here too rather than warned
        # about at every registration.
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"{v!r} has credentials in it (user:password@), which a base URL must not hold")
        if parts.query or parts.fragment or v.rstrip("/").endswith(("?", "#")):
            raise ValueError(f"{v!r} has a query or a fragment, which a base URL cannot have")
        if any(c.isspace() or not c.isprintable() for c in v):
            raise ValueError(f"{v!r} has a space or a control character in it")
        return v

    @model_validator(mode="after")
    def _check(self) -> WorkerConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_bytes, not both")
        if self.register_with and not self.advertise_url and _every_interface(self.host):
            # http://0.0.0.0:port would be registered: no address another host can reach (the
            # scheduler refuses it), so every heartbeat would be refused for the worker's life.
            raise ValueError(f"--host {self.host} listens on every interface: give --advertise-url, "
                             "the URL the scheduler reaches this worker at, to register with it")
        problem = options_problem(self)  # e.g. a key without its certificate: not plain HTTP instead
        if problem:
            raise ValueError(problem)
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def _every_interface(host: str) -> bool:
    """0.0.0.0, :: or an empty host: the server listens on every interface."""
    try:
        return not host or ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a name or one address


def load_worker_config(argv: list[str] | None = None) -> WorkerConfig:
    return load_settings(WorkerConfig, argv)
