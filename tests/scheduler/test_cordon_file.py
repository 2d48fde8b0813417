"""The cordon file (--cordon-file, scheduler/cordon_file.py): its format, reading back at start
(fail closed), atomic writes, and writes that fail or pile up. In process; the same across real
scheduler restarts (SIGTERM, SIGKILL): tests/scheduler/test_cordon_restart.py."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from scheduler import cordon_file
from scheduler.__main__ import serve
from scheduler.app import build_app
from scheduler.config import SchedulerConfig
from scheduler.cordon_file import VERSION, CordonFile, CordonFileError, decode, encode, write_atomic
from scheduler.cordons import MAX_REASON_CHARS, Cordon
from scheduler.policies import Request
from scheduler.service import SchedulerService
from tests.scheduler.helpers import make_service

TOKEN = "admin-3f9a"


class Count:
    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


def store(path: Path) -> CordonFile:
    return CordonFile(path, Count())


# ---- format and reading back ---------------------------------------------------------------


def test_a_set_written_reads_back_the_same_in_order(tmp_path):
    path = tmp_path / "cordons.json"
    now = time.time()
    cordons = {"10.0.0.5:8000": Cordon(now - 3600.25, "suspected bad GPU"),
               "w-b": Cordon(now, None), "a": Cordon(now - 1, "ticket 42 \u00e9")}
    write_atomic(path, encode(cordons))
    body = json.loads(path.read_text())
    assert body["version"] == VERSION == 1
    assert body["cordons"]["10.0.0.5:8000"]["since"].endswith("Z")  # wall clock, UTC, readable
    back = store(path).load()
    assert list(back) == list(cordons)  # the order they were made in
    for wid, c in cordons.items():
        assert back[wid].reason == c.reason
        assert back[wid].since == pytest.approx(c.since, abs=1e-6)
    assert decode(encode({})) == {}


@pytest.mark.parametrize("content", [None, b"", b"  \n"], ids=["missing", "empty", "blank"])
def test_a_missing_or_empty_file_is_no_cordon(tmp_path, content, caplog):
    path = tmp_path / "cordons.json"
    if content is not None:
        path.write_bytes(content)
    with caplog.at_level(logging.INFO, logger="scheduler.cordon_file"):
        assert store(path).load() == {}
    assert str(path) in caplog.text


@pytest.mark.parametrize(("content", "says"), [
    (b'{"version": 1, "cordons": {"w0": {"since": "2024-05-01T12:00', "not JSON"),
    (b"\xff\xfe\x00garbage", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"cordons": {}}', "version None"),
    (b'{"version": 2, "cordons": {}}', "version 2: this scheduler reads version 1"),
    (b'{"version": 1}', '"cordons" must be an object'),
    (b'{"version": 1, "cordons": {"w0": "yes"}}', "'w0'"),
    (b'{"version": 1, "cordons": {"w0": {"since": "yesterday"}}}', "'w0'"),
    (b'{"version": 1, "cordons": {"w0": {"since": 1714564800}}}', "since must be a UTC time"),
    (b'{"version": 1, "cordons": {"w0": {"since": "2024-05-01T12:00:00"}}}', "no time zone"),
    (b'{"version": 1, "cordons": {"w0": {"since": "2024-05-01T12:00:00Z", "reason": 5}}}', "reason"),
    (b"[" * 100_000, "not JSON"),
], ids=["truncated", "binary", "array", "no-version", "newer-version", "no-cordons", "entry",
        "bad-time", "number-time", "naive-time", "reason", "deep"])
def test_a_corrupt_file_stops_start_up_naming_it(tmp_path, content, says):
    path = tmp_path / "cordons.json"
    path.write_bytes(content)
    with pytest.raises(CordonFileError) as err:
        store(path).load()
    message = str(err.value)
    assert str(path) in message and says in message and "back in rotation" in message


def test_an_unreadable_file_or_a_missing_directory_stops_start_up(tmp_path):
    unreadable = tmp_path / "cordons.json"
    unreadable.mkdir()  # reading it fails (EISDIR), as a permission error would (root here)
    with pytest.raises(CordonFileError, match=f"{unreadable} cannot be read"):
        store(unreadable).load()
    nowhere = tmp_path / "no-such-dir" / "cordons.json"
    with pytest.raises(CordonFileError, match="no-such-dir does not exist"):
        store(nowhere).load()


def test_reasons_read_back_are_bounded_and_escaped_as_the_api_makes_them(tmp_path):
    path = tmp_path / "cordons.json"
    path.write_text(json.dumps({"version": 1, "cordons": {
        "w0": {"since": "2024-05-01T12:00:00+02:00", "reason": "x\nforged line" + "y" * 500}}}))
    [c] = store(path).load().values()
    assert c.since == 1714557600.0  # 10:00 UTC
    assert "\n" not in c.reason and len(c.reason) == MAX_REASON_CHARS


# ---- writing ------------------------------------------------------------------------------


def _temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("failing", ["fsync", "replace", "write"])
def test_a_failed_write_leaves_the_old_file_whole_and_no_temp_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "cordons.json"
    old = encode({"w0": Cordon(time.time(), "old")})
    write_atomic(path, old)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "write":  # the data itself does not fit
        monkeypatch.setattr(os, "fdopen", lambda fd, mode: _FullFile(fd))
    else:
        monkeypatch.setattr(os, failing, disk_full)
    with pytest.raises(OSError):
        write_atomic(path, encode({"w0": Cordon(time.time(), "new"), "w1": Cordon(time.time(), None)}))
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert _temp_files(tmp_path) == []


class _FullFile:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_temp_files_of_a_write_cut_short_are_removed_at_start(tmp_path):
    path = tmp_path / "cordons.json"
    stale = tmp_path / ".cordons.json.abc123.tmp"
    stale.write_text("{half")
    other = tmp_path / ".other.json.abc.tmp"  # not ours
    other.write_text("x")
    assert store(path).load() == {}
    assert not stale.exists() and other.exists()


async def test_a_failed_write_is_logged_counted_and_answered_false_and_the_next_writes_all(
        tmp_path, monkeypatch, caplog):
    path = tmp_path / "cordons.json"
    failures = Count()
    f = CordonFile(path, failures)
    real = cordon_file.write_atomic

    def read_only(p: Path, data: bytes) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cordon_file, "write_atomic", read_only)
    with caplog.at_level(logging.INFO, logger="scheduler.cordon_file"):
        assert await f.save({"w0": Cordon(1.0, None)}) is False
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and str(path) in errors[0].getMessage()
        assert "Read-only file system" in errors[0].getMessage()
        assert failures.value == 1 and not path.exists()
        monkeypatch.setattr(cordon_file, "write_atomic", real)
        assert await f.save({"w0": Cordon(1.0, None), "w1": Cordon(2.0, None)}) is True
    assert list(store(path).load()) == ["w0", "w1"]
    assert "written again" in caplog.text


async def test_writes_run_one_at_a_time_and_an_older_set_never_lands_after_a_newer_one(
        tmp_path, monkeypatch):
    """Changes made while a write is under way are written once after it, as the newest set."""
    path = tmp_path / "cordons.json"
    f = store(path)
    written: list[list[str]] = []
    running = threading.Semaphore(1)

    def slow_write(p: Path, data: bytes) -> None:
        assert running.acquire(blocking=False), "two writes at once"
        try:
            time.sleep(0.05)
            written.append(list(json.loads(data)["cordons"]))
            write_atomic(p, data)
        finally:
            running.release()

    monkeypatch.setattr(cordon_file, "write_atomic", slow_write)
    sets = [{f"w{j}": Cordon(float(j), None) for j in range(i + 1)} for i in range(8)]
    saves = []
    for s in sets:  # each change taken in order, while earlier ones are being written
        saves.append(asyncio.ensure_future(f.save(s)))
        await asyncio.sleep(0.01)
    assert await asyncio.gather(*saves) == [True] * 8
    assert written[-1] == list(sets[-1])
    assert [len(w) for w in written] == sorted({len(w) for w in written})  # only ever newer
    assert len(written) < len(sets)  # coalesced
    assert list(store(path).load()) == list(sets[-1])


async def test_a_caller_that_leaves_does_not_cancel_the_write_and_close_waits_for_it(
        tmp_path, monkeypatch):
    path = tmp_path / "cordons.json"
    f = store(path)
    real = cordon_file.write_atomic

    def slow_write(p: Path, data: bytes) -> None:
        time.sleep(0.1)
        real(p, data)

    monkeypatch.setattr(cordon_file, "write_atomic", slow_write)
    call = asyncio.ensure_future(f.save({"w0": Cordon(1.0, "x")}))
    await asyncio.sleep(0.01)
    call.cancel()  # the HTTP client went away (the scheduler cancels its handler)
    await f.close()
    assert list(store(path).load()) == ["w0"]


# ---- the service and its API --------------------------------------------------------------


def _svc(path: Path | None, **config) -> SchedulerService:
    return make_service(n=2, config={"admin_token": TOKEN,
                                     **({"cordon_file": str(path)} if path else {}), **config})


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def test_the_api_persists_each_change_and_a_new_scheduler_restores_it(tmp_path):
    path = tmp_path / "cordons.json"
    svc = _svc(path)
    assert svc.restore_cordons() == 0
    async with TestClient(TestServer(build_app(svc))) as c:
        r = await c.post("/v1/workers/w0/cordon", json={"reason": "bad GPU"}, headers=_auth())
        body = await r.json()
        assert r.status == 200 and body["persisted"] is True and body["cordoned"] is True
        since = body["cordoned_since"]
        r = await c.post("/v1/workers/w1/cordon", headers=_auth())
        assert (await r.json())["persisted"] is True
        r = await c.post("/v1/workers/w1/uncordon", headers=_auth())
        assert (await r.json())["persisted"] is True
    assert list(json.loads(path.read_text())["cordons"]) == ["w0"]

    again = _svc(path)  # the restarted scheduler
    assert again.restore_cordons() == 1
    view = {v["worker_id"]: v for v in again.workers_view()}
    assert view["w0"]["cordoned"] is True and view["w0"]["cordoned_since"] == since
    assert view["w0"]["cordon_reason"] == "bad GPU" and view["w1"]["cordoned"] is False
    for _ in range(4):
        out = again.decide(Request("m", 100, 16), time.monotonic())
        assert out["worker_id"] == "w1"
        again.release(out["lease_id"], ok=True)


async def test_a_failed_write_answers_persisted_false_and_the_cordon_holds(tmp_path, monkeypatch):
    path = tmp_path / "cordons.json"
    svc = _svc(path)

    def disk_full(p: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cordon_file, "write_atomic", disk_full)
    async with TestClient(TestServer(build_app(svc))) as c:
        body = await (await c.post("/v1/workers/w0/cordon", headers=_auth())).json()
        assert body["cordoned"] is True and body["changed"] is True and body["persisted"] is False
        assert "w0" in svc.cordons
        page = generate_latest(svc.metrics.registry).decode()
        assert "scheduler_cordon_file_write_failures_total 1.0" in page
        monkeypatch.undo()  # space freed: repeating the call writes the set
        body = await (await c.post("/v1/workers/w0/cordon", headers=_auth())).json()
        assert body["changed"] is False and body["persisted"] is True
    assert list(store(path).load()) == ["w0"]


async def test_without_a_cordon_file_persisted_is_null():
    svc = _svc(None)
    assert svc.cordon_file is None and svc.restore_cordons() == 0
    async with TestClient(TestServer(build_app(svc))) as c:
        body = await (await c.post("/v1/workers/w0/cordon", headers=_auth())).json()
    assert body["cordoned"] is True and body["persisted"] is None
    assert "scheduler_cordon_file_write_failures_total 0.0" in generate_latest(svc.metrics.registry).decode()


async def test_start_up_stops_on_a_corrupt_cordon_file_before_anything_runs(tmp_path):
    path = tmp_path / "cordons.json"
    path.write_text('{"version": 1, "cordons": {"w0": ')
    with pytest.raises(SystemExit) as stop:
        await serve(SchedulerConfig(cordon_file=str(path), port=0))
    assert str(stop.value).startswith("error: cordon file ") and str(path) in str(stop.value)


def test_the_flag_and_its_variable(monkeypatch, tmp_path):
    from scheduler.config import load_scheduler_config

    assert load_scheduler_config(["--cordon-file", "/var/lib/x/c.json"]).cordon_file == "/var/lib/x/c.json"
    monkeypatch.setenv("SCHEDULER_CORDON_FILE", "/data/cordons.json")
    assert load_scheduler_config([]).cordon_file == "/data/cordons.json"
    monkeypatch.setenv("SCHEDULER_CORDON_FILE", "")  # compose's ${VAR:-}: unset
    assert load_scheduler_config([]).cordon_file is None
    assert SchedulerConfig().cordon_file is None
