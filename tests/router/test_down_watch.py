"""DownWatch: the answers waited for on a worker the scheduler reports down are given up when
it may be hung, and left to finish when its port refuses connections or it drains
(router/down_watch.py)."""

from __future__ import annotations

import pytest

from router.down_watch import DownWatch
from scheduler.protocol import CONNECTION_FAILED, DRAINING, REFUSED, UNRESPONSIVE


@pytest.mark.parametrize("cause", [UNRESPONSIVE, CONNECTION_FAILED, "failing", None])
async def test_a_worker_down_for_anything_but_a_refused_port_wakes_its_watchers(cause):
    """None: a scheduler older than down causes (or a cause unknown to it) means what "down"
    always meant here."""
    watch = DownWatch()
    with watch.watching("w0") as down, watch.watching("w1") as other:
        watch.update([("w0", "down", cause), ("w1", "up", None)])
        assert down.done() and not other.done()


@pytest.mark.parametrize("cause", [REFUSED, DRAINING])
async def test_a_worker_down_refused_or_draining_leaves_its_watchers_waiting(cause):
    """Its port closed, or it answers 503 `shutting_down` (router/draining.py): it finishes
    what it holds."""
    watch = DownWatch()
    with watch.watching("w0") as down:
        watch.update([("w0", "down", cause)])
        assert not down.done()
        watch.update([("w0", "down", UNRESPONSIVE)])  # then it went silent: it may hang them
        assert down.done()
