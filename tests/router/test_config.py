"""Gateway configuration: flags, ROUTER_* environment, YAML, and start-up errors that name the field."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from router.auth import load_api_keys
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
        # A header cannot carry it: aiohttp refused every upstream request (every worker "failed").
        (["--scheduler", "http://x", "--upstream-api-key", "sk\nx"], "upstream-api-key"),
        # No client can send it: /metrics and /admin/* answered 401 to everyone, silently.
        (["--scheduler", "http://x", "--admin-token", "t\r1"], "admin-token"),
        (["--scheduler", "http://x", "--log-stats-interval", "inf"], "log-stats-interval"),  # never
        # A collector's host:port without its scheme: every export would fail, in another thread.
        (["--scheduler", "http://x", "--otlp-traces-endpoint", "collector:4318"], "otlp-traces-endpoint"),
        (["--scheduler", "http://x", "--otlp-traces-sample-ratio", "2"], "otlp-traces-sample-ratio"),
        ([], "--scheduler"),
    ],
)
def test_bad_values_stop_start_up_naming_the_field(argv, field):
    r = subprocess.run([sys.executable, "-m", "router", *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    assert field in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        # Tracebacks: logging's check of the level, the listeners' bind, aiohttp's route parser.
        (["--log-level", "loud"], "log-level"),
        (["--port", "BUSY"], "address already in use"),
        (["--metrics-port", "BUSY"], "address already in use"),
        (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
        (["--base-path", "/{x"], "base-path"),
        # Its message was followed by asyncio's "Unclosed client session" lines.
        (["--tokenizer", "/no/such/tokenizer.json"], "cannot load tokenizer"),
        # Taken, and then no request ever carried it: every flow keyed by API key instead.
        (["--fairness-header", "x tenant"], "fairness-header"),
    ],
)
def test_start_up_errors_are_one_line(argv, needle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in argv]
        r = subprocess.run([sys.executable, "-m", "router", "--scheduler", "http://127.0.0.1:9",
                            "--port", "0", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    # One line says what stopped it, last: no traceback, nothing after it. Before it, at most
    # the warning that the (here unreachable) scheduler is, if its first worker-list refresh
    # failed before the listener did.
    assert r.returncode != 0 and lines and needle in lines[-1] and lines[-1].startswith("error"), r.stderr
    assert all(" WARNING router.scheduling: scheduler unreachable" in x for x in lines[:-1]), r.stderr


def test_api_keys_that_are_not_utf8_are_taken_as_their_bytes(tmp_path):
    """A key file byte that is not UTF-8 (or one in ROUTER_API_KEYS) stopped start-up with a
    traceback; a client sends such a key as those bytes (auth.bearer_token)."""
    key_file = tmp_path / "keys"
    key_file.write_bytes(b"# comment\nsk-\xff\n\n")
    assert load_api_keys(str(key_file), "k\udcfe, k2") == [b"k\xfe", b"k2", b"sk-\xff"]


def test_api_keys_from_the_environment_may_be_a_key_files_text():
    """A Kubernetes Secret's key file, handed to the gateway as ROUTER_API_KEYS (the chart's
    gateway.auth), is one key per line with '#' comments: each line is a key, as in
    --api-key-file, where the whole text had been taken as one key."""
    text = "# team a\nsk-a1\nsk-a2\n\n  # team b\nsk-b1, sk-b2\n"
    assert load_api_keys(None, text) == [b"sk-a1", b"sk-a2", b"sk-b1", b"sk-b2"]
    assert load_api_keys(None, "k1, k2,k3") == [b"k1", b"k2", b"k3"]


def test_config_file_from_the_environment(tmp_path, monkeypatch):
    """ROUTER_CONFIG was taken as the field's value and the file never read."""
    y = tmp_path / "gateway.yaml"
    y.write_text("scheduler: http://127.0.0.1:9000\n")
    monkeypatch.setenv("ROUTER_CONFIG", str(y))
    assert load_router_config([]).scheduler == "http://127.0.0.1:9000"


