"""Renewed TLS certificates without a restart, with real processes on 127.0.0.1: a gateway
serving HTTPS takes a certificate renamed over its files within --ssl-reload-s while a keep-alive
connection and a stream opened before go on, keeps its certificate (and says so in an ERROR)
when the new key does not match, and on SIGHUP reloads its certificate and its API keys at once;
its client certificate and the CA bundle it checks workers with are reloaded, and a CA taken out
of that bundle (the gateway's, the scheduler's for its scrapes) no longer vouches for a worker on
new connections; a CA taken out of the gateway's bundle for the scheduler no longer vouches for
it on the scheduler channel opened before (it moves to a new connection); a worker reloads its
served certificate on SIGHUP. (The scheduler's part: tests/scheduler/test_tls_reload.py.)"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.router.procs import Proc, free_port, start_echo_worker
from tests.tls_certs import Pki, der, make_pki, not_after, replace, server_cert

pytestmark = pytest.mark.timeout(300)

POLL_S = 0.2
WITHIN_S = POLL_S + 5.0  # the margin is for a loaded machine
BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server_cert(pki, "server-b")
    server_cert(pki, "server-c", other_ca=True)
    return pki


def b_files(pki: Pki) -> tuple[Path, Path]:
    return pki.ca.parent / "server-b.pem", pki.ca.parent / "server-b.key"


def c_files(pki: Pki) -> tuple[Path, Path]:
    """A server certificate from the other CA."""
    return pki.ca.parent / "server-c.pem", pki.ca.parent / "server-c.key"



def until(cond: Callable[[], bool], within_s: float = WITHIN_S) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < within_s, f"not within {within_s:.1f} s"
        time.sleep(0.05)
    return time.monotonic() - start


def served(port: int, client: tuple[Path, Path] | None = None) -> bytes:
    """The certificate a new TLS connection to `port` is served (DER), read off the socket."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # both CAs' certificates seen
    if client:
        ctx.load_cert_chain(*map(str, client))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s, ctx.wrap_socket(s) as t:
        return t.getpeercert(binary_form=True)


