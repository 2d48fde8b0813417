"""The OpenAI error shape for what aiohttp answers before any route runs, and one WARNING line
instead of an ERROR with a traceback: scheduler/http_errors.py (shared with the scheduler),
answered here with the gateway's error body (`code` is the status, as in its other errors)."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from router.errors import error_response
from scheduler.http_errors import OpenAIErrorAppRunner as _OpenAIErrorAppRunner

log = logging.getLogger("router.http")


class OpenAIErrorAppRunner(_OpenAIErrorAppRunner):
    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, answer=error_response, log=log, **kwargs)
