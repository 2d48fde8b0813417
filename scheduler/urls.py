"""What counts as a worker or scheduler URL: http(s), a host, a port in range.

Checked where a URL enters (flags, config files, registrations), so that a typo stops start-up
or is refused with a 400 instead of failing every scrape or call later.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from scheduler.clip import clip_repr


def http_url_problem(url: str) -> str | None:
    """Why `url` is not a usable http(s) base URL, or None when it is (naming it cut, clip.py:
    a registration's URL is a caller's)."""
    shown = clip_repr(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        return f"{shown} is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"{shown} does not start with http:// or https://"
    if not parts.hostname:
        return f"{shown} has no host"
    if parts.username is not None or parts.password is not None:
        # They would show in the worker's id (its host:port part), in /v1/workers, the logs
        # and the metrics' labels.
        return f"{shown} has credentials in it (user:password@), which a base URL must not hold"
    if parts.query or parts.fragment or url.rstrip("/").endswith(("?", "#")):
        # Paths are appended to a base URL: after a '?' or a '#' they are no path.
        return f"{shown} has a query or a fragment, which a base URL cannot have"
    if any(c.isspace() or not c.isprintable() for c in url):
        return f"{shown} has a space or a control character in it"
    if ":" not in parts.hostname:  # not an IPv6 literal: a name, which goes to DNS as IDNA
        # Why here: a host aiohttp cannot encode (a label over 63 characters, an empty one, a
        # lone surrogate) failed every scrape with a traceback in the log, never taking the
        # worker out (it is no connection error).
        try:
            parts.hostname.encode("idna")
        except UnicodeError as exc:
            return f"{shown} has an invalid host name ({exc})"
    return None
