"""Gateway configuration: flags, ROUTER_* environment, YAML, and start-up errors that name the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.config import load_router_config
from tests.router.procs import REPO


def test_defaults_are_the_reference_products():
    cfg = load_router_config(["--scheduler", "http://127.0.0.1:8090"])
    assert (cfg.max_queue_size, cfg.retry_count) == (128, 2)
    assert (cfg.wait_schedule_timeout_ms, cfg.wait_schedule_try_period_ms) == (5000, 500)
    assert cfg.allow_metrics and cfg.metrics_port is None


def test_precedence_cli_over_env_over_yaml(tmp_path, monkeypatch):
    y = tmp_path / "gateway.yaml"
    y.write_text("scheduler: http://127.0.0.1:9000\nmax-queue-size: 7\nretry_count: 1\nbase_path: /api/x/\n")
    monkeypatch.setenv("ROUTER_RETRY_COUNT", "3")
    cfg = load_router_config(["--config", str(y), "--workers", "http://127.0.0.1:1,http://127.0.0.1:2/"])
    assert cfg.scheduler == "http://127.0.0.1:9000" and cfg.max_queue_size == 7
    assert cfg.retry_count == 3  # env beats YAML
    assert cfg.base_path == "/api/x"
    assert cfg.worker_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cfg = load_router_config(["--config", str(y), "--retry-count", "0"])
    assert cfg.retry_count == 0  # CLI beats env


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--scheduler", "http://x", "--max-queue-size", "-1"], "max-queue-size"),
        (["--scheduler", "http://x", "--retry-count", "many"], "retry-count"),
        (["--workers", "ftp://nope"], "ftp://nope"),
        (["--workers", "http://127.0.0.1:99999"], "workers"),
        (["--scheduler", "http://"], "scheduler"),  # once a traceback from the channel's set-up
        (["--scheduler", "http://x", "--scheduler-channel", "udp"], "scheduler-channel"),
        ([], "--scheduler"),
    ],
)
def test_bad_values_stop_start_up_naming_the_field(argv, field):
    r = subprocess.run([sys.executable, "-m", "router", *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    assert field in r.stderr and "Traceback" not in r.stderr


def test_scheduler_channel_from_flag_and_env(monkeypatch):
    assert load_router_config(["--scheduler", "http://x"]).scheduler_channel == "auto"
    cfg = load_router_config(["--scheduler", "http://x", "--scheduler-channel", "http"])
    assert cfg.scheduler_channel == "http"
    monkeypatch.setenv("ROUTER_SCHEDULER_CHANNEL", "ws")
    assert load_router_config(["--scheduler", "http://x"]).scheduler_channel == "ws"
