"""TLS options and contexts (scheduler/tls.py and its worker twin, inference_worker/server/tls.py):
files that cannot be used are one clear line, half-given options stop start-up, and the three
services' configs take the flags and their environment forms."""

from __future__ import annotations

import ssl
import subprocess

import pytest

from inference_worker.config import load_worker_config
from inference_worker.server import tls as worker_tls
from router.config import load_router_config
from scheduler import tls as scheduler_tls
from scheduler.config import load_scheduler_config
from scheduler.settings_loader import format_validation_error
from tests.tls_certs import Pki, client_cert, make_pki

TWINS = [scheduler_tls, worker_tls]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    client_cert(pki, "client-rsa", rsa=True)
    return pki


@pytest.mark.parametrize("tls", TWINS)
def test_server_context_with_and_without_client_certificates(tls, pki):
    assert tls.server_context(None) is None  # plain HTTP
    ctx = tls.server_context(str(pki.server_cert), str(pki.server_key))
    assert ctx.verify_mode == ssl.CERT_NONE
    ctx = tls.server_context(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    assert ctx.verify_mode == ssl.CERT_REQUIRED  # a CA for clients: their certificates required
    ctx = tls.server_context(str(pki.server_cert), str(pki.server_key), str(pki.ca), 1)
    assert ctx.verify_mode == ssl.CERT_OPTIONAL
    # The key in the certificate's file, as load_cert_chain allows.
    both = pki.server_cert.parent / "both.pem"
    both.write_text(pki.server_cert.read_text() + pki.server_key.read_text())
    assert tls.server_context(str(both)) is not None


@pytest.mark.parametrize("tls", TWINS)
def test_files_that_cannot_be_used_are_one_line(tls, pki, tmp_path):
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(pki.server_key), "-aes256", "-passout", "pass:x",
                    "-out", str(encrypted)], check=True, capture_output=True, timeout=60)
    cases = [
        ((str(tmp_path / "nope.pem"), str(pki.server_key)), "No such file or directory"),
        ((str(pki.server_cert), str(tmp_path / "nope.key")), "No such file or directory"),
        ((str(pki.server_cert), str(pki.client_key)), "the key does not match the certificate"),
        ((str(pki.ca.parent / "client-rsa.pem"), str(pki.client_key)),  # an ECDSA key, an RSA one's
         "the key does not match the certificate"),
        ((str(pki.server_cert), None), "not a PEM certificate followed by its private key"),
        ((str(pki.server_key), str(pki.server_key)), "not a PEM certificate or key"),
        ((str(pki.server_cert), str(encrypted)), "the key is encrypted"),
        ((str(pki.server_cert), str(pki.server_key), str(tmp_path / "nope-ca.pem")),
         "--ssl-ca-certs"),
        ((str(pki.server_cert), str(pki.server_key), str(pki.server_key)), "no PEM certificate in it"),
    ]
    for args, reason in cases:
        with pytest.raises(tls.TlsError) as info:
            tls.server_context(*args)
        assert reason in str(info.value) and "\n" not in str(info.value), (args, str(info.value))
        assert str(info.value).startswith("cannot use --ssl-")


@pytest.mark.parametrize("tls", TWINS)
def test_client_context_uses_only_the_bundle_given(tls, pki, tmp_path):
    assert tls.client_context() is None  # the HTTP client's default: the system's CAs, verified
    ctx = tls.client_context(str(pki.ca))
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1  # the private CA, not the system's as well
    ctx = tls.client_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(tls.TlsError, match=r"cannot use --x-ca-file .*No such file"):
        tls.client_context(str(tmp_path / "nope.pem"), ca_option="--x-ca-file")
    with pytest.raises(tls.TlsError, match=r"--ssl-client-certfile .* does not match"):
        tls.client_context(None, str(pki.client_cert), str(pki.server_key))


LOADERS = [("router", load_router_config, ["--workers", "http://127.0.0.1:1"]),
           ("scheduler", load_scheduler_config, []),
           ("worker", load_worker_config, [])]


@pytest.mark.parametrize(("service", "load", "base"), LOADERS)
def test_half_given_options_stop_start_up(service, load, base, capsys):
    for argv, said in [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile given without --ssl-certfile"),
        (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs given without --ssl-certfile"),
        (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "required"], "give --ssl-ca-certs"),
        (["--ssl-client-keyfile", "k.pem"], "--ssl-client-keyfile given without --ssl-client-certfile"),
        (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "3"], "ssl-cert-reqs"),
    ]:
        with pytest.raises(SystemExit) as info:
            load([*base, *argv])
        assert said in str(info.value), (service, argv, info.value)


@pytest.mark.parametrize(("service", "load", "base"), LOADERS)
def test_flags_and_environment(service, load, base, monkeypatch):
    cfg = load([*base, "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem",
                "--ssl-cert-reqs", "optional", "--ssl-client-certfile", "cc.pem"])
    assert (cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs) == ("c.pem", "k.pem", "ca.pem")
    assert cfg.ssl_cert_reqs == 1 and cfg.ssl_client_certfile == "cc.pem"
    cfg = load([*base, "--ssl-certfile", "c", "--ssl-ca-certs", "a", "--ssl-cert-reqs", "2"])
    assert cfg.ssl_cert_reqs == 2
    prefix = {"router": "ROUTER_", "scheduler": "SCHEDULER_", "worker": "WORKER_"}[service]
    monkeypatch.setenv(prefix + "SSL_CERTFILE", "env.pem")
    monkeypatch.setenv(prefix + "SSL_CERT_REQS", "none")
    cfg = load(base)
    assert cfg.ssl_certfile == "env.pem" and cfg.ssl_cert_reqs == 0
    ca_field = {"router": "worker_ca_file", "scheduler": "worker_ca_file", "worker": "scheduler_ca_file"}
    monkeypatch.setenv(prefix + ca_field[service].upper(), "private-ca.pem")
    assert getattr(load(base), ca_field[service]) == "private-ca.pem"


@pytest.mark.parametrize(("service", "load", "base"), LOADERS)
def test_the_reload_period(service, load, base, monkeypatch):
    """--ssl-reload-s: seconds between looks at the TLS files (tls_reload.py); 0: SIGHUP only."""
    assert load(base).ssl_reload_s == 5.0
    assert load([*base, "--ssl-reload-s", "0"]).ssl_reload_s == 0
    for wrong in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit) as info:
            load([*base, "--ssl-reload-s", wrong])
        assert "ssl-reload-s" in str(info.value) or "ssl_reload_s" in str(info.value), info.value
    prefix = {"router": "ROUTER_", "scheduler": "SCHEDULER_", "worker": "WORKER_"}[service]
    monkeypatch.setenv(prefix + "SSL_RELOAD_S", "0.5")
    assert load(base).ssl_reload_s == 0.5


def test_router_scheduler_ca_file():
    cfg = load_router_config(["--scheduler", "https://s:8090", "--scheduler-ca-file", "ca.pem"])
    assert cfg.scheduler_ca_file == "ca.pem" and cfg.worker_ca_file is None


def test_a_check_across_fields_does_not_echo_every_value(capsys):
    """Its input is every value given: an API key went to the logs with it."""
    from pydantic import ValidationError

    from router.config import RouterConfig

    with pytest.raises(ValidationError) as info:
        RouterConfig(api_keys="sk-secret", ssl_keyfile="k.pem", workers="http://127.0.0.1:1")
    line = format_validation_error(info.value)
    assert "--ssl-keyfile given without --ssl-certfile" in line and "sk-secret" not in line
