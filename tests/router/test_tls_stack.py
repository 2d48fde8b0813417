"""HTTPS end to end, with real processes on 127.0.0.1: a sim worker, a scheduler and a gateway,
each serving TLS with a throwaway CA's certificate; the worker and the scheduler require client
certificates (mutual TLS), which the scheduler (scraping) and the gateway (proxying, its
scheduler calls and pipelined channel) present, checking their peers against the private CA.
Clients reach the gateway over HTTPS only; plain HTTP, an unknown CA, a missing or foreign client
certificate are refused; a certificate or key that cannot be used is one line at start-up."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from tests.router.procs import REPO, Proc, free_port
from tests.tls_certs import Pki, make_pki

pytestmark = pytest.mark.timeout(300)

KEY = "sk-tls-test"
ADMIN = "admin-tls-test"
REGISTRATION = "registration-tls-test"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello over TLS"}], "max_tokens": 8}


def _client_ctx(pki: Pki, cert: bool = False, other: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    if other:
        ctx.load_cert_chain(str(pki.other_cert), str(pki.other_key))
    return ctx


def _wait_https(url: str, proc: Proc, ctx: ssl.SSLContext, timeout_s: float = 120.0, **kw) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.output()[-3000:]}")
        try:
            if httpx.get(url, verify=ctx, timeout=2, **kw).status_code < 500:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s ({last!r})\n{proc.output()[-3000:]}")


def _serve(pki: Pki, *, require_client_cert: bool) -> list[str]:
    flags = ["--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key),
             "--ssl-ca-certs", str(pki.ca)]
    return flags + ([] if require_client_cert else ["--ssl-cert-reqs", "optional"])


def _as_client(pki: Pki) -> list[str]:
    return ["--ssl-client-certfile", str(pki.client_cert), "--ssl-client-keyfile", str(pki.client_key)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(pki):
    procs: list[Proc] = []
    try:
        wport, sport, gport, mport = free_port(), free_port(), free_port(), free_port()
        worker = Proc(["-m", "inference_worker", "--backend", "sim", "--sim-profile", "tiny",
                       "--served-model-name", "m", "--port", str(wport),
                       *_serve(pki, require_client_cert=True)], f"sim-tls-{wport}")
        procs.append(worker)
        worker_url = f"https://127.0.0.1:{wport}"
        scheduler = Proc(["-m", "scheduler", "--port", str(sport), "--workers", worker_url,
                          "--scrape-interval-ms", "100", "--worker-ca-file", str(pki.ca), *_as_client(pki),
                          "--registration-token", REGISTRATION,
                          *_serve(pki, require_client_cert=True)], f"scheduler-tls-{sport}")
        procs.append(scheduler)
        scheduler_url = f"https://127.0.0.1:{sport}"
        # Client certificates optional at the gateway: API keys authenticate its clients, and
        # a certificate, when sent, must come from the CA.
        gateway = Proc(["-m", "router", "--port", str(gport), "--metrics-port", str(mport),
                        "--scheduler", scheduler_url, "--scheduler-ca-file", str(pki.ca),
                        "--worker-ca-file", str(pki.ca), *_as_client(pki), "--api-keys", KEY,
                        "--admin-token", ADMIN, *_serve(pki, require_client_cert=False)],
                       f"gateway-tls-{gport}")
        procs.append(gateway)
        with_cert = _client_ctx(pki, cert=True)
        _wait_https(worker_url + "/health", worker, with_cert)
        _wait_https(scheduler_url + "/health", scheduler, with_cert)
        gateway_url = f"https://127.0.0.1:{gport}"
        _wait_https(gateway_url + "/health", gateway, _client_ctx(pki))
        # The scheduler has scraped the worker over mutual TLS: it is up.
        deadline = time.monotonic() + 30
        while True:
            views = httpx.get(scheduler_url + "/v1/workers", verify=with_cert, timeout=5).json()["workers"]
            if views and views[0]["healthy"] and views[0]["models"] == ["m"]:
                break
            assert time.monotonic() < deadline, (views, scheduler.output()[-3000:])
            time.sleep(0.2)
        yield {"worker": worker_url, "scheduler": scheduler_url, "gateway": gateway_url,
               "metrics": f"https://127.0.0.1:{mport}", "procs": procs}
    finally:
        for p in procs:
            p.stop()


def test_chat_completions_over_https_through_the_stack(stack, pki):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(verify=_client_ctx(pki), timeout=60) as client:
        r = client.post(stack["gateway"] + "/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0

        with client.stream("POST", stack["gateway"] + "/v1/chat/completions",
                           json={**CHAT, "stream": True}, headers=headers) as s:
            assert s.status_code == 200
            data = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                       for d in data[:-1] if json.loads(d)["choices"])
        assert text

        # Scheduled (its scheduler reached over HTTPS, not round robin), and the leases given
        # back through the pipelined channel, in TLS too.
        state = client.get(stack["gateway"] + "/admin/state",
                           headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert state["mode"] == "scheduled" and state["scheduler"] == stack["scheduler"]
        metrics = client.get(stack["metrics"] + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert metrics.status_code == 200 and "router_" in metrics.text  # the metrics port: TLS too
    with_cert = _client_ctx(pki, cert=True)
    deadline = time.monotonic() + 10
    while True:
        views = httpx.get(stack["scheduler"] + "/v1/workers", verify=with_cert, timeout=5).json()["workers"]
        if not any(v["in_flight_leases"] for v in views):
            break
        assert time.monotonic() < deadline, views
        time.sleep(0.1)
    gateway_log = stack["procs"][2].output()
    assert "Traceback" not in gateway_log and "unavailable" not in gateway_log.lower(), gateway_log[-3000:]


async def test_a_websocket_session_over_tls_end_to_end(stack, pki):
    """/v1/ws: wss:// from the client, and the gateway's own WebSocket to the worker in TLS with
    its client certificate."""
    import aiohttp

    connector = aiohttp.TCPConnector(ssl=_client_ctx(pki))
    async with aiohttp.ClientSession(connector=connector) as s, s.ws_connect(
            stack["gateway"].replace("https://", "wss://") + "/v1/ws",
            headers={"Authorization": f"Bearer {KEY}"}) as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}))
        while True:
            msg = await ws.receive(timeout=30)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg
            if json.loads(msg.data).get("type") == "done":
                break
            assert "error" not in json.loads(msg.data), msg.data


def test_plain_http_and_untrusted_certificates_are_refused(stack, pki):
    gateway = stack["gateway"]
    # Plain HTTP on the TLS port: no answer.
    with pytest.raises(httpx.TransportError):
        httpx.get(gateway.replace("https://", "http://") + "/health", timeout=5)
    # The system's CAs do not know the private one: the client refuses the gateway.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(gateway + "/health", timeout=5)
    # At the gateway a client certificate is optional, but one from another CA is refused.
    assert httpx.get(gateway + "/health", verify=_client_ctx(pki, cert=True), timeout=5).status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(gateway + "/health", verify=_client_ctx(pki, other=True), timeout=5)
    # The worker and the scheduler require one (mutual TLS).
    for url in (stack["worker"], stack["scheduler"]):
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", verify=_client_ctx(pki), timeout=5)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", verify=_client_ctx(pki, other=True), timeout=5)
        assert httpx.get(url + "/health", verify=_client_ctx(pki, cert=True), timeout=5).status_code == 200
    for p in stack["procs"]:
        assert p.alive() and "Traceback" not in p.output(), p.output()[-3000:]


def test_a_worker_registers_with_an_https_scheduler(stack, pki):
    """--register-with an https:// scheduler, checked against --scheduler-ca-file, with a client
    certificate; the URL it registers is https:// as it serves TLS, and the scheduler scrapes it."""
    port = free_port()
    p = Proc(["-m", "inference_worker", "--backend", "sim", "--sim-profile", "tiny", "--served-model-name",
              "m", "--port", str(port), "--register-with", stack["scheduler"], "--registration-token",
              REGISTRATION, "--scheduler-ca-file", str(pki.ca), *_as_client(pki),
              *_serve(pki, require_client_cert=True)], f"sim-tls-reg-{port}")
    try:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            views = {v["url"]: v for v in httpx.get(stack["scheduler"] + "/v1/workers", timeout=5,
                                                     verify=_client_ctx(pki, cert=True)).json()["workers"]}
            if url in views and views[url]["healthy"]:
                break
            assert p.alive() and time.monotonic() < deadline, (views, p.output()[-3000:])
            time.sleep(0.2)
        assert "registered with scheduler" in p.output()
    finally:
        p.stop()


