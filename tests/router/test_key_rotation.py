"""API-key rotation without a restart: a real gateway process over 127.0.0.1 in front of an echo
worker re-reads --api-key-file when it changes (a new file renamed over it, a Kubernetes Secret
volume's `..data` symlink swap) and on SIGHUP. A file that cannot be read or holds no key keeps
the keys in force, and a stream accepted under a key removed meanwhile finishes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.router.procs import Proc, series_value, start_echo_worker, start_gateway

POLL_S = 0.2
# Within a poll period a changed file is in force; the margin is for a loaded CI machine.
WITHIN_S = POLL_S + 5.0
BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    # 40 ms between tokens: a stream of 50 tokens takes 2 s, long enough to rotate meanwhile.
    p, url = start_echo_worker(token_delay_ms=40)
    try:
        yield url
    finally:
        p.stop()


@pytest.fixture
def gateways() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for p in procs:
        p.stop()


def gateway(procs: list[Proc], worker: str, key_file: Path, *extra: str) -> str:
    p, url = start_gateway("--workers", worker, "--api-key-file", str(key_file), *extra)
    procs.append(p)
    return url


def status(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(url + "/v1/completions", json=BODY, timeout=10, headers=headers).status_code


def until(cond: Callable[[], bool], within_s: float = WITHIN_S) -> float:
    """Seconds until `cond` holds; the test fails past `within_s`."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < within_s, f"not within {within_s:.1f} s"
        time.sleep(0.05)
    return time.monotonic() - start


