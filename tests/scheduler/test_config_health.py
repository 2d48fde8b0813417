"""Configuration (CLI, SCHEDULER_* env, YAML, one-line errors) and the health state machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from scheduler.config import load_scheduler_config
from scheduler.health import DOWN, HALF_OPEN, UP, Health
from tests.scheduler.procs import ROOT


def test_cli_env_yaml_precedence(tmp_path, monkeypatch):
    cfg_file = tmp_path / "scheduler.yaml"
    cfg_file.write_text("scrape_interval_ms: 250\npolicy: least_request\nworkers: [http://a:1, http://b:2]\n"
                        "policy_params: {}\n")
    cfg = load_scheduler_config(["--config", str(cfg_file)])
    assert (cfg.scrape_interval_ms, cfg.policy, cfg.worker_urls) == (250, "least_request", ["http://a:1", "http://b:2"])
    monkeypatch.setenv("SCHEDULER_SCRAPE_INTERVAL_MS", "300")
    assert load_scheduler_config(["--config", str(cfg_file)]).scrape_interval_ms == 300  # env > YAML
    cfg = load_scheduler_config(["--config", str(cfg_file), "--scrape-interval-ms", "50"])
    assert cfg.scrape_interval_ms == 50  # CLI > env


def test_policy_params_from_yaml(tmp_path):
    cfg_file = tmp_path / "s.yaml"
    cfg_file.write_text("policy: llm_aware\npolicy_params: {max_waiting: 3, w_kv: 2.5}\n")
    cfg = load_scheduler_config(["--config", str(cfg_file)])
    assert cfg.policy_params == {"max_waiting": 3, "w_kv": 2.5}


def test_params_by_policy_apply_to_the_chosen_policy_only(tmp_path, monkeypatch):
    """A deployment keeps llm_aware's tuned knobs in its config and can still switch policy."""
    cfg_file = tmp_path / "s.yaml"
    cfg_file.write_text("params_by_policy:\n  llm_aware: {max_prefill_backlog: 1024, w_prefix: 4}\n"
                        "  prefix_affinity: {}\n")
    cfg = load_scheduler_config(["--config", str(cfg_file)])  # llm_aware is the default policy
    assert cfg.effective_policy_params == {"max_prefill_backlog": 1024, "w_prefix": 4}
    assert load_scheduler_config(["--config", str(cfg_file), "--policy", "least_request"]
                                 ).effective_policy_params == {}
    # policy_params, flat, still applies on top (an operator's one-off override).
    cfg = load_scheduler_config(["--config", str(cfg_file), "--policy-params", '{"w_prefix": 8}'])
    assert cfg.effective_policy_params == {"max_prefill_backlog": 1024, "w_prefix": 8}
    # As compose passes it: JSON in SCHEDULER_PARAMS_BY_POLICY.
    monkeypatch.setenv("SCHEDULER_PARAMS_BY_POLICY", '{"llm_aware": {"max_prefill_backlog": 512}}')
    assert load_scheduler_config([]).effective_policy_params == {"max_prefill_backlog": 512}


