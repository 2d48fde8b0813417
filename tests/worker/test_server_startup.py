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
