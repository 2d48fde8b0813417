"""benchmarks/ws_turns.py runs end to end (real echo workers, scheduler and gateways on
127.0.0.1) and every request on every socket is answered through each target."""

from __future__ import annotations

import argparse

from benchmarks.ws_turns import main_async


async def test_ws_turns_answers_every_request_through_every_target(tmp_path):
    args = argparse.Namespace(sockets=[2], requests=20, repeat=1, log_dir=str(tmp_path))
    rows = await main_async(args)
    assert [r["target"] for r in rows] == ["direct", "gateway round robin", "gateway + scheduler"]
    for row in rows:
        assert row["n"] == 20 and row["failed"] == 0, row