@pytest.mark.parametrize(("args", "field"), [
    (["--scrape-interval-ms", "fast"], "scrape-interval-ms"),
    (["--policy", "best"], "policy"),
    (["--policy-params", '{"w_nonsense": 1}'], "policy-params"),
    (["--policy-params", '{"hold_when_saturated": "ture"}'], "policy-params"),  # not taken as false
    (["--policy-params", '{"w_prefix": Infinity}'], "policy-params"),  # inf x 0 would be a NaN score
    # Entries of policies not in use are checked too: a typo surfaces at start-up, not at a switch.
    (["--policy", "round_robin", "--params-by-policy", '{"llm_aware": {"w_nonsense": 1}}'],
     "params-by-policy"),
    (["--params-by-policy", '{"best": {}}'], "params-by-policy"),
    (["--workers", "127.0.0.1:8101"], "workers"),
    (["--registration-token", "t\n1"], "registration-token"),  # no worker could send it
    (["--registration-allowed-networks", "10.0.0.0/8,10.0.0.300/32"], "registration-allowed-networks"),
])
def test_invalid_value_is_one_line_naming_the_field(args, field):
    proc = subprocess.run([sys.executable, "-m", "scheduler", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: invalid value for {field}"), proc.stderr


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--policy-params", "[1]"], {}, "policy_params"),  # JSON-valued flags that do not parse
    ([], {"SCHEDULER_WORKER_MAX_RUNNING": "not json"}, "worker_max_running"),
    # From the environment the line also says what is wrong, not only which field.
    ([], {"SCHEDULER_POLICY_PARAMS": "{bad"}, "policy_params\" from source \"EnvSettingsSource\": "
                                              "Expecting property name"),
    (["--config", "BROKEN_YAML"], {}, "cannot read config file"),  # its parser's error spans lines
])
def test_unparseable_values_are_one_line_too(tmp_path, args, env, needle):
    broken = tmp_path / "broken.yaml"
    broken.write_text("policy: {{{\n")
    args = [str(broken) if a == "BROKEN_YAML" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "scheduler", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "needle"), [
    # Each was a traceback: logging's own check of the level, and the listener's bind.
    (["--log-level", "loud"], "log-level"),
    (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
    (["--port", "BUSY"], "address already in use"),
    # Taken, then useless: an infinite TTL was answered to registrations as `Infinity` (no
    # JSON); an API server URL that is none failed every watch, retried for ever.
    (["--registration-ttl-s", "inf"], "registration-ttl-s"),
    (["--k8s-namespace", "n", "--k8s-label-selector", "a=b", "--k8s-api-server", "api:443"],
     "k8s-api-server"),
])
def test_start_up_errors_are_one_line(args, needle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in args]
        proc = subprocess.run([sys.executable, "-m", "scheduler", "--port", "0", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert needle in _one_line_error(proc)


@pytest.mark.parametrize(("content", "needle"), [
    (b"\xff\xfe policy: x\n", "cannot read config file"),  # a UnicodeDecodeError traceback
    (b"{1: 2}\n", "got the key 1"),  # an AttributeError traceback
])
def test_config_files_that_are_no_mapping_of_names_are_one_line(tmp_path, content, needle):
    cfg_file = tmp_path / "s.yaml"
    cfg_file.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "scheduler", "--config", str(cfg_file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert needle in _one_line_error(proc)


def test_config_file_from_the_environment(tmp_path, monkeypatch):
    """SCHEDULER_CONFIG was taken as the field's value and the file never read."""
    cfg_file = tmp_path / "s.yaml"
    cfg_file.write_text("scrape_interval_ms: 250\n")
    monkeypatch.setenv("SCHEDULER_CONFIG", str(cfg_file))
    assert load_scheduler_config([]).scrape_interval_ms == 250
    monkeypatch.setenv("SCHEDULER_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(SystemExit, match="cannot read config file"):
        load_scheduler_config([])


def test_busy_is_not_dead_but_refused_connections_are():
    h = Health()
    assert h.on_success(0.0, 2) and h.state == UP
    for _ in range(10):  # timeouts under load: never evict on their own
        h.on_failure("timeout", fail_streak=3, connection_level=False)
    assert h.state == UP
    h.on_failure("refused", 3, True)
    h.on_failure("refused", 3, True)
    assert h.state == UP
    assert h.on_failure("refused", 3, True) and h.state == DOWN


def test_silence_evicts_after_dead_after():
    h = Health()
    h.on_success(0.0, 2)
    assert not h.check_silence(5.0, dead_after_s=10.0)
    assert h.check_silence(10.5, dead_after_s=10.0) and h.state == DOWN


def test_recovery_needs_a_streak_then_a_trial():
    h = Health()
    h.on_success(0.0, 2)
    h.force_down("gateway: connect")
    assert h.state == DOWN
    h.on_success(1.0, 2)
    assert h.state == DOWN
    h.on_failure("refused", 3, True)  # a failure resets the streak
    h.on_success(1.2, 2)
    assert h.state == DOWN
    h.on_success(1.3, 2)
    assert h.state == HALF_OPEN
    assert h.trial_result(True) and h.state == UP


def test_never_reached_worker_comes_up_on_first_success():
    h = Health()
    for _ in range(3):
        h.on_failure("refused", 3, True)
    assert h.state == DOWN
    assert h.on_success(1.0, 2) and h.state == UP  # e.g. started after the scheduler
    assert h.last_error is None


def test_a_worker_back_up_shows_no_error():
    """A worker killed and restarted was logged "is up (ClientConnectorError)" and shown in
    /v1/workers as up with that error. While it is down or on trial, the error says why."""
    h = Health()
    h.on_success(0.0, 2)
    h.force_down("gateway: connection")
    for _ in range(3):
        h.on_failure("ClientConnectorError", 3, True)
    h.on_success(1.0, 2)
    h.on_success(1.1, 2)
    assert h.state == HALF_OPEN and h.last_error == "ClientConnectorError"
    assert h.trial_result(True) and h.state == UP
    assert h.last_error is None


def test_a_registration_token_from_a_secret_file_matches_without_its_newline(monkeypatch):
    """A Secret made from a file keeps its last newline: the token was compared with it, and
    every registration (whose header cannot carry a newline) was refused 401."""
    from scheduler.discovery.registration import check_token
    from tests.scheduler.helpers import make_service

    monkeypatch.setenv("SCHEDULER_REGISTRATION_TOKEN", "s3cret\n")
    cfg = load_scheduler_config([])
    svc = make_service(n=0, config={"registration_token": cfg.registration_token})
    check_token(svc, "Bearer s3cret")  # raises when refused


def test_a_refused_registration_token_is_named_but_not_printed():
    """The error line echoed the token, and start-up errors go to the logs."""
    proc = subprocess.run([sys.executable, "-m", "scheduler", "--registration-token", "sekrit\n1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "registration-token" in proc.stderr, proc.stderr
    assert "sekrit" not in proc.stderr


def test_a_check_across_fields_does_not_print_every_value_given():
    """Its error's input is every value given, which the line echoed, a token with it."""
    with pytest.raises(SystemExit) as info:
        load_scheduler_config(["--k8s-namespace", "ns", "--registration-token", "sekrit"])
    assert "k8s_namespace and k8s_label_selector go together" in str(info.value)
    assert "sekrit" not in str(info.value)


def test_help_says_how_the_environment_sets_each_flag(monkeypatch):
    """--help listed the flags only: nothing said that SCHEDULER_* variables set them too."""
    proc = subprocess.run([sys.executable, "-m", "scheduler", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "SCHEDULER_SCRAPE_INTERVAL_MS" in proc.stdout
    monkeypatch.setenv("SCHEDULER_SCRAPE_INTERVAL_MS", "250")  # and it is so
    assert load_scheduler_config([]).scrape_interval_ms == 250
