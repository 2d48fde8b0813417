"""Hot reload of the TLS files: a renewed certificate (cert-manager rewrites its Secret before
expiry, the kubelet swaps the mounted volume) takes effect without a restart.

The files are polled every --ssl-reload-s (their stat, following symlinks, off the event loop;
scheduler/file_watch.py) and re-read at once on SIGHUP. What changes:

- The served certificate, its key and --ssl-ca-certs are loaded into a fresh context, which new
  handshakes switch to in the served context's SNI callback (OpenSSL calls it on every
  ClientHello, with a server name or without). Connections already open go on with the one they
  started with. Not load_cert_chain on the served context itself: a context holds one
  certificate per key type, so an ECDSA certificate replacing an RSA one would leave the old
  one served to clients that prefer RSA; load_verify_locations only adds, so a CA taken out of
  --ssl-ca-certs would stay trusted; and a load that fails half-way (a key that does not match)
  leaves that context with no key, so that every handshake fails.
- A context that peers are called with (the client certificate, the CA bundle it checks them
  against) is built afresh from the files, off the event loop, by the builder start-up used
  (tls.py's client_context: the same settings), and put in its PeerContext, which the HTTP
  clients read for each connection they open. So a CA taken out of the bundle stops vouching
  for a peer, and a client certificate of another key type (RSA, then ECDSA) replaces the old
  one, from the next connection. Connections already open go on with the context they started
  with (aiohttp keys its pool by the context: those of the old one are not reused, and close
  once idle), but none is kept for long: the gateway's pipelined channel to the scheduler
  (router/sched_pipe.py), which never closes when idle, moves to a new connection at its next
  call (the calls in flight on the old one are answered there), and a client's WebSocket
  relayed to a worker (router/ws_relay.py) opens a new one at its next request. Not loaded
  into the context in use: load_verify_locations only adds CAs, and
  load_cert_chain keeps a certificate of another key type beside the new one.

Fail safe: files that do not load (half written, a key that does not match its certificate,
missing) keep what is in force and log one ERROR, until they change again; files that changed
while they were read are read again at the next poll. Each load logs the certificate's subject,
names, serial and expiry, never key material; `<prefix>_tls_certificate_expiry_seconds` tells
when the certificates in use expire, for alerting.

The worker, which imports nothing of the scheduler, keeps a twin in
inference_worker/server/tls_reload.py (tests/scheduler/test_tls_reload.py keeps them alike).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import logging
import os
import ssl
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.file_watch import SignalTasks, poll_forever, signatures
from scheduler.tls import PeerContext, TlsError, client_context, server_context

log = logging.getLogger("tls")

RESULTS = ("reloaded", "unchanged", "failed")
# The ssl module's own certificate decoder: subject and expiry without `cryptography`.
_decode_cert = getattr(ssl._ssl, "_test_decode_cert", None)  # type: ignore[attr-defined]
_SHORT = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
          "countryName": "C", "stateOrProvinceName": "ST", "localityName": "L"}


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What the logs and the expiry gauge say of a certificate."""

    subject: str
    names: tuple[str, ...]  # subjectAltName entries
    serial: str
    not_after: float | None  # Unix time

    def __str__(self) -> str:
        expires = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.not_after))
                   if self.not_after is not None else "unknown")
        names = f" [{', '.join(self.names)}]" if self.names else ""
        return f"subject {self.subject or '(empty)'}{names}, serial {self.serial}, expires {expires}"


def describe(certfile: str) -> CertInfo | None:
    """The first certificate of a PEM file (the leaf), or None where it cannot be decoded."""
    if _decode_cert is None:
        return None
    try:
        cert = _decode_cert(certfile)
        not_after = float(ssl.cert_time_to_seconds(cert["notAfter"])) if "notAfter" in cert else None
    except (OSError, ValueError):
        return None
    subject = ",".join(f"{_SHORT.get(k, k)}={v}" for rdn in cert.get("subject", ()) for k, v in rdn)
    names = tuple(f"{kind}:{value}" for kind, value in cert.get("subjectAltName", ()))
    return CertInfo(subject, names, cert.get("serialNumber", ""), not_after)


def _read(files: list[tuple[str, str]]) -> list[bytes]:
    """Each (option, path)'s bytes; a file that cannot be read is a TlsError naming its option."""
    out = []
    for option, path in files:
        try:
            out.append(Path(path).read_bytes())
        except OSError as exc:
            raise TlsError(f"cannot use {option} {path}: {exc.strerror or exc}") from None
    return out