def replace_file(path: Path, text: str) -> None:
    """As an operator's tooling rotates a file: written beside it, renamed over it."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


class SecretVolume:
    """A Kubernetes Secret volume as the kubelet writes it: `<key>` -> `..data/<key>`, `..data`
    -> a timestamped directory; an update writes a new directory and swaps `..data`."""

    def __init__(self, root: Path, key: str) -> None:
        self.root, self.key, self.n = root, key, 0

    @property
    def path(self) -> Path:
        return self.root / self.key

    def write(self, text: str) -> None:
        self.n += 1
        new = self.root / f"..2024_01_01_00_00_{self.n:02d}.000000001"
        new.mkdir()
        (new / self.key).write_text(text)
        data = self.root / "..data"
        old = data.resolve() if data.is_symlink() else None
        (self.root / "..data_tmp").symlink_to(new.name)
        os.replace(self.root / "..data_tmp", data)
        if not self.path.is_symlink():
            self.path.symlink_to(f"..data/{self.key}")
        if old is not None:
            (old / self.key).unlink()
            old.rmdir()


def reloads(url: str, result: str) -> float:
    return series_value(url, f'router_api_key_reloads_total{{result="{result}"}}')


def test_a_key_file_renamed_over_takes_effect_without_a_restart(worker, gateways, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# tenants\nsk-old-1\nsk-keep-2\n")
    url = gateway(gateways, worker, key_file, "--api-key-reload-s", str(POLL_S),
                  "--api-keys", "sk-inline-9")
    assert status(url, "sk-old-1") == status(url, "sk-keep-2") == status(url, "sk-inline-9") == 200
    assert status(url, "sk-new-3") == 401
    assert series_value(url, "router_api_keys_loaded") == 3

    # The leaked key is revoked and a tenant added; commas as a Secret's text may have them.
    replace_file(key_file, "sk-keep-2, sk-new-3\n")
    until(lambda: status(url, "sk-new-3") == 200)
    assert status(url, "sk-old-1") == 401
    # The inline key stays accepted beside the file's; the other file key too.
    assert status(url, "sk-keep-2") == status(url, "sk-inline-9") == 200
    assert series_value(url, "router_api_keys_loaded") == 3
    assert reloads(url, "reloaded") == 1 and reloads(url, "failed") == 0
    [proc] = gateways
    assert proc.alive()
    log = proc.output()
    assert "api-key-file reloaded (file changed): 2 key(s)" in log, log[-2000:]
    assert "sk-" not in log  # never a key in the log

    # The same keys written again (a kubelet resync, a touch): no reload.
    replace_file(key_file, "sk-keep-2, sk-new-3\n")
    until(lambda: reloads(url, "unchanged") == 1)
    assert reloads(url, "reloaded") == 1


def test_a_kubernetes_secret_volume_update_is_seen(worker, gateways, tmp_path):
    volume = SecretVolume(tmp_path, "api-keys")
    volume.write("sk-old-1\n")
    url = gateway(gateways, worker, volume.path, "--api-key-reload-s", str(POLL_S))
    assert status(url, "sk-old-1") == 200 and status(url, "sk-new-2") == 401

    volume.write("sk-new-2\n")  # the mounted path's own symlink is untouched
    until(lambda: status(url, "sk-old-1") == 401)
    assert status(url, "sk-new-2") == 200
    volume.write("sk-new-2\nsk-new-3\n")
    until(lambda: status(url, "sk-new-3") == 200)
    assert status(url, "sk-new-2") == 200 and reloads(url, "reloaded") == 2


def test_sighup_reloads_at_once(worker, gateways, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("sk-old-1\n")
    url = gateway(gateways, worker, key_file, "--api-key-reload-s", "0")  # no polling
    [proc] = gateways
    replace_file(key_file, "sk-new-2\n")
    time.sleep(1.0)
    assert status(url, "sk-old-1") == 200 and status(url, "sk-new-2") == 401  # not polled

    os.kill(proc.pid, signal.SIGHUP)
    assert until(lambda: status(url, "sk-new-2") == 200, within_s=3.0) < 3.0
    assert status(url, "sk-old-1") == 401 and proc.alive()
    # A SIGHUP with nothing changed says so, and changes nothing.
    os.kill(proc.pid, signal.SIGHUP)
    until(lambda: reloads(url, "unchanged") == 1, within_s=3.0)
    assert status(url, "sk-new-2") == 200 and proc.alive()
    assert "api-key-file re-read (SIGHUP): unchanged, 1 key(s) in force" in proc.output()


def test_a_file_unreadable_or_without_a_key_keeps_the_keys_in_force(worker, gateways, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("sk-old-1\n")
    url = gateway(gateways, worker, key_file, "--api-key-reload-s", str(POLL_S))
    [proc] = gateways
    failed = 0

    def still_the_old_keys() -> None:
        nonlocal failed
        failed += 1
        until(lambda: reloads(url, "failed") == failed)  # seen, and refused
        assert status(url, "sk-old-1") == 200  # not locked out
        assert status(url, None) == 401 and status(url, "anything") == 401  # not opened
        assert series_value(url, "router_api_keys_loaded") == 1
        assert series_value(url, "router_api_key_file_last_read_ok") == 0  # what alerts read

    assert series_value(url, "router_api_key_file_last_read_ok") == 1
    replace_file(key_file, "")  # empty
    still_the_old_keys()
    replace_file(key_file, "# keys go here\n\n")  # comments only
    still_the_old_keys()
    key_file.unlink()  # gone (a mount gone)
    still_the_old_keys()
    key_file.mkdir()  # not a file
    still_the_old_keys()
    key_file.rmdir()
    key_file.symlink_to(tmp_path / "nowhere")  # a dangling symlink (a swap half done)
    still_the_old_keys()
    log = proc.output()
    assert log.count("ERROR") >= failed and "the 1 key(s) in force are kept" in log, log[-3000:]
    # A SIGHUP on a bad file says so again, and keeps the keys too.
    os.kill(proc.pid, signal.SIGHUP)
    still_the_old_keys()
    assert proc.alive()

    # Fixed: the good file is taken.
    replace_file(key_file, "sk-new-2\n")
    until(lambda: status(url, "sk-new-2") == 200)
    assert status(url, "sk-old-1") == 401
    assert series_value(url, "router_api_key_file_last_read_ok") == 1


def test_a_stream_in_flight_under_a_removed_key_finishes(worker, gateways, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("sk-old-1\nsk-other-2\n")
    url = gateway(gateways, worker, key_file, "--api-key-reload-s", str(POLL_S))
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}
    texts: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": "Bearer sk-old-1"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                break
        replace_file(key_file, "sk-other-2\n")  # sk-old-1 revoked mid-stream
        until(lambda: status(url, "sk-old-1") == 401)
        assert len(texts) < 50  # revoked while the stream was still going
        done = False
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    assert done and len(texts) == 50, texts
    assert status(url, "sk-other-2") == 200


async def test_a_websocket_opened_under_a_removed_key_takes_no_new_request(worker, gateways, tmp_path):
    """A socket outlives a rotation: the answer it is owed still comes, and each request it
    sends after the key was revoked is refused, as the same request over HTTP is."""
    key_file = tmp_path / "keys.txt"
    key_file.write_text("sk-old-1\nsk-other-2\n")
    url = gateway(gateways, worker, key_file, "--api-key-reload-s", str(POLL_S))
    request = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 50})
    async with aiohttp.ClientSession() as session, session.ws_connect(
            url + "/v1/ws", headers={"Authorization": "Bearer sk-old-1"}) as ws:
        await ws.send_str(request)
        first = json.loads((await ws.receive(timeout=10)).data)
        assert first["choices"][0]["text"]
        replace_file(key_file, "sk-other-2\n")  # sk-old-1 revoked mid-answer
        await asyncio.to_thread(until, lambda: status(url, "sk-old-1") == 401)
        chunks = 1
        while json.loads((await ws.receive(timeout=10)).data).get("type") != "done":
            chunks += 1
        assert chunks == 50  # the answer owed came whole
        await ws.send_str(request)
        refused = json.loads((await ws.receive(timeout=10)).data)
        assert refused["error"]["code"] == "invalid_api_key"
        assert refused["error"]["type"] == "authentication_error"
    # A socket opened under a key in force is served.
    async with aiohttp.ClientSession() as session, session.ws_connect(
            url + "/v1/ws", headers={"Authorization": "Bearer sk-other-2"}) as ws:
        await ws.send_str(request)
        assert "choices" in json.loads((await ws.receive(timeout=10)).data)
