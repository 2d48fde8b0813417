"""TLS contexts: serving HTTPS (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs,
named as vLLM's) and calling HTTPS peers with a private CA bundle and a client certificate.

Shared by the scheduler and the gateway (the router imports this package); the worker, which
imports nothing of the scheduler, keeps a twin in inference_worker/server/tls.py.

Every problem with the files (missing, unreadable, not PEM, a key that does not match its
certificate, a key behind a password) is a TlsError with one line that names the option and
the file, which start-up turns into `error: ...` and a non-zero exit instead of a traceback.
"""

from __future__ import annotations

import ssl
from typing import Any

# vLLM's --ssl-cert-reqs takes the ssl module's numbers; the names are accepted too.
CERT_REQS_NAMES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}

SERVER_HELP = {
    "ssl_certfile": "serve HTTPS with this PEM certificate (chain); its key in --ssl-keyfile or "
    "in the same file",
    "ssl_keyfile": "PEM private key of --ssl-certfile (unencrypted)",
    "ssl_ca_certs": "PEM bundle of the CAs whose client certificates are accepted (mutual TLS); "
    "with it a client certificate is required unless --ssl-cert-reqs says otherwise",
    "ssl_cert_reqs": "client certificates: 0/none (not asked for), 1/optional (checked when "
    "sent), 2/required (mutual TLS); default 2 with --ssl-ca-certs (a CA given for clients is "
    "used, where vLLM's default 0 ignores it), else 0",
}

CLIENT_HELP = {
    "ssl_client_certfile": "PEM client certificate presented to the https:// peers called that ask "
    "for one (their --ssl-ca-certs); its key in --ssl-client-keyfile or in the same file",
    "ssl_client_keyfile": "PEM private key of --ssl-client-certfile (unencrypted)",
}


RELOAD_HELP = ("seconds between looks at the TLS files (--ssl-certfile, --ssl-keyfile, "
               "--ssl-ca-certs, the client certificate and the CA bundles for peers; their stat, "
               "following symlinks: a Kubernetes Secret volume's swap is seen): changed files are "
               "loaded for new connections (open ones go on; the gateway's scheduler channel and "
               "its WebSockets to workers reconnect at their next call), files that do not load "
               "keep those in force and log an ERROR; SIGHUP re-reads them at once; 0: only on "
               "SIGHUP")


class TlsError(Exception):
    """A certificate, key or CA file that cannot be used; the message is one line."""


def cert_reqs_value(value: Any) -> Any:
    """--ssl-cert-reqs as vLLM's number, or by name (a before-validator)."""
    if isinstance(value, str) and value.strip().lower() in CERT_REQS_NAMES:
        return int(CERT_REQS_NAMES[value.strip().lower()])
    return value