@contextlib.contextmanager
def _in_memory(datas: list[bytes]) -> Iterator[list[str]]:
    """Paths that read back `datas`: OpenSSL loads from paths, and what is loaded must be the
    bytes that were checked, whatever the files hold by then. Memory files where Linux has them
    (no copy of a key on a disk), else a private temporary folder."""
    with contextlib.ExitStack() as stack:
        paths = []
        if hasattr(os, "memfd_create"):
            for data in datas:
                fd = os.memfd_create("tls", os.MFD_CLOEXEC)
                stack.callback(os.close, fd)
                with open(fd, "wb", closefd=False) as f:
                    f.write(data)
                paths.append(f"/proc/self/fd/{fd}")
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))  # mode 0700
            for i, data in enumerate(datas):
                (folder / str(i)).write_bytes(data)
                paths.append(str(folder / str(i)))
        yield paths


@dataclass(frozen=True, slots=True)
class _Loaded:
    digest: bytes  # of the files' bytes: the same files written again change nothing
    info: CertInfo | None
    ready: Any  # what apply() puts in force


class _Target(abc.ABC):
    """One context and the files it is loaded from."""

    kind: str  # the expiry gauge's `certificate` label
    label: str  # the logs'

    def __init__(self, files: list[tuple[str, str | None]], certfile: str | None) -> None:
        self.files = [(option, path) for option, path in files if path]
        self.certfile = certfile
        self.seen: tuple | None = None  # the signatures last handled (None: load at the next look)
        self.digest: bytes | None = None  # the files in force (None: those start-up loaded)
        self.info: CertInfo | None = None

    @property
    def paths(self) -> list[str]:
        return [path for _, path in self.files]

    def by_option(self, values: list) -> dict[str, Any]:
        """`values`, one for each file, by its option."""
        return dict(zip((option for option, _ in self.files), values, strict=True))

    @abc.abstractmethod
    def load(self) -> _Loaded:
        """In a thread: the files read and checked; raises TlsError."""

    @abc.abstractmethod
    def apply(self, loaded: _Loaded) -> None:
        """On the event loop: `loaded` in force for new connections (a swap, which cannot fail)."""


def _digest(datas: Iterable[bytes]) -> bytes:
    h = hashlib.sha256()
    for data in datas:
        h.update(len(data).to_bytes(8, "big") + data)
    return h.digest()