def trusting(pki: Pki, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if client:
        ctx.load_cert_chain(*map(str, client))
    return ctx


def metric(url: str, series: str, ctx: ssl.SSLContext | bool = False) -> float | None:
    for line in httpx.get(url + "/metrics", verify=ctx, timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    # 40 ms between tokens: a stream of 50 tokens takes 2 s, long enough to renew meanwhile.
    p, url = start_echo_worker(token_delay_ms=40)
    try:
        yield url
    finally:
        p.stop()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def start(procs: list[Proc], args: list[str], ready: Callable[[], bool], name: str) -> Proc:
    p = Proc(args, name)
    procs.append(p)
    start_s = time.monotonic()
    while True:
        assert p.alive(), p.output()[-3000:]
        try:
            if ready():
                return p
        except (OSError, httpx.HTTPError):
            pass
        assert time.monotonic() - start_s < 120, p.output()[-3000:]
        time.sleep(0.1)


def https_gateway(procs: list[Proc], pki: Pki, live: Path, *extra: str) -> tuple[Proc, int]:
    replace(pki.server_cert, live / "tls.crt")
    replace(pki.server_key, live / "tls.key")
    port = free_port()
    p = start(procs, ["-m", "router", "--port", str(port), "--ssl-certfile", str(live / "tls.crt"),
                      "--ssl-keyfile", str(live / "tls.key"), *extra],
              lambda: httpx.get(f"https://127.0.0.1:{port}/health", verify=trusting(pki), timeout=2)
              .status_code == 200, f"gateway-tls-reload-{port}")
    return p, port


def https_worker(procs: list[Proc], pki: Pki, live: Path, client: tuple[Path, Path] | None = None,
                 *extra: str) -> tuple[Proc, int]:
    """A sim worker serving the CA's certificate from files in `live`, reloaded on SIGHUP only;
    `client`: the client certificate its readiness check shows (with `extra`'s --ssl-ca-certs)."""
    live.mkdir()
    replace(pki.server_cert, live / "tls.crt")
    replace(pki.server_key, live / "tls.key")
    port = free_port()
    p = start(procs, ["-m", "inference_worker", "--backend", "sim", "--sim-profile", "tiny",
                      "--served-model-name", "m", "--port", str(port), "--ssl-reload-s", "0",
                      "--ssl-certfile", str(live / "tls.crt"), "--ssl-keyfile", str(live / "tls.key"),
                      *extra],
              lambda: httpx.get(f"https://127.0.0.1:{port}/health", timeout=2,
                                verify=trusting(pki, client)).status_code == 200,
              f"sim-tls-reload-{port}")
    return p, port


def test_a_renewed_certificate_is_served_to_new_connections_and_open_ones_go_on(echo, procs, pki, tmp_path):
    proc, port = https_gateway(procs, pki, tmp_path, "--workers", echo, "--ssl-reload-s", str(POLL_S))
    url = f"https://127.0.0.1:{port}"
    assert served(port) == der(pki.server_cert)
    expiry = 'router_tls_certificate_expiry_seconds{certificate="served"}'
    assert metric(url, expiry) == not_after(pki.server_cert)

    # Opened before the renewal: a keep-alive connection and a stream of 50 tokens (2 s).
    keep = http.client.HTTPSConnection("127.0.0.1", port, context=trusting(pki), timeout=10)
    keep.request("GET", "/health")
    assert keep.getresponse().read()
    sock = keep.sock
    stream = http.client.HTTPSConnection("127.0.0.1", port, context=trusting(pki), timeout=30)
    stream.request("POST", "/v1/completions", json.dumps({**BODY, "max_tokens": 50, "stream": True}),
                   {"Content-Type": "application/json"})
    answer = stream.getresponse()
    assert answer.status == 200 and answer.readline().startswith(b"data: {")

    # A key that does not match: the certificate in force stays, one ERROR says why.
    replace(pki.client_key, tmp_path / "tls.key")
    until(lambda: "the key does not match the certificate" in proc.output())
    assert served(port) == der(pki.server_cert)
    assert metric(url, 'router_tls_reloads_total{result="failed"}') == 1
    assert "ERROR tls: TLS served certificate: reload (file changed) failed" in proc.output()

    # The renewal, its key first (in between the pair does not match either).
    b_cert, b_key = b_files(pki)
    replace(b_key, tmp_path / "tls.key")
    replace(b_cert, tmp_path / "tls.crt")
    until(lambda: served(port) == der(b_cert))
    assert httpx.get(url + "/health", verify=trusting(pki), timeout=10).status_code == 200
    assert metric(url, expiry) == not_after(b_cert)
    assert metric(url, 'router_tls_reloads_total{result="reloaded"}') == 1
    log = proc.output()
    assert "TLS served certificate reloaded (file changed)" in log and "subject CN=server-b " in log
    assert "PRIVATE" not in log and "Traceback" not in log

    # What was open goes on: the same connection, on its first handshake's certificate.
    keep.request("GET", "/health")
    assert keep.getresponse().status == 200 and keep.sock is sock
    assert keep.sock.getpeercert(binary_form=True) == der(pki.server_cert)
    rest = answer.read().decode()
    assert rest.rstrip().endswith("data: [DONE]") and rest.count("data: {") == 49
    keep.close()
    stream.close()


def test_sighup_reloads_the_certificate_and_the_api_keys_together(echo, procs, pki, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-old\n")
    proc, port = https_gateway(procs, pki, tmp_path, "--workers", echo, "--ssl-reload-s", "0",
                               "--api-key-file", str(keys), "--api-key-reload-s", "0")
    url = f"https://127.0.0.1:{port}"

    def status(key: str) -> int:
        return httpx.post(url + "/v1/completions", json=BODY, verify=trusting(pki), timeout=10,
                          headers={"Authorization": f"Bearer {key}"}).status_code

    b_cert, b_key = b_files(pki)
    replace(b_key, tmp_path / "tls.key")
    replace(b_cert, tmp_path / "tls.crt")
    replace_keys = tmp_path / "keys.new"
    replace_keys.write_text("sk-new\n")
    os.replace(replace_keys, keys)
    time.sleep(1.0)
    assert served(port) == der(pki.server_cert) and status("sk-new") == 401  # nothing polls

    os.kill(proc.pid, signal.SIGHUP)
    until(lambda: served(port) == der(b_cert), within_s=5.0)
    until(lambda: status("sk-new") == 200, within_s=5.0)
    assert status("sk-old") == 401 and proc.alive()
    assert "TLS served certificate reloaded (SIGHUP)" in proc.output()


def test_client_certificate_and_worker_ca_bundle_reloaded_and_a_worker_on_sighup(
        procs, pki, tmp_path):
    """A worker asking for client certificates from the other CA only; a gateway that shows it
    one from the CA, and checks it against the other CA's bundle: refused both ways, until the
    gateway's files are renewed. The worker, polling off, reloads its own certificate on SIGHUP."""
    worker_live = tmp_path / "worker"
    theirs = (pki.other_cert, pki.other_key)
    worker, wport = https_worker(procs, pki, worker_live, theirs, "--ssl-ca-certs", str(pki.other_ca))
    gw_live = tmp_path / "gateway"
    gw_live.mkdir()
    replace(pki.other_ca, gw_live / "workers-ca.pem")
    replace(pki.client_cert, gw_live / "client.crt")
    replace(pki.client_key, gw_live / "client.key")
    gport = free_port()
    gateway = start(procs, ["-m", "router", "--port", str(gport), "--workers", f"https://127.0.0.1:{wport}",
                            "--worker-ca-file", str(gw_live / "workers-ca.pem"), "--ssl-client-certfile",
                            str(gw_live / "client.crt"), "--ssl-client-keyfile", str(gw_live / "client.key"),
                            "--ssl-reload-s", str(POLL_S), "--fallback-cooldown-ms", "10"],
                    lambda: httpx.get(f"http://127.0.0.1:{gport}/health", timeout=2).status_code == 200,
                    f"gateway-tls-reload-{gport}")
    gateway_url = f"http://127.0.0.1:{gport}"

    def status() -> int:
        return httpx.post(gateway_url + "/v1/completions", json=BODY, timeout=30).status_code

    assert status() >= 500
    assert "TLS context for calling workers in use (start)" in gateway.output()
    replace(pki.ca, gw_live / "workers-ca.pem")  # the worker's CA
    replace(pki.other_key, gw_live / "client.key")  # a client certificate of the CA it asks for
    replace(pki.other_cert, gw_live / "client.crt")
    until(lambda: status() == 200)
    assert "TLS context for calling workers reloaded (file changed)" in gateway.output()
    assert metric(gateway_url, 'router_tls_certificate_expiry_seconds{certificate="client"}') == \
        not_after(pki.other_cert)

    # The worker: renewed files are not looked at (--ssl-reload-s 0) until SIGHUP.
    b_cert, b_key = b_files(pki)
    replace(b_key, worker_live / "tls.key")
    replace(b_cert, worker_live / "tls.crt")
    time.sleep(1.0)
    assert served(wport, theirs) == der(pki.server_cert)
    os.kill(worker.pid, signal.SIGHUP)
    until(lambda: served(wport, theirs) == der(b_cert), within_s=5.0)
    assert worker.alive() and "TLS served certificate reloaded (SIGHUP)" in worker.output()
    assert metric(f"https://127.0.0.1:{wport}", 'worker_tls_certificate_expiry_seconds{certificate="served"}',
                  trusting(pki, theirs)) == not_after(b_cert)
    assert metric(f"https://127.0.0.1:{wport}", 'worker_tls_reloads_total{result="reloaded"}',
                  trusting(pki, theirs)) == 1
    assert status() == 200  # through the gateway, to the renewed worker
    for p in (worker, gateway):
        assert "Traceback" not in p.output() and "PRIVATE" not in p.output(), p.output()[-3000:]


def test_a_ca_taken_out_of_the_workers_bundle_no_longer_vouches_for_new_connections(procs, pki, tmp_path):
    """A worker with a certificate from the CA, scraped by a scheduler and called by a gateway
    that each trust the CA and the other CA. Their bundles renewed with the other CA only (the
    CA retired, or compromised): new connections to the worker are refused, the scheduler reports
    it down and the gateway's calls fail. The worker's certificate renewed from the other CA
    (SIGHUP): both call it again."""
    both = tmp_path / "both.pem"
    both.write_text(pki.ca.read_text() + pki.other_ca.read_text())
    worker, wport = https_worker(procs, pki, tmp_path / "worker")
    worker_url = f"https://127.0.0.1:{wport}"
    bundles = {"scheduler": tmp_path / "scheduler-ca.pem", "gateway": tmp_path / "gateway-ca.pem"}
    for bundle in bundles.values():
        replace(both, bundle)
    sport, gport = free_port(), free_port()

    def scheduler_says_up() -> bool:
        [view] = httpx.get(f"http://127.0.0.1:{sport}/v1/workers", timeout=10).json()["workers"]
        return view["healthy"]

    def gateway_statuses() -> tuple[int, int]:
        """A whole answer's status and a stream's (another path in the gateway)."""
        url = f"http://127.0.0.1:{gport}/v1/completions"
        return (httpx.post(url, json=BODY, timeout=30).status_code,
                httpx.post(url, json={**BODY, "stream": True}, timeout=30).status_code)

    scheduler = start(procs, ["-m", "scheduler", "--port", str(sport), "--workers", worker_url,
                              "--worker-ca-file", str(bundles["scheduler"]), "--scrape-interval-ms", "100",
                              "--ssl-reload-s", str(POLL_S)],
                      scheduler_says_up, f"scheduler-tls-reload-{sport}")
    gateway = start(procs, ["-m", "router", "--port", str(gport), "--workers", worker_url,
                            "--worker-ca-file", str(bundles["gateway"]), "--ssl-reload-s", str(POLL_S),
                            "--fallback-cooldown-ms", "10"],
                    lambda: gateway_statuses() == (200, 200), f"gateway-tls-reload-{gport}")

    for bundle in bundles.values():
        replace(pki.other_ca, bundle)
    until(lambda: not scheduler_says_up())
    assert "TLS: certificate not accepted" in scheduler.output()
    until(lambda: min(gateway_statuses()) >= 500)
    for p in (scheduler, gateway):
        assert "TLS context for calling workers reloaded (file changed)" in p.output()

    c_cert, c_key = c_files(pki)
    replace(c_key, tmp_path / "worker" / "tls.key")
    replace(c_cert, tmp_path / "worker" / "tls.crt")
    os.kill(worker.pid, signal.SIGHUP)
    until(lambda: served(wport) == der(c_cert))
    until(scheduler_says_up)
    until(lambda: gateway_statuses() == (200, 200))
    for p in (worker, scheduler, gateway):
        assert "Traceback" not in p.output(), p.output()[-3000:]


def test_the_scheduler_channel_moves_to_the_reloaded_context(echo, procs, pki, tmp_path):
    """A gateway on an HTTPS scheduler through its WebSocket channel, which it never closes when
    idle. Its --scheduler-ca-file renewed with the other CA only (the CA retired, or compromised):
    the channel open, made when the CA vouched for the scheduler, is not used any more, and the
    requests after it are not scheduled by the scheduler (round robin over --workers answers
    them). The scheduler's certificate renewed from the other CA: the gateway schedules through
    it again, on a channel checked against the other CA. (The worker list refresh, which would
    also find the scheduler untrusted, is slowed down so that only the channel is tested.)"""
    sched_live, gw_live = tmp_path / "scheduler", tmp_path / "gateway"
    sched_live.mkdir()
    gw_live.mkdir()
    replace(pki.server_cert, sched_live / "tls.crt")
    replace(pki.server_key, sched_live / "tls.key")
    replace(pki.ca, gw_live / "scheduler-ca.pem")
    sport, gport = free_port(), free_port()
    scheduler_url = f"https://127.0.0.1:{sport}"
    gateway_url = f"http://127.0.0.1:{gport}"

    def decisions() -> float:
        """The schedule decisions the scheduler made (every policy and outcome)."""
        text = httpx.get(scheduler_url + "/metrics", verify=checks[0], timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("scheduler_decisions_total{"))

    def completion() -> int:
        return httpx.post(gateway_url + "/v1/completions", json=BODY, timeout=30).status_code

    def mode() -> str:
        return httpx.get(gateway_url + "/health", timeout=10).json()["mode"]

    checks = [trusting(pki)]  # the test's own check of the scheduler's certificate
    start(procs, ["-m", "scheduler", "--port", str(sport), "--workers", echo, "--scrape-interval-ms", "100",
                  "--ssl-certfile", str(sched_live / "tls.crt"), "--ssl-keyfile", str(sched_live / "tls.key"),
                  "--ssl-reload-s", str(POLL_S)],
          lambda: httpx.get(scheduler_url + "/v1/workers", verify=trusting(pki), timeout=2)
          .json()["workers"][0]["healthy"], f"scheduler-tls-reload-{sport}")
    gateway = start(procs, ["-m", "router", "--port", str(gport), "--scheduler", scheduler_url,
                            "--scheduler-ca-file", str(gw_live / "scheduler-ca.pem"),
                            "--scheduler-channel", "ws", "--workers", echo, "--workers-refresh-ms", "600000",
                            "--ssl-reload-s", str(POLL_S)],
                    lambda: mode() == "scheduled" and completion() == 200, f"gateway-tls-reload-{gport}")
    before = decisions()
    assert completion() == 200 and decisions() == before + 1  # scheduled, through the channel

    replace(pki.other_ca, gw_live / "scheduler-ca.pem")
    until(lambda: "TLS context for calling the scheduler reloaded (file changed)" in gateway.output())
    before = decisions()
    assert [completion() for _ in range(5)] == [200] * 5  # answered, round robin
    assert decisions() == before  # none scheduled through the channel opened before
    assert "scheduler channel: TLS context reloaded" in gateway.output()

    c_cert, c_key = c_files(pki)
    replace(c_key, sched_live / "tls.key")
    replace(c_cert, sched_live / "tls.crt")
    until(lambda: served(sport) == der(c_cert))
    checks[0] = ssl.create_default_context(cafile=str(pki.other_ca))
    until(lambda: mode() == "scheduled", within_s=30)
    before = decisions()
    assert completion() == 200 and decisions() == before + 1  # through a channel the other CA checked
    assert "Traceback" not in gateway.output(), gateway.output()[-3000:]


async def _answer(ws: aiohttp.ClientWebSocketResponse) -> list[str] | int:
    """One request's messages up to its `done`; or the close code, if the socket closes first."""
    messages: list[str] = []
    while True:
        msg = await ws.receive(timeout=30)
        if msg.type != aiohttp.WSMsgType.TEXT:
            return ws.close_code or 0
        messages.append(msg.data)
        if json.loads(msg.data).get("type") == "done":
            return messages


async def test_a_websocket_reopens_its_worker_connection_at_its_next_request_after_a_reload(
        procs, pki, tmp_path):
    """A client's WebSocket stays open through a reload of the gateway's worker CA bundle: its
    next request goes on a connection to the worker opened with the reloaded context (the same
    worker, renewed from the other CA meanwhile: the conversation goes on). And once the bundle
    no longer vouches for the worker, the socket's next request is not answered by it: the
    socket is closed (1001, no other worker), where the connection opened before went on."""
    both = tmp_path / "both.pem"
    both.write_text(pki.ca.read_text() + pki.other_ca.read_text())
    worker_live = tmp_path / "worker"
    worker, wport = https_worker(procs, pki, worker_live)
    bundle = tmp_path / "workers-ca.pem"
    replace(both, bundle)
    gport = free_port()
    gateway = await asyncio.to_thread(
        start, procs, ["-m", "router", "--port", str(gport), "--workers", f"https://127.0.0.1:{wport}",
                       "--worker-ca-file", str(bundle), "--ssl-reload-s", str(POLL_S),
                       "--fallback-cooldown-ms", "10"],
        lambda: httpx.get(f"http://127.0.0.1:{gport}/health", timeout=2).status_code == 200,
        f"gateway-tls-reload-{gport}")

    def reloaded(times: int) -> bool:
        return gateway.output().count("TLS context for calling workers reloaded (file changed)") >= times

    ask = json.dumps(BODY)
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(f"http://127.0.0.1:{gport}/v1/ws") as ws:
        await ws.send_str(ask)
        first = await _answer(ws)
        assert isinstance(first, list) and '"choices"' in first[0]

        # The worker renewed from the other CA, the gateway's bundle that CA only.
        c_cert, c_key = c_files(pki)
        replace(c_key, worker_live / "tls.key")
        replace(c_cert, worker_live / "tls.crt")
        os.kill(worker.pid, signal.SIGHUP)
        replace(pki.other_ca, bundle)
        await asyncio.to_thread(until, lambda: served(wport) == der(c_cert) and reloaded(1))
        await ws.send_str(ask)
        second = await _answer(ws)
        assert isinstance(second, list) and '"choices"' in second[0]  # the conversation goes on
        worker_url = f"https://127.0.0.1:{wport}"  # the same worker, a new connection
        assert f"moved from {worker_url} (TLS context reloaded) to {worker_url} " in gateway.output()

        # The CA alone again: it does not vouch for the renewed worker.
        replace(pki.ca, bundle)
        await asyncio.to_thread(until, lambda: reloaded(2))
        await ws.send_str(ask)
        assert await _answer(ws) == 1001  # not answered by a worker the bundle does not vouch for
    assert "Traceback" not in gateway.output(), gateway.output()[-3000:]
