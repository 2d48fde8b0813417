"""Start-up failures of `python -m inference_worker` end with one clear line, not a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.worker.conftest import REPO, SIM_AVAILABLE, SIM_SKIP_REASON

pytestmark = pytest.mark.slow


def run_worker(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "inference_worker", "--host", "127.0.0.1", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error:"), result.stderr
    for needle in needles:
        assert needle in last


def test_invalid_flag_value_names_the_field() -> None:
    assert_one_line_error(run_worker("--max-num-seqs", "0"), "max-num-seqs")


@pytest.mark.parametrize(
    ("flag", "url"), [("--register-with", "http://"), ("--advertise-url", "worker-0:8001")]
)
def test_unusable_registration_url_stops_start_up(flag, url) -> None:
    # Not a warning repeated every heartbeat for the life of the worker.
    assert_one_line_error(run_worker(flag, url), flag.removeprefix("--"), repr(url))


def test_unknown_model_is_one_line() -> None:
    assert_one_line_error(run_worker("--model", "/no/such/model/dir", "--port", "1"), "/no/such/model/dir")


@pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)
def test_unknown_sim_profile_is_one_line() -> None:
    assert_one_line_error(
        run_worker("--backend", "sim", "--sim-profile", "no-such-profile"), "no-such-profile"
    )


@pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)
def test_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_worker("--backend", "sim", "--sim-profile", "tiny", "--port", str(port))
    assert_one_line_error(result, "cannot listen", str(port))


@pytest.mark.parametrize(
    ("flag", "url"),
    # The scheduler refuses these (scheduler/urls.py): warned about at every registration.
    [("--advertise-url", "http://worker-0:8001/?x=1"), ("--register-with", "http://u:p@scheduler:8090")],
)
def test_registration_urls_the_scheduler_refuses_stop_start_up(flag, url) -> None:
    assert_one_line_error(run_worker(flag, url), flag.removeprefix("--"), repr(url))


def test_infinite_time_scale_is_refused() -> None:
    # Taken before: the engine clock (monotonic / time_scale) stood still.
    assert_one_line_error(run_worker("--backend", "sim", "--time-scale", "inf"), "time-scale")


def test_infinite_stats_interval_is_refused() -> None:
    # Taken before: the stats line never came.
    assert_one_line_error(run_worker("--log-stats-interval", "inf"), "log-stats-interval")


@pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)
@pytest.mark.parametrize(
    ("content", "needle"),
    # YAML's error spans lines; a file that is not UTF-8 was named by its codec, not its path.
    [(b"name: x\n  bad: : indent\n", "not valid YAML"), (b"\xff\xfe name: x\n", "not UTF-8")],
)
def test_unreadable_sim_profile_file_is_one_line(tmp_path, content, needle) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_bytes(content)
    result = run_worker("--backend", "sim", "--sim-profile", str(profile), "--port", "1")
    assert_one_line_error(result, needle, str(profile))
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_config_file_from_the_environment(tmp_path) -> None:
    """WORKER_CONFIG was taken as the field's value and the file never read."""
    env = {**os.environ, "WORKER_CONFIG": str(tmp_path / "missing.yaml")}
    result = subprocess.run([sys.executable, "-m", "inference_worker"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "cannot read config file", "missing.yaml")


def test_a_refused_registration_token_is_named_but_not_printed() -> None:
    # The error line echoed the token, and start-up errors go to the logs.
    result = run_worker("--registration-token", "sekrit\n1")
    assert_one_line_error(result, "registration-token")
    assert "sekrit" not in result.stderr


def test_help_says_how_the_environment_sets_each_flag(monkeypatch) -> None:
    # --help listed the flags only: nothing said that WORKER_* variables set them too.
    from inference_worker.config import load_worker_config

    result = run_worker("--help")
    assert result.returncode == 0 and "WORKER_MAX_NUM_SEQS" in result.stdout
    monkeypatch.setenv("WORKER_MAX_NUM_SEQS", "8")  # and it is so
    assert load_worker_config([]).max_num_seqs == 8
