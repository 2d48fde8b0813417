"""Watching files that a running service re-reads when they change (the gateway's API-key file,
the three services' TLS certificates): their stat's identity, a polling loop and the tasks a
signal handler starts.

The stat follows symlinks: a Kubernetes Secret volume changes by swapping its `..data` symlink
to a new directory, which leaves the mounted path's own entry as it was but leads it to a file
with another inode. Stats and reads run in a thread, off the event loop.

The worker, which imports nothing of the scheduler, keeps a twin in
inference_worker/server/file_watch.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any


def stat_signature(path: str) -> tuple:
    """The identity of the file `path` leads to; raises OSError. Inode and device: a rename over
    the file, a swapped symlink; size and times: a rewrite in place; the ctime also moves on a
    chmod that makes an unreadable file readable."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def signatures(paths: Iterable[str]) -> tuple:
    """Each path's stat_signature, or the error that stopped the stat (a file that comes back
    then differs from its absence)."""
    out = []
    for path in paths:
        try:
            out.append(stat_signature(path))
        except OSError as exc:
            out.append(("error", exc.errno))
    return tuple(out)


async def poll_forever(period_s: float, check: Callable[[], Awaitable[None]], log: logging.Logger,
                       what: str) -> None:
    """Until cancelled: `check()` every `period_s`."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await check()
        except Exception:  # a bug there must not end the polling for good
            log.exception("%s check failed", what)


class SignalTasks:
    """Tasks started from a signal handler (SIGHUP), held until done: the loop keeps only a weak
    reference to a task."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
