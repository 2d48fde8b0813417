"""Admin-token rotation without a restart: a real scheduler process on 127.0.0.1 re-reads
--admin-token-file when it changes (a new file renamed over it, a Kubernetes Secret volume's
`..data` symlink swap) and on SIGHUP. The old token gets 401 and the new one works within the
poll period; a file emptied, removed or holding no token keeps the token in force and logs an
ERROR. /metrics counts the re-reads and says whether the last one failed (what the alert
LLMSchedulerAdminTokenFileUnreadable reads). Its one static worker is never started: the admin
calls need a known worker id only."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.procs import REPO, Proc, free_port, wait_http
from tests.router.test_key_rotation import POLL_S, SecretVolume, replace_file, until

OLD, NEW, NEWER = "admin-old-1a2b", "admin-new-3c4d", "admin-newer-5e6f"
READ_OK = "scheduler_admin_token_file_last_read_ok"


@pytest.fixture
def schedulers() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for p in procs:
        p.stop()


def scheduler(procs: list[Proc], token_file: Path, *extra: str) -> tuple[Proc, str, str]:
    """A scheduler whose admin token comes from `token_file`: the process, its URL and its
    worker's id."""
    port, worker_port = free_port(), free_port()
    p = Proc(["-m", "scheduler", "--port", str(port), "--workers", f"http://127.0.0.1:{worker_port}",
              "--admin-token-file", str(token_file), *extra], f"scheduler-{port}")
    procs.append(p)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", p)
    return p, url, f"127.0.0.1:{worker_port}"


