"""API keys for client traffic and a separate token for /metrics and /admin/*.

Keys are compared with hmac.compare_digest against every configured key (no early
exit on the first match), so the time taken does not reveal which key or how many
leading characters matched.
"""

from __future__ import annotations

import hmac
from pathlib import Path


def key_bytes(key: str) -> bytes:
    """A key or token as the bytes a client sends (the environment's non-UTF-8 bytes as given)."""
    try:
        return key.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate a YAML escape spelled: no client sends it
        return key.encode("utf-8", "surrogatepass")


def parse_keys(text: bytes) -> list[bytes]:
    """A key text's keys: one per line or comma-separated, '#' lines comments. One rule for the
    key file and --api-keys / ROUTER_API_KEYS: a Secret's "api-keys" text is either (the
    manifests handed it over as the variable; the chart mounts it as the file), and read by the
    file's old rule a comma-separated one was a single key that no client sends."""
    keys: list[bytes] = []
    for line in text.splitlines():
        if not line.lstrip().startswith(b"#"):
            keys += [k.strip() for k in line.split(b",") if k.strip()]
    return keys


class KeyFileError(Exception):
    """The key file could not be read (the message says why, never a key)."""


class KeyFileEmpty(KeyFileError):
    """The key file was read and holds no key."""


def read_key_file(path: str) -> list[bytes]:
    # Keys are compared as bytes (bearer_token): taken as bytes here too, as the file holds them.
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read api-key-file {path}: {exc.strerror or exc}") from None
    keys = parse_keys(text)
    if not keys:
        # Fail closed: a key file left empty (a Secret not filled in yet, a wrong mount, a file
        # half written) would run the gateway with no keys, open to every client.
        raise KeyFileEmpty(f"api-key-file {path} holds no key (one per line or comma-separated; "
                           "'#' lines are comments)")
    return keys


def inline_keys(inline: str) -> list[bytes]:
    """--api-keys / ROUTER_API_KEYS, as the environment gave them (surrogateescape): a byte that
    is not UTF-8 there stopped start-up with a traceback."""
    return parse_keys(key_bytes(inline))


def load_api_keys(path: str | None, inline: str = "") -> list[bytes]:
    """The keys at start-up: the inline ones, then the file's. A file that cannot be read or
    holds no key stops start-up."""
    keys = inline_keys(inline)
    if path:
        try:
            keys += read_key_file(path)
        except KeyFileError as exc:
            hint = ": give one, or leave the flag out to accept every client"
            raise SystemExit(f"error: {exc}{hint if isinstance(exc, KeyFileEmpty) else ''}") from None
    return keys


def bearer_token(header: str | None) -> bytes | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    # aiohttp decodes header bytes that are not UTF-8 to lone surrogates (surrogateescape): this
    # gives the client's bytes back, where a strict encode raised (a 500 on every request).
    return token.strip().encode("utf-8", "surrogateescape")


class KeyChecker:
    """Accepts a request when no keys are configured, or its Bearer token is one of them.

    `keys` is replaced whole (router/key_reload.py), never changed in place: a check reads one
    list, the old or the new, and a request already accepted is not checked again."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    def replace(self, keys: list[bytes]) -> None:
        self.keys = list(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def allows(self, authorization: str | None) -> bool:
        keys = self.keys
        if not keys:
            return True
        token = bearer_token(authorization)
        if token is None:
            return False
        ok = False
        for key in keys:
            ok |= hmac.compare_digest(token, key)
        return ok
