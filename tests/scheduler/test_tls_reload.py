"""TLS hot reload (scheduler/tls_reload.py and its worker twin, inference_worker/server/tls_reload.py).

In process, for both twins: an HTTPS server on 127.0.0.1 whose files are replaced (renamed over)
and checked; each handshake is a real one from a thread, reading the certificate served; and a
context peers are called with, built afresh on each reload: a CA taken out of its bundle no
longer vouches for a peer, and only the client certificate in force is sent. Then a real
scheduler process serving mutual TLS from a Kubernetes Secret volume that is swapped: new
connections get the new certificate and client CAs, an open keep-alive connection goes on, a
mismatched pair keeps what is in force."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import http.client
import logging
import os
import shutil
import signal
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import httpx
import pytest
from aiohttp import web

from inference_worker.server import clip as worker_clip
from inference_worker.server import connection_limit as worker_connection_limit
from inference_worker.server import file_watch as worker_file_watch
from inference_worker.server import receive_timeout as worker_receive_timeout
from inference_worker.server import tls as worker_tls
from inference_worker.server import tls_reload as worker_tls_reload
from scheduler import clip as scheduler_clip
from scheduler import connection_limit as scheduler_connection_limit
from scheduler import file_watch as scheduler_file_watch
from scheduler import receive_timeout as scheduler_receive_timeout
from scheduler import tls as scheduler_tls
from scheduler import tls_reload as scheduler_tls_reload
from tests.router.procs import Proc, free_port
from tests.tls_certs import Pki, client_cert, der, make_pki, not_after, replace, server_cert

TWINS = [(scheduler_tls, scheduler_tls_reload), (worker_tls, worker_tls_reload)]
POLL_S = 0.2
WITHIN_S = POLL_S + 5.0  # the margin is for a loaded machine


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server_cert(pki, "server-b")
    server_cert(pki, "server-c", other_ca=True)
    client_cert(pki, "client-rsa", rsa=True)
    return pki


def files(pki: Pki, name: str) -> tuple[Path, Path]:
    return pki.ca.parent / f"{name}.pem", pki.ca.parent / f"{name}.key"



def served(port: int, client: tuple[Path, Path] | None = None) -> bytes:
    """The certificate a new TLS connection to `port` is served (DER), unverified."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if client:
        ctx.load_cert_chain(*map(str, client))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s, ctx.wrap_socket(s) as t:
        return t.getpeercert(binary_form=True)


