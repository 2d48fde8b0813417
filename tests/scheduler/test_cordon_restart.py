"""Cordons across scheduler restarts (--cordon-file, scheduler/cordon_file.py), with real
processes on 127.0.0.1: two sim workers and a scheduler with --admin-token and --cordon-file.
An operator cordons a worker over the HTTP API; the scheduler is stopped (SIGTERM) or killed
(SIGKILL, right after the answer) and started again with the same file: the worker is still
cordoned from its first answer on, with its first time and reason, and no decision places a
request there; an uncordon survives a restart too. A corrupt file stops start-up."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.procs import Proc, free_port, start_scheduler, start_sim_workers, wait_http

TOKEN = "admin-token-8e41"


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    started = start_sim_workers(2, "m")
    try:
        yield [url for _, url in started]
    finally:
        for p, _ in started:
            p.stop()


def _scheduler(urls: list[str], path: Path) -> tuple[Proc, str]:
    # round_robin: requests one after the other take turns on every candidate, so a worker
    # that gets none of them was kept out (llm_aware sends them all to the same idle one).
    return start_scheduler(urls, "--scrape-interval-ms", "100", "--policy", "round_robin",
                           "--admin-token", TOKEN, "--cordon-file", str(path))


def _listing(su: str) -> dict:
    return httpx.get(su + "/v1/workers", timeout=5).json()


def _admin(su: str, worker_id: str, action: str, **body) -> dict:
    r = httpx.post(f"{su}/v1/workers/{worker_id}/{action}", json=body or None,
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _placed(su: str, n: int) -> set[str]:
    """Where n requests are placed, one after the other (each released before the next); held
    by the scheduler until a worker is in rotation (a restarted one scrapes them first)."""
    seen = set()
    for _ in range(n):
        r = httpx.post(su + "/v1/schedule", json={"model": "m", "prompt_tokens": 16, "max_tokens": 8,
                                                  "wait_ms": 10_000}, timeout=15)
        assert r.status_code == 200, r.text
        seen.add(r.json()["worker_id"])
        assert httpx.post(su + "/v1/release", json={"lease_id": r.json()["lease_id"], "ok": True},
                          timeout=5).status_code == 204
    return seen


def _stop(proc: Proc, sig: int) -> str:
    proc.kill(sig)
    out = proc.output()
    proc.stop()  # its log file
    return out


def test_cordons_survive_a_stop_and_a_kill_and_so_does_an_uncordon(workers, tmp_path):
    path = tmp_path / "cordons.json"
    s, su = _scheduler(workers, path)
    ids = sorted(w["worker_id"] for w in _listing(su)["workers"])
    assert len(ids) == 2 and _placed(su, 6) == set(ids)
    bad, good = ids
    first = _admin(su, bad, "cordon", reason="suspected bad GPU")
    assert first["changed"] is True and first["persisted"] is True
    assert json.loads(path.read_text())["version"] == 1

    # Stopped (SIGTERM), started again with the same file.
    assert f"cordon file {path} does not exist yet" in _stop(s, signal.SIGTERM)
    assert s.p.returncode == 0
    s, su = _scheduler(workers, path)
    listed = _listing(su)  # its first answer: restored before it served
    assert list(listed["cordons"]) == [bad]
    assert listed["cordons"][bad] == {"since": first["cordoned_since"], "reason": "suspected bad GPU"}
    view = {w["worker_id"]: w for w in listed["workers"]}
    assert view[bad]["cordoned"] is True and view[bad]["cordoned_since"] == first["cordoned_since"]
    assert view[good]["cordoned"] is False
    assert _placed(su, 6) == {good}
    assert f"restored 1 cordon(s) from {path}: {bad}" in s.output()

    # Changed, then killed (SIGKILL) at once after the answers: the file has the last set.
    assert _admin(su, bad, "uncordon")["persisted"] is True
    assert _admin(su, good, "cordon", reason="canary")["persisted"] is True
    _stop(s, signal.SIGKILL)
    s, su = _scheduler(workers, path)
    listed = _listing(su)
    assert list(listed["cordons"]) == [good] and listed["cordons"][good]["reason"] == "canary"
    assert _placed(su, 6) == {bad}

    # An uncordon is kept too: the file holds none, and a scheduler started on it has none.
    assert _admin(su, good, "uncordon")["persisted"] is True
    _stop(s, signal.SIGTERM)
    assert json.loads(path.read_text()) == {"version": 1, "cordons": {}}
    s, su = _scheduler(workers, path)
    try:
        assert _listing(su)["cordons"] == {}
        assert _placed(su, 8) == set(ids)
    finally:
        s.stop()


def test_a_corrupt_cordon_file_stops_start_up_with_the_file_named(workers, tmp_path):
    """Fail closed: started without its cordons, the workers it holds would take traffic."""
    path = tmp_path / "cordons.json"
    path.write_text('{"version": 1, "cordons": {"10.0.0.5:8000": {"since": "2024-05-')
    port = free_port()
    p = Proc(["-m", "scheduler", "--port", str(port), "--workers", ",".join(workers),
              "--cordon-file", str(path)], f"scheduler-{port}")
    try:
        assert p.p.wait(60) != 0
        out = p.output()
        assert f"error: cordon file {path} is not a cordon file" in out and "Traceback" not in out
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        p.stop()
    # An empty one is no cordon: it starts.
    path.write_text("")
    s, su = _scheduler(workers, path)
    try:
        wait_http(su + "/health", s)
        assert _listing(su)["cordons"] == {}
    finally:
        s.stop()