def test_scheduler_channel_from_flag_and_env(monkeypatch):
    assert load_router_config(["--scheduler", "http://x"]).scheduler_channel == "auto"
    cfg = load_router_config(["--scheduler", "http://x", "--scheduler-channel", "http"])
    assert cfg.scheduler_channel == "http"
    monkeypatch.setenv("ROUTER_SCHEDULER_CHANNEL", "ws")
    assert load_router_config(["--scheduler", "http://x"]).scheduler_channel == "ws"


def test_an_admin_token_from_a_secret_file_matches_without_its_newline_and_as_its_bytes():
    """A Secret made from a file (kubectl create secret --from-file) keeps the file's last
    newline in ROUTER_ADMIN_TOKEN: no Bearer header carries it, so every scrape got 401. A byte
    that is not UTF-8 in it was a traceback at start-up."""
    import os

    import httpx

    from tests.router.procs import free_port, wait_http

    port = free_port()
    env = {**os.environb, b"ROUTER_ADMIN_TOKEN": b"s3cret\xff\n"}
    p = subprocess.Popen([sys.executable, "-m", "router", "--workers", "http://127.0.0.1:9",
                          "--port", str(port)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_http(f"http://127.0.0.1:{port}/health", timeout_s=30)
        with httpx.Client() as client:
            assert client.get(url, headers={"Authorization": b"Bearer s3cret\xff"}).status_code == 200
            assert client.get(url, headers={"Authorization": b"Bearer s3cret"}).status_code == 401
            assert client.get(url).status_code == 401
    except Exception:
        p.kill()
        raise AssertionError(p.communicate(timeout=10)[0].decode(errors="replace")) from None
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("text", [b"", b"\n\n", b"# keys of team a\n  \n"])
def test_an_api_key_file_without_a_key_stops_start_up(tmp_path, text):
    """It ran the gateway with no keys at all, open to every client, without a word."""
    key_file = tmp_path / "keys"
    key_file.write_bytes(text)
    r = subprocess.run([sys.executable, "-m", "router", "--workers", "http://127.0.0.1:9", "--port", "0",
                        "--api-key-file", str(key_file)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and lines and lines[-1].startswith("error: api-key-file"), r.stderr
    assert "Traceback" not in r.stderr



@pytest.mark.parametrize("argv", [["--admin-token", "sekrit\r1"], ["--upstream-api-key", "sekrit\n1"],
                                  ["--config", "KEYS_AS_A_LIST"]])
def test_a_refused_secret_is_named_but_not_printed(argv, tmp_path):
    """The error line echoed the value (a YAML list of keys, a token with a stray control
    character), and start-up errors go to the logs."""
    config = tmp_path / "gateway.yaml"
    config.write_text("api_keys: [sekrit-1, sekrit-2]\n")
    argv = [str(config) if a == "KEYS_AS_A_LIST" else a for a in argv]
    r = subprocess.run([sys.executable, "-m", "router", "--scheduler", "http://x", *argv], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "sekrit" not in r.stderr, r.stderr
    assert lines[0].startswith("error: invalid value for ") and "(value hidden)" in lines[0]


def test_help_says_how_the_environment_sets_each_flag(monkeypatch):
    """--help listed the flags only: nothing said that ROUTER_* variables set them too."""
    r = subprocess.run([sys.executable, "-m", "router", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "ROUTER_MAX_QUEUE_SIZE" in r.stdout
    monkeypatch.setenv("ROUTER_MAX_QUEUE_SIZE", "7")  # and it is so
    assert load_router_config(["--scheduler", "http://x"]).max_queue_size == 7


def test_a_gateway_open_to_other_hosts_without_api_keys_says_so(tmp_path):
    """Listening beyond loopback with no API keys serves any client that reaches it: allowed (a
    proxy in front may authenticate), but said at start-up; on loopback, or with keys, not."""
    from tests.router.procs import start_echo_worker, start_gateway

    worker, wu = start_echo_worker()
    keys = tmp_path / "keys"
    keys.write_text("sk-1\n")
    try:
        for extra, warned in ((("--host", "0.0.0.0"), True), ((), False),
                              (("--host", "0.0.0.0", "--api-key-file", str(keys)), False)):
            g, _ = start_gateway("--workers", wu, *extra)  # it logs that before it serves /health
            try:
                out = g.output()
            finally:
                g.stop()
            assert ("no API keys" in out) == warned, (extra, out[-2000:])
    finally:
        worker.stop()