def _same_code(a: Path, b: Path) -> None:
    """The twins' code, without their docstrings and imports, is the same."""
    def body(path: Path) -> str:
        tree = ast.parse(path.read_text())
        tree.body = [n for n in tree.body if not isinstance(n, ast.Import | ast.ImportFrom)
                     and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        return ast.unparse(tree)
    assert body(a) == body(b), f"{a} and {b} drifted apart"


def test_the_worker_twins_are_the_schedulers():
    _same_code(Path(scheduler_tls_reload.__file__), Path(worker_tls_reload.__file__))
    _same_code(Path(scheduler_file_watch.__file__), Path(worker_file_watch.__file__))
    _same_code(Path(scheduler_receive_timeout.__file__), Path(worker_receive_timeout.__file__))
    _same_code(Path(scheduler_connection_limit.__file__), Path(worker_connection_limit.__file__))
    _same_code(Path(scheduler_clip.__file__), Path(worker_clip.__file__))


class Server:
    """An HTTPS server in this loop whose handler answers with the client certificate's CN; any
    other path is answered `{}` (a caller's call that went through) on a connection then closed."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx

    async def __aenter__(self) -> Server:
        async def who(request: web.Request) -> web.Response:
            cert = request.transport.get_extra_info("peercert") or {}
            return web.Response(text=dict(x[0] for x in cert.get("subject", ())).get("commonName", "-"))

        async def through(_request: web.Request) -> web.Response:
            answer = web.json_response({})
            answer.force_close()  # the next call is a new connection
            return answer

        app = web.Application()
        app.router.add_get("/", who)
        app.router.add_route("*", "/{tail:.+}", through)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ctx)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.mark.parametrize(("tls", "reload"), TWINS)
async def test_a_renewed_served_certificate_is_served_to_new_connections(tls, reload, pki, tmp_path,
                                                                         caplog):
    cert, key, cas = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    replace(pki.server_cert, cert)
    replace(pki.server_key, key)
    replace(pki.ca, cas)
    cfg = SimpleNamespace(ssl_certfile=str(cert), ssl_keyfile=str(key), ssl_ca_certs=str(cas),
                          ssl_cert_reqs=1, ssl_client_certfile=None, ssl_client_keyfile=None)
    front = tls.server_context(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs, cfg.ssl_cert_reqs)
    reloader = reload.tls_reloader(cfg, front, [])
    caplog.set_level(logging.INFO, "tls")
    async with Server(front) as server:
        await reloader.start()
        assert "TLS served certificate in use (start)" in caplog.text and "CN=server " in caplog.text
        assert await asyncio.to_thread(served, server.port) == der(pki.server_cert)
        # A keep-alive connection opened now, with a client certificate from the CA.
        open_ctx = ssl.create_default_context(cafile=str(pki.ca))
        open_ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        keep = http.client.HTTPSConnection("127.0.0.1", server.port, context=open_ctx, timeout=10)

        def get(conn: http.client.HTTPSConnection) -> str:
            conn.request("GET", "/")
            return conn.getresponse().read().decode()

        assert await asyncio.to_thread(get, keep) == "client"
        sock = keep.sock

        # Renewed (another key too), and the client CAs now the other CA only.
        b_cert, b_key = files(pki, "server-b")
        replace(b_key, key)
        replace(b_cert, cert)
        replace(pki.other_ca, cas)
        await reloader.check(force=False, why="file changed")
        assert await asyncio.to_thread(served, server.port) == der(b_cert)
        assert reloader.counts == {"reloaded": 1, "unchanged": 0, "failed": 0}
        assert "TLS served certificate reloaded (file changed)" in caplog.text
        assert "CN=server-b " in caplog.text and "PRIVATE" not in caplog.text
        # The open connection goes on, on its first handshake.
        assert await asyncio.to_thread(get, keep) == "client" and keep.sock is sock
        assert keep.sock.getpeercert(binary_form=True) == der(pki.server_cert)
        keep.close()

        # The CA taken out of --ssl-ca-certs no longer vouches for a client; the new one does.
        def fresh_get(client: tuple[Path, Path]) -> str:
            ctx = ssl.create_default_context(cafile=str(pki.ca))
            ctx.load_cert_chain(*map(str, client))
            conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=10)
            try:
                return get(conn)
            finally:
                conn.close()

        assert await asyncio.to_thread(fresh_get, (pki.other_cert, pki.other_key)) == "other"
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await asyncio.to_thread(fresh_get, (pki.client_cert, pki.client_key))

        # A key that does not match, then a half-written certificate: B stays, one ERROR each.
        caplog.clear()
        replace(pki.client_key, key)
        await reloader.check(force=False, why="file changed")
        assert await asyncio.to_thread(served, server.port) == der(b_cert)
        [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "the key does not match the certificate" in error.getMessage()
        assert "CN=server-b" in error.getMessage()  # what is kept
        await reloader.check(force=False, why="file changed")  # not again while unchanged
        replace(b_key, key)
        text = b_cert.read_text()
        half = tmp_path / "half.pem"
        half.write_text(text[: len(text) // 2])
        replace(half, cert)
        await reloader.check(force=False, why="file changed")
        assert await asyncio.to_thread(served, server.port) == der(b_cert)
        assert reloader.counts["failed"] == 2
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2

        # Whole again: the same files as in force change nothing.
        replace(b_cert, cert)
        await reloader.check(force=False, why="file changed")
        assert reloader.counts == {"reloaded": 1, "unchanged": 1, "failed": 2}

        # A certificate of another CA, forced (SIGHUP): served at once.
        c_cert, c_key = files(pki, "server-c")
        replace(c_cert, cert)
        replace(c_key, key)
        await reloader.check(force=True, why="SIGHUP")
        assert await asyncio.to_thread(served, server.port) == der(c_cert)

    metrics = {(m.name, tuple(s.labels.items())): s.value
               for m in reloader.collector("x").collect() for s in m.samples}
    assert metrics[("x_tls_certificate_expiry_seconds", (("certificate", "served"),))] == not_after(c_cert)
    assert metrics[("x_tls_reloads", (("result", "reloaded"),))] == 2


@pytest.mark.parametrize(("tls", "reload"), TWINS)
async def test_a_reloaded_client_context_is_a_fresh_one_that_new_connections_use(tls, reload, pki, tmp_path,
                                                                               caplog):
    """Two peers, one with a certificate from the CA, one from the other CA, asking for client
    certificates from either; the context they are called with trusts both, then only the other
    CA: the first is refused from then on. Its client certificate, RSA, replaced by an ECDSA one
    and back: the peers see only the one in force (OpenSSL's TLS 1.3 client prefers an ECDSA
    certificate, so one loaded into the same context would still be sent)."""
    both = tmp_path / "both.pem"
    both.write_text(pki.ca.read_text() + pki.other_ca.read_text())
    c_cert, c_key = files(pki, "server-c")  # from the other CA
    rsa_cert, rsa_key = files(pki, "client-rsa")
    cert, key, cas = tmp_path / "client.crt", tmp_path / "client.key", tmp_path / "peers-ca.pem"
    replace(rsa_cert, cert)
    replace(rsa_key, key)
    replace(both, cas)
    cfg = SimpleNamespace(ssl_certfile=None, ssl_client_certfile=str(cert), ssl_client_keyfile=str(key))
    peer = tls.PeerContext(tls.client_context(str(cas), str(cert), str(key), ca_option="--peer-ca-file"))
    reloader = reload.tls_reloader(cfg, None, [("peers", peer, str(cas), "--peer-ca-file")])
    caplog.set_level(logging.INFO, "tls")

    async def who(port: int) -> str:
        """The client certificate's CN that the peer saw, on a new connection."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.get(f"https://127.0.0.1:{port}/", ssl=peer.request_ssl) as r:
            return await r.text()

    async with Server(tls.server_context(str(pki.server_cert), str(pki.server_key), str(both))) as from_ca, \
            Server(tls.server_context(str(c_cert), str(c_key), str(both))) as from_other:
        await reloader.start()
        assert "TLS context for calling peers in use (start)" in caplog.text
        assert await who(from_ca.port) == await who(from_other.port) == "client-rsa"
        first = peer.current

        # The CA taken out of the bundle: its peer refused, the other's still called.
        replace(pki.other_ca, cas)
        await reloader.check(force=False, why="file changed")
        assert "TLS context for calling peers reloaded (file changed)" in caplog.text
        assert peer.current is not first  # a new context, the old one untouched
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await who(from_ca.port)
        assert await who(from_other.port) == "client-rsa"

        # RSA, then ECDSA, then RSA again: each time only the one in force is sent.
        replace(pki.client_key, key)
        replace(pki.client_cert, cert)
        await reloader.check(force=False, why="file changed")
        assert await who(from_other.port) == "client"
        assert "subject CN=client," in caplog.text
        replace(rsa_key, key)
        replace(rsa_cert, cert)
        await reloader.check(force=False, why="file changed")
        assert await who(from_other.port) == "client-rsa"
        assert reloader.counts == {"reloaded": 3, "unchanged": 0, "failed": 0}

        # A key that does not match: the context in force is kept, and works.
        in_force = peer.current
        replace(pki.client_key, key)
        await reloader.check(force=False, why="file changed")
        assert peer.current is in_force and await who(from_other.port) == "client-rsa"
        [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert f"cannot use --ssl-client-certfile {cert} / --ssl-client-keyfile {key}: the key does not " \
               "match the certificate" in error, error
        # Whole again, and the bundle missing: one ERROR naming its option, nothing changed.
        replace(rsa_key, key)
        cas.unlink()
        await reloader.check(force=False, why="file changed")
        assert peer.current is in_force and await who(from_other.port) == "client-rsa"
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert f"cannot use --peer-ca-file {cas}: No such file or directory" in errors[-1]
        # Both CAs again: the first peer is called again.
        replace(both, cas)
        await reloader.check(force=False, why="file changed")
        assert await who(from_ca.port) == "client-rsa"
    expiry = {tuple(s.labels.items()): s.value for m in reloader.collector("x").collect() for s in m.samples
              if s.name == "x_tls_certificate_expiry_seconds"}
    assert expiry == {(("certificate", "client"),): not_after(rsa_cert)}


Call = Callable[[], Awaitable[bool]]  # one call; whether it went through


@contextlib.asynccontextmanager
async def _gateways_scheduler_client(url: str, peer: scheduler_tls.PeerContext) -> AsyncIterator[Call]:
    from scheduler.client import SchedulerClient

    async with SchedulerClient(url, tls=peer) as client:
        async def call() -> bool:
            return await client.routable() is not None

        yield call


@contextlib.asynccontextmanager
async def _gateways_scheduler_pipe(url: str, peer: scheduler_tls.PeerContext) -> AsyncIterator[Call]:
    from router.sched_pipe import SchedulerPipe
    from scheduler.client import SchedulerUnavailableError

    pipe = SchedulerPipe(url, channel="http", tls=peer)

    async def call() -> bool:
        try:
            return await pipe.schedule_raw({"model": "m"}) == (200, {})
        except SchedulerUnavailableError:
            return False

    try:
        yield call
    finally:
        pipe.close()


@contextlib.asynccontextmanager
async def _workers_registrar(url: str, peer: worker_tls.PeerContext) -> AsyncIterator[Call]:
    from inference_worker.config import WorkerConfig
    from inference_worker.registration import Registrar

    registrar = Registrar(WorkerConfig(register_with=url), heartbeat_s=3600.0, tls=peer)
    await registrar.start()  # registers once in the background, then waits an hour

    async def call() -> bool:
        return await registrar._register_once() is not None

    try:
        yield call
    finally:
        await registrar.stop()


@pytest.mark.parametrize(("caller", "tls"), [(_gateways_scheduler_client, scheduler_tls),
                                             (_gateways_scheduler_pipe, scheduler_tls),
                                             (_workers_registrar, worker_tls)])
async def test_each_caller_opens_its_connections_with_the_context_in_force(caller, tls, pki):
    """The gateway's scheduler client and pipelined channel, and a worker's registrar, read their
    PeerContext for each connection they open (the scrape's and the gateway's calls to workers:
    tests/router/test_tls_reload.py); the scheduler here is a stand-in that closes each
    connection after one answer."""
    peer = tls.PeerContext(tls.client_context(str(pki.ca)))
    async with Server(tls.server_context(str(pki.server_cert), str(pki.server_key))) as stand_in, \
            caller(f"https://127.0.0.1:{stand_in.port}", peer) as call:
        assert await call()
        peer.current = tls.client_context(str(pki.other_ca))  # as a reload does
        assert not await call()
        peer.current = tls.client_context(str(pki.ca))
        assert await call()


# ---------------------------------------------------------------- a real scheduler process


class SecretVolume:
    """A Kubernetes Secret volume as the kubelet writes it: `<key>` -> `..data/<key>`, `..data`
    -> a timestamped directory; an update writes a new directory and swaps `..data`."""

    def __init__(self, root: Path) -> None:
        self.root, self.n = root, 0

    def write(self, files: dict[str, Path]) -> None:
        self.n += 1
        new = self.root / f"..2024_01_01_00_00_{self.n:02d}.000000001"
        new.mkdir()
        for name, src in files.items():
            shutil.copyfile(src, new / name)
        data = self.root / "..data"
        old = data.resolve() if data.is_symlink() else None
        (self.root / "..data_tmp").symlink_to(new.name)
        os.replace(self.root / "..data_tmp", data)
        for name in files:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")
        if old is not None:
            shutil.rmtree(old)


def until(cond: Callable[[], bool], within_s: float = WITHIN_S) -> None:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < within_s, f"not within {within_s:.1f} s"
        time.sleep(0.05)


@pytest.fixture
def scheduler_proc(pki, tmp_path) -> Iterator[tuple[Proc, int, SecretVolume]]:
    volume = SecretVolume(tmp_path)
    volume.write({"tls.crt": pki.server_cert, "tls.key": pki.server_key, "ca.crt": pki.ca})
    port = free_port()
    p = Proc(["-m", "scheduler", "--port", str(port), "--ssl-certfile", str(tmp_path / "tls.crt"),
              "--ssl-keyfile", str(tmp_path / "tls.key"), "--ssl-ca-certs", str(tmp_path / "ca.crt"),
              "--ssl-reload-s", str(POLL_S)], f"scheduler-tls-reload-{port}")
    try:
        until(lambda: not p.alive() or "scheduler ready" in p.output(), 60)
        assert p.alive(), p.output()
        yield p, port, volume
    finally:
        p.stop()


def _verified(pki: Pki, client: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_verify_locations(str(pki.other_ca))
    ctx.load_cert_chain(*map(str, client))
    return ctx


def test_a_scheduler_takes_a_kubernetes_secret_update_without_a_restart(scheduler_proc, pki):
    p, port, volume = scheduler_proc
    mine = (pki.client_cert, pki.client_key)
    assert served(port, mine) == der(pki.server_cert)
    keep = http.client.HTTPSConnection("127.0.0.1", port, context=_verified(pki, mine), timeout=10)
    keep.request("GET", "/health")
    assert keep.getresponse().read() and keep.sock.getpeercert(binary_form=True) == der(pki.server_cert)

    # A mismatched pair: the certificate in force stays, one ERROR.
    volume.write({"tls.crt": files(pki, "server-b")[0], "tls.key": pki.client_key, "ca.crt": pki.ca})
    until(lambda: "the key does not match the certificate" in p.output())
    assert served(port, mine) == der(pki.server_cert)
    assert "ERROR tls: TLS served certificate: reload (file changed) failed" in p.output()

    # The renewal, from the other CA, which now signs the clients too.
    c_cert, c_key = files(pki, "server-c")
    volume.write({"tls.crt": c_cert, "tls.key": c_key, "ca.crt": pki.other_ca})
    theirs = (pki.other_cert, pki.other_key)
    until(lambda: served(port, theirs) == der(c_cert))
    text = httpx.get(f"https://127.0.0.1:{port}/metrics", verify=_verified(pki, theirs), timeout=10).text
    series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("scheduler_tls_"))
    expiry = series['scheduler_tls_certificate_expiry_seconds{certificate="served"}']
    assert float(expiry) == not_after(c_cert)
    assert float(series['scheduler_tls_reloads_total{result="reloaded"}']) == 1
    with pytest.raises(httpx.TransportError):  # the CA dropped from ca.crt vouches for no one
        httpx.get(f"https://127.0.0.1:{port}/health", verify=_verified(pki, mine), timeout=10)
    # The connection opened before goes on.
    keep.request("GET", "/health")
    assert keep.getresponse().status == 200
    keep.close()

    # SIGHUP reloads at once (here nothing changed), and does not end the scheduler.
    p.p.send_signal(signal.SIGHUP)
    until(lambda: "reload (SIGHUP): unchanged" in p.output())
    assert p.alive() and "Traceback" not in p.output() and "PRIVATE" not in p.output()