class ServedTls(_Target):
    kind = "served"
    label = "TLS served certificate"

    def __init__(self, front: ssl.SSLContext, certfile: str, keyfile: str | None, ca_certs: str | None,
                 cert_reqs: int | None) -> None:
        super().__init__([("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile),
                          ("--ssl-ca-certs", ca_certs)], certfile)
        self.keyfile, self.ca_certs, self.cert_reqs = keyfile, ca_certs, cert_reqs
        self.front = front  # the listening sockets' context: every handshake starts on it
        self.current = front
        front.sni_callback = self._switch

    def _switch(self, conn: ssl.SSLObject, _server_name: str | None, _front: ssl.SSLContext) -> None:
        if self.current is not self.front:
            conn.context = self.current  # its certificate, key and client CAs for this handshake

    def load(self) -> _Loaded:
        # A context nobody uses yet: built here, off the event loop, without a lock.
        ctx = server_context(self.certfile, self.keyfile, self.ca_certs, self.cert_reqs)
        assert ctx is not None
        return _Loaded(_digest(_read(self.files)), describe(self.certfile), ctx)

    def apply(self, loaded: _Loaded) -> None:
        self.current = loaded.ready


class PeerTls(_Target):
    kind = "client"

    def __init__(self, peer: PeerContext, peers: str, ca_file: str | None, ca_option: str,
                 certfile: str | None, keyfile: str | None) -> None:
        super().__init__([(ca_option, ca_file), ("--ssl-client-certfile", certfile),
                          ("--ssl-client-keyfile", keyfile)], certfile)
        self.peer, self.label = peer, f"TLS context for calling {peers}"
        self.ca_file, self.ca_option, self.keyfile = ca_file, ca_option, keyfile

    def load(self) -> _Loaded:
        # A context nobody uses yet, built as start-up built the first one.
        datas = _read(self.files)
        with _in_memory(datas) as copies:
            by_option = self.by_option(copies)
            ctx = client_context(by_option.get(self.ca_option), by_option.get("--ssl-client-certfile"),
                                 by_option.get("--ssl-client-keyfile"), ca_option=self.ca_option,
                                 shown=(self.ca_file, self.certfile, self.keyfile))
            info = describe(by_option["--ssl-client-certfile"]) if self.certfile else None
        assert ctx is not None  # a target has a CA bundle or a client certificate
        return _Loaded(_digest(datas), info, ctx)

    def apply(self, loaded: _Loaded) -> None:
        self.peer.current = loaded.ready  # for the connections opened from now on


@dataclass(frozen=True, slots=True)
class _Look:
    """What one look at a target's files found."""

    signature: tuple
    loaded: _Loaded | None = None  # None: not loaded (unchanged), or `error`
    error: str | None = None
    settled: bool = True  # False: the files changed while they were read


def _look(target: _Target, force: bool) -> _Look:
    """Runs in a thread: the stats, and the load when they changed (or `force`)."""
    before = signatures(target.paths)
    if before == target.seen and not force:
        return _Look(before)
    try:
        loaded = target.load()
    except TlsError as exc:
        return _Look(before, error=str(exc))
    return _Look(before, loaded, settled=signatures(target.paths) == before)


class TlsReloader:
    """Keeps each target's context on its files' latest good load."""

    def __init__(self, targets: list[_Target]) -> None:
        self.targets = targets
        self.counts = dict.fromkeys(RESULTS, 0)
        self._lock = asyncio.Lock()  # a SIGHUP and a poll do not load two versions crosswise
        self._sighup_tasks = SignalTasks()

    async def start(self) -> None:
        """Loads the files as they are now (they may have changed since start-up read them) and
        logs the certificates in use."""
        await self.check(force=True, why="start")

    async def poll(self, period_s: float) -> None:
        await poll_forever(period_s, lambda: self.check(force=False, why="file changed"), log, "TLS files")

    def on_sighup(self) -> None:
        self._sighup_tasks.spawn(self.check(force=True, why="SIGHUP"))

    async def check(self, force: bool, why: str) -> None:
        async with self._lock:
            for target in self.targets:
                await self._check(target, force, why)

    async def _check(self, target: _Target, force: bool, why: str) -> None:
        look = await asyncio.to_thread(_look, target, force)
        if look.signature == target.seen and not force:
            return
        if look.loaded is not None and not look.settled:
            # Being written: left as not seen, so the next poll loads them again.
            log.log(logging.INFO if force else logging.DEBUG, "%s: the files changed while they "
                    "were read (%s): read again at the next poll", target.label, why)
            return
        target.seen = look.signature
        if look.loaded is None:
            self.counts["failed"] += 1
            kept = f" ({target.info})" if target.info else ""
            log.error("%s: reload (%s) failed, the one in force%s is kept: %s", target.label, why, kept,
                      look.error)
            return
        if look.loaded.digest == target.digest:
            self.counts["unchanged"] += 1
            log.log(logging.INFO if force else logging.DEBUG, "%s: reload (%s): unchanged",
                    target.label, why)
            return
        target.apply(look.loaded)  # a context built and checked by load(): cannot fail
        if why != "start":
            self.counts["reloaded"] += 1
        target.digest, target.info = look.loaded.digest, look.loaded.info
        files = ", ".join(f"{option} {path}" for option, path in target.files)
        log.info("%s %s (%s): %s%s", target.label, "in use" if why == "start" else "reloaded", why,
                 files, f": {target.info}" if target.info else "")

    def collector(self, prefix: str) -> TlsCollector:
        return TlsCollector(self, prefix)


class TlsCollector:
    """`<prefix>_tls_certificate_expiry_seconds` and `<prefix>_tls_reloads_total`, read from the
    reloader at each scrape."""

    def __init__(self, reloader: TlsReloader, prefix: str) -> None:
        self.reloader, self.prefix = reloader, prefix

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        expiry = GaugeMetricFamily(
            f"{self.prefix}_tls_certificate_expiry_seconds",
            "When the TLS certificate in use expires (Unix time), by certificate: served "
            "(--ssl-certfile) or client (--ssl-client-certfile); a renewal is loaded within "
            "--ssl-reload-s", labels=["certificate"])
        soonest: dict[str, float] = {}
        for target in self.reloader.targets:
            if target.info is not None and target.info.not_after is not None:
                soonest[target.kind] = min(soonest.get(target.kind, target.info.not_after),
                                           target.info.not_after)
        for kind, not_after in sorted(soonest.items()):
            expiry.add_metric([kind], not_after)
        yield expiry
        reloads = CounterMetricFamily(
            f"{self.prefix}_tls_reloads", "Loads of changed TLS files (their stat changed, or "
            "SIGHUP) by result: reloaded (in force for new connections), unchanged, failed (the "
            "files did not load: those in force kept)", labels=["result"])
        for result in RESULTS:
            reloads.add_metric([result], self.reloader.counts[result])
        yield reloads


def tls_reloader(cfg: Any, served: ssl.SSLContext | None,
                 peers: Iterable[tuple[str, PeerContext, str | None, str]]) -> TlsReloader | None:
    """The reloader of a service's contexts (None: no TLS file to watch). `cfg` has the ssl_*
    options; `peers`: (whom it calls, the context it calls them with, its CA bundle, that
    bundle's option)."""
    targets: list[_Target] = []
    if served is not None:
        targets.append(ServedTls(served, cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs,
                                 cfg.ssl_cert_reqs))
    for name, peer, ca_file, ca_option in peers:
        if peer.current is not None:  # else nothing given: the HTTP client's own default
            targets.append(PeerTls(peer, name, ca_file, ca_option, cfg.ssl_client_certfile,
                                   cfg.ssl_client_keyfile))
    return TlsReloader(targets) if targets else None
