"""A port something listens on, for tests of the helpers that start a child on a port a
free_port() chose a moment before (tests/router/procs.py, tests/worker/conftest.py,
tests/deploy/stack.py): one taken meanwhile must cost a restart on another port, not the test."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def handed_out_first(port: int, real_free_port):
    """A free_port() that returns `port` once, then real free ports."""
    handed = iter([port])
    return lambda: next(handed, None) or real_free_port()