def token_metrics(url: str) -> dict[str, float]:
    """The admin-token-file series of the scheduler's /metrics, by name and labels as written."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                   if line.startswith("scheduler_admin_token_"))}


def reloads(url: str) -> dict[str, float]:
    """scheduler_admin_token_reloads_total by result."""
    series = token_metrics(url)
    return {result: series[f'scheduler_admin_token_reloads_total{{result="{result}"}}']
            for result in ("reloaded", "unchanged", "failed")}


def cordon(url: str, worker_id: str, token: str) -> int:
    """A cordon then an uncordon with `token`: 200 when the token is in force, else 401 (or 403
    with none in force)."""
    headers = {"Authorization": f"Bearer {token}"}
    r = httpx.post(f"{url}/v1/workers/{worker_id}/cordon", headers=headers, timeout=10)
    if r.status_code == 200:
        r = httpx.post(f"{url}/v1/workers/{worker_id}/uncordon", headers=headers, timeout=10)
    return r.status_code


def test_a_token_file_renamed_over_takes_effect_without_a_restart(schedulers, tmp_path):
    token_file = tmp_path / "admin-token"
    token_file.write_text(OLD + "\n")  # as a Secret made from a file holds it
    p, url, wid = scheduler(schedulers, token_file, "--admin-token-reload-s", str(POLL_S))
    assert cordon(url, wid, OLD) == 200 and cordon(url, wid, NEW) == 401
    assert token_metrics(url)[READ_OK] == 1  # start-up's read is no re-read
    assert reloads(url) == {"reloaded": 0, "unchanged": 0, "failed": 0}

    replace_file(token_file, NEW + "\n")
    until(lambda: cordon(url, wid, OLD) == 401)
    assert cordon(url, wid, NEW) == 200
    assert "admin-token-file reloaded (file changed): a new admin token" in p.output()
    assert token_metrics(url)[READ_OK] == 1
    assert reloads(url) == {"reloaded": 1, "unchanged": 0, "failed": 0}

    # Empty (a Secret emptied by mistake, a file truncated before its write): the token stays.
    replace_file(token_file, "")
    until(lambda: "admin-token-file re-read (file changed) failed" in p.output())
    assert cordon(url, wid, NEW) == 200 and cordon(url, wid, OLD) == 401
    assert token_metrics(url)[READ_OK] == 0  # what the alert reads
    assert reloads(url) == {"reloaded": 1, "unchanged": 0, "failed": 1}
    # Removed, or holding two lines: the same.
    token_file.unlink()
    until(lambda: "cannot read --admin-token-file" in p.output())
    replace_file(token_file, "two\nlines\n")
    until(lambda: "holds no token" in p.output())
    assert cordon(url, wid, NEW) == 200
    out = p.output()
    assert out.count("ERROR scheduler.admin: admin-token-file re-read") == 3
    assert "the admin token in force is kept" in out
    assert token_metrics(url)[READ_OK] == 0
    assert reloads(url)["failed"] == 3  # one for each change of the file, not for each poll

    # A good file again: in force.
    replace_file(token_file, NEWER)
    until(lambda: cordon(url, wid, NEWER) == 200)
    assert cordon(url, wid, NEW) == 401
    assert token_metrics(url)[READ_OK] == 1
    assert reloads(url) == {"reloaded": 2, "unchanged": 0, "failed": 3}
    out = p.output()
    assert not any(t in out for t in (OLD, NEW, NEWER)) and "Traceback" not in out  # never logged


def test_a_kubernetes_secret_update_and_sighup(schedulers, tmp_path):
    """The kubelet swaps `..data`; the mounted path's own entry stays as it was. With no polling
    (0), SIGHUP re-reads at once, and does not end the scheduler (it has no TLS files)."""
    volume = SecretVolume(tmp_path, "admin-token")
    volume.write(OLD)
    p, url, wid = scheduler(schedulers, volume.path, "--admin-token-reload-s", str(POLL_S))
    assert cordon(url, wid, OLD) == 200
    volume.write(NEW)
    until(lambda: cordon(url, wid, NEW) == 200)
    assert cordon(url, wid, OLD) == 401

    token_file = tmp_path / "plain-token"
    token_file.write_text(OLD)
    p, url, wid = scheduler(schedulers, token_file, "--admin-token-reload-s", "0")
    replace_file(token_file, NEW)
    p.p.send_signal(signal.SIGHUP)
    until(lambda: "admin-token-file reloaded (SIGHUP)" in p.output())
    assert cordon(url, wid, NEW) == 200 and cordon(url, wid, OLD) == 401
    p.p.send_signal(signal.SIGHUP)
    until(lambda: "admin-token-file re-read (SIGHUP): unchanged" in p.output())
    assert p.alive()
    assert reloads(url) == {"reloaded": 1, "unchanged": 1, "failed": 0}


def test_a_missing_file_at_start_is_no_token_until_one_appears(schedulers, tmp_path):
    """A Secret volume without the optional key: the admin calls are refused (403, fail closed)
    until the key is set."""
    token_file = tmp_path / "admin-token"
    p, url, wid = scheduler(schedulers, token_file, "--admin-token-reload-s", str(POLL_S))
    assert cordon(url, wid, OLD) == 403
    assert "is missing: the admin calls (cordon, uncordon) are refused until it holds a token" in p.output()
    # No token yet, not a failure: a Secret whose optional key is not set must not alert.
    assert token_metrics(url)[READ_OK] == 1
    assert reloads(url) == {"reloaded": 0, "unchanged": 0, "failed": 0}
    replace_file(token_file, OLD)
    until(lambda: cordon(url, wid, OLD) == 200)
    assert reloads(url) == {"reloaded": 1, "unchanged": 0, "failed": 0}


def test_without_a_token_file_no_series(schedulers):
    """As the gateway's key-file series: exported only with a file, so that a scheduler given
    its token inline (or none) neither alerts nor looks like one whose file reads fine."""
    port = free_port()
    p = Proc(["-m", "scheduler", "--port", str(port), "--admin-token", OLD], f"scheduler-{port}")
    schedulers.append(p)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", p)
    assert "scheduler_decisions_total" in httpx.get(url + "/metrics", timeout=10).text
    assert token_metrics(url) == {}


def _start_fails(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "scheduler", "--port", str(free_port()), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out.stdout + out.stderr
    return out.stderr


def test_start_up_refuses_both_options_and_a_file_that_holds_no_token(tmp_path):
    token_file = tmp_path / "admin-token"
    token_file.write_text(OLD)
    err = _start_fails("--admin-token", NEW, "--admin-token-file", str(token_file))
    assert "admin_token and admin_token_file exclude each other" in err and NEW not in err
    token_file.write_text("two\nlines\n")
    err = _start_fails("--admin-token-file", str(token_file))
    assert f"error: --admin-token-file {token_file} holds no token" in err and "lines" not in err
