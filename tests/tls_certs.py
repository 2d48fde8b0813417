"""A throwaway PKI for the TLS tests, made with the openssl CLI (the venv has no `cryptography`):
a CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and a second CA
that signed nothing the servers trust. Keys are ECDSA P-256, RSA 2048 where asked for."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate that signed server and client
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA nobody's certificate comes from
    other_cert: Path  # a client certificate from other_ca
    other_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str, *, rsa: bool = False) -> None:
    (d / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid:always\n" + ext)
    key = ["rsa:2048"] if rsa else ["ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    _openssl("req", "-newkey", *key, "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def server_cert(pki: Pki, name: str, *, other_ca: bool = False) -> tuple[Path, Path]:
    """Another server certificate for 127.0.0.1 and localhost (a renewal: CN=`name`), from the
    CA or from the other CA; its certificate and key files."""
    d = pki.ca.parent
    _leaf(d, name, "other-ca" if other_ca else "ca", "extendedKeyUsage=serverAuth,clientAuth\n"
          "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    return d / f"{name}.pem", d / f"{name}.key"


def client_cert(pki: Pki, name: str, *, rsa: bool = False) -> tuple[Path, Path]:
    """Another client certificate from the CA (CN=`name`), with an RSA key if `rsa`; its
    certificate and key files."""
    d = pki.ca.parent
    _leaf(d, name, "ca", "extendedKeyUsage=clientAuth\n", rsa=rsa)
    return d / f"{name}.pem", d / f"{name}.key"


def make_pki(d: Path) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI makes the test certificates")
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "extendedKeyUsage=serverAuth,clientAuth\n"
          "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "other", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(ca=d / "ca.pem", server_cert=d / "server.pem", server_key=d / "server.key",
               client_cert=d / "client.pem", client_key=d / "client.key", other_ca=d / "other-ca.pem",
               other_cert=d / "other.pem", other_key=d / "other.key")


def der(path: Path) -> bytes:
    """A PEM certificate file's DER bytes (what a TLS peer is sent)."""
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def not_after(path: Path) -> float:
    """A certificate file's end, in seconds since the epoch."""
    return float(ssl.cert_time_to_seconds(ssl._ssl._test_decode_cert(str(path))["notAfter"]))


def replace(src: Path, dst: Path) -> None:
    """As an operator's tooling renews a file: written beside it, renamed over it."""
    tmp = dst.with_name(dst.name + ".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
