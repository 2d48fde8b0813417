"""What counts as a worker or scheduler URL: http(s), a host, a port in range.

Checked where a URL enters (flags, config files, registrations), so that a typo stops start-up
or is refused with a 400 instead of failing every scrape or call later.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def http_url_problem(url: str) -> str | None:
    """Why `url` is not a usable http(s) base URL, or None when it is."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        return f"{url!r} is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"{url!r} does not start with http:// or https://"
    if not parts.hostname:
        return f"{url!r} has no host"
    return None