def server_options_problem(certfile: str | None, keyfile: str | None, ca_certs: str | None,
                           cert_reqs: int | None) -> str | None:
    """Why these --ssl-* options do not go together, or None. Checked with the config, so that
    a half-given setting stops start-up instead of serving plain HTTP."""
    if not certfile:
        given = [name for name, v in (("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs),
                                      ("--ssl-cert-reqs", cert_reqs)) if v]
        if given:
            return f"{', '.join(given)} given without --ssl-certfile (HTTPS needs a certificate)"
        return None
    if cert_reqs and not ca_certs:
        return ("--ssl-cert-reqs asks for client certificates: give --ssl-ca-certs, the CAs they are "
                "checked against")
    return None


def client_options_problem(certfile: str | None, keyfile: str | None) -> str | None:
    if keyfile and not certfile:
        return "--ssl-client-keyfile given without --ssl-client-certfile"
    return None


def options_problem(cfg: Any) -> str | None:
    """What a config's model validator checks: its ssl_* fields (those it has) go together."""
    return (server_options_problem(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs, cfg.ssl_cert_reqs)
            or client_options_problem(getattr(cfg, "ssl_client_certfile", None),
                                      getattr(cfg, "ssl_client_keyfile", None)))


def _password_prompt() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key's password,
    # and a service started without one would hang there.
    raise TlsError("the key is encrypted (give an unencrypted key: there is no password option)")


def _reason(exc: BaseException, *, key_option: str | None = None) -> str:
    if isinstance(exc, TlsError):
        return str(exc)
    if isinstance(exc, ssl.SSLError):
        text = f"{exc.reason or ''} {exc}"
        # NO_CERTIFICATE_ASSIGNED: a key of another type than the certificate (ECDSA for RSA).
        if "KEY_VALUES_MISMATCH" in text or "NO_CERTIFICATE_ASSIGNED" in text:
            return "the key does not match the certificate"
        if "NO_CERTIFICATE_OR_CRL_FOUND" in text:
            return "no PEM certificate in it"
        if "PEM" in text or "NO_START_LINE" in text:
            if key_option:  # no key file: load_cert_chain looks for the key in the certificate's
                return f"not a PEM certificate followed by its private key (or give {key_option})"
            return "not a PEM certificate or key"
        if "CA_MD_TOO_WEAK" in text or "EE_KEY_TOO_SMALL" in text:
            return f"rejected by OpenSSL's security level ({exc.reason})"
        return exc.reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def load_chain(ctx: ssl.SSLContext, certfile: str, keyfile: str | None, what: str,
               shown: tuple[str, str | None] | None = None) -> None:
    """load_cert_chain, its failures a TlsError; `shown`: the files' names in that message, where
    the paths loaded are copies (tls_reload.py loads the bytes it checked)."""
    named_cert, named_key = shown or (certfile, keyfile)
    files = f"{what}certfile {named_cert}" + (f" / {what}keyfile {named_key}" if keyfile else "")
    try:
        ctx.load_cert_chain(certfile, keyfile or None, password=_password_prompt)
    except (OSError, TlsError) as exc:  # ssl.SSLError is an OSError
        reason = _reason(exc, key_option=None if keyfile else f"{what}keyfile")
        raise TlsError(f"cannot use {files}: {reason}") from None


def load_cas(ctx: ssl.SSLContext, cafile: str, option: str) -> None:
    try:
        ctx.load_verify_locations(cafile=cafile)
    except OSError as exc:
        raise TlsError(f"cannot use {option} {cafile}: {_reason(exc)}") from None


def server_context(certfile: str | None, keyfile: str | None = None, ca_certs: str | None = None,
                   cert_reqs: int | None = None) -> ssl.SSLContext | None:
    """The context a listening socket serves HTTPS with, or None (plain HTTP) without a cert."""
    if not certfile:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # TLS 1.2 and up, the ssl module's ciphers
    load_chain(ctx, certfile, keyfile, "--ssl-")
    if ca_certs:
        # Only this bundle: a client certificate from any public CA must not pass.
        load_cas(ctx, ca_certs, "--ssl-ca-certs")
        ctx.verify_mode = ssl.CERT_REQUIRED if cert_reqs is None else ssl.VerifyMode(cert_reqs)
    return ctx


def client_context(ca_file: str | None = None, certfile: str | None = None, keyfile: str | None = None,
                   *, ca_option: str = "--worker-ca-file",
                   shown: tuple[str | None, str | None, str | None] | None = None) -> ssl.SSLContext | None:
    """The context https:// peers are called with: verified against `ca_file` only when given
    (a private CA), else the system's CAs; presenting `certfile` to peers that ask for a client
    certificate. None: nothing given, the HTTP client's default (the system's CAs). Start-up
    and each reload (tls_reload.py) build it here, so that a reloaded one has the same settings;
    `shown`: the (CA, certificate, key) files' names in errors, where the paths are copies."""
    if not (ca_file or certfile):
        return None
    shown_ca, shown_cert, shown_key = shown or (ca_file, certfile, keyfile)
    try:
        # Hostname checked, certificate required. With a bundle, only it: a public CA must not
        # vouch for an internal peer.
        ctx = ssl.create_default_context(cafile=ca_file or None)
    except OSError as exc:
        raise TlsError(f"cannot use {ca_option} {shown_ca}: {_reason(exc)}") from None
    if certfile:
        load_chain(ctx, certfile, keyfile, "--ssl-client-", shown=(shown_cert or certfile, shown_key))
    return ctx


class PeerContext:
    """The context peers are called with now: start-up's, then the one each reload of its files
    builds (tls_reload.py's PeerTls swaps `current`; a context cannot unlearn a CA or a client
    certificate loaded into it). Callers read it for each connection they open (aiohttp's
    per-request ssl=), never keep it: connections opened after a reload use the new one, and
    those open go on with theirs. Those kept open indefinitely compare the context they were
    opened with to `current` (an identity check) and reconnect when it was replaced: the
    gateway's scheduler channel (router/sched_pipe.py) and WebSocket relays (router/ws_relay.py)."""

    __slots__ = ("current",)

    def __init__(self, current: ssl.SSLContext | None = None) -> None:
        self.current = current  # None: no CA bundle nor client certificate given

    @property
    def request_ssl(self) -> ssl.SSLContext | bool:
        """aiohttp's ssl= for a request: the context, or True, its default check against the
        system's CAs."""
        return self.current if self.current is not None else True


def scheme(ctx: ssl.SSLContext | None) -> str:
    return "https" if ctx is not None else "http"


def tls_failure(exc: BaseException) -> str | None:
    """A short reason when `exc` is an aiohttp client's TLS failure (the peer's certificate
    not trusted or not for its name, a peer that speaks plain HTTP), else None. Why: the class
    name alone ("ClientConnectorCertificateError") does not say which of those to fix."""
    import aiohttp  # here: the server side of this module needs no HTTP client

    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert_error = exc.certificate_error
        detail = getattr(cert_error, "verify_message", None) or getattr(cert_error, "reason", None)
        return f"TLS: certificate not accepted ({detail or cert_error})"
    if isinstance(exc, aiohttp.ClientSSLError):
        os_error = getattr(exc, "os_error", None)
        detail = getattr(os_error, "reason", None) or os_error or exc
        return f"TLS: {detail}"
    return None