def test_a_worker_certificate_is_verified_by_default(stack, pki):
    """A scheduler given no --worker-ca-file checks the worker against the system's CAs: the
    private CA's certificate is not accepted, and the log says why."""
    port = free_port()
    p = Proc(["-m", "scheduler", "--port", str(port), "--workers", stack["worker"],
              "--scrape-interval-ms", "100", *_as_client(pki)], f"scheduler-noca-{port}")
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while "certificate not accepted" not in p.output():
            assert p.alive() and time.monotonic() < deadline, p.output()[-3000:]
            time.sleep(0.2)
        views = httpx.get(url + "/v1/workers", timeout=5).json()["workers"]
        assert not views[0]["healthy"]
    finally:
        p.stop()


def _start_up_error(module: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_a_certificate_or_key_that_cannot_be_used_stops_start_up(pki, tmp_path):
    missing = str(tmp_path / "missing.pem")
    line = _start_up_error("router", "--workers", "http://127.0.0.1:1", "--port", str(free_port()),
                           "--ssl-certfile", missing, "--ssl-keyfile", str(pki.server_key))
    assert line == f"error: cannot use --ssl-certfile {missing} / --ssl-keyfile {pki.server_key}: " \
                   "No such file or directory"
    line = _start_up_error("scheduler", "--port", str(free_port()), "--ssl-certfile", str(pki.server_cert),
                           "--ssl-keyfile", str(pki.client_key))
    assert line.startswith("error: cannot use --ssl-certfile") and \
        line.endswith("the key does not match the certificate")
    line = _start_up_error("inference_worker", "--backend", "sim", "--port", str(free_port()),
                           "--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", missing)
    assert line.startswith("error: cannot use --ssl-certfile") and line.endswith("No such file or directory")
    line = _start_up_error("router", "--workers", "https://127.0.0.1:1", "--port", str(free_port()),
                           "--worker-ca-file", missing)
    assert line == f"error: cannot use --worker-ca-file {missing}: No such file or directory"
