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


def _inline_keys(inline: str) -> list[str]:
    """--api-keys / ROUTER_API_KEYS: comma-separated, or a key file's text, one key per line
    and '#' lines comments (a Kubernetes Secret's key file handed over as this variable)."""
    keys: list[str] = []
    for line in inline.splitlines():
        if not line.lstrip().startswith("#"):
            keys += [k.strip() for k in line.split(",") if k.strip()]
    return keys


def load_api_keys(path: str | None, inline: str = "") -> list[bytes]:
    # Keys are compared as bytes (bearer_token): taken as bytes here too, as the file holds them
    # and as the environment gave them (surrogateescape). A byte that is not UTF-8, in the file
    # or in ROUTER_API_KEYS, stopped start-up with a traceback.
    keys = [key_bytes(k) for k in _inline_keys(inline)]
    if path:
        try:
            lines = Path(path).read_bytes().splitlines()
        except OSError as exc:
            raise SystemExit(f"error: cannot read api-key-file {path}: {exc}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.startswith(b"#")]
        if not from_file:
            # Fail closed: a key file left empty (a Secret not filled in yet, a wrong mount) ran
            # the gateway with no keys, open to every client, and said nothing.
            raise SystemExit(f"error: api-key-file {path} holds no key (one per line; '#' lines "
                             "are comments): give one, or leave the flag out to accept every client")
        keys += from_file
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
    """Accepts a request when no keys are configured, or its Bearer token is one of them."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def allows(self, authorization: str | None) -> bool:
        if not self.keys:
            return True
        token = bearer_token(authorization)
        if token is None:
            return False
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token, key)
        return ok
