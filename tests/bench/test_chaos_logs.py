"""The chaos soak's reading of the gateways' logs (benchmarks/chaos_logs.py), on lines in the
gateway's own formats (router/access_log.py, router/proxy.py, router/scheduling.py)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from benchmarks.chaos_logs import GatewayLogs, log_lines_for

LINES = """\
2026-11-27 16:04:10,550 WARNING router.scheduling: scheduler unreachable (...); retrying every 500 ms
2026-11-27 16:04:15,550 WARNING router.scheduling: fallback mode ON: round robin over 4 known workers
2026-11-27 16:04:16,443 INFO router.proxy: id=chaos-x-12 worker 127.0.0.1:42631 failed before the first \
byte (connection: ServerDisconnectedError('Server disconnected')); retrying
2026-11-27 16:04:18,850 WARNING router.scheduling: fallback mode OFF: scheduler answers again (down 8.3 s)
2026-11-27 16:04:19,607 INFO router.access: id=chaos-x-12 POST /v1/chat/completions model=llama2 \
worker=127.0.0.1:59147 status=200 stream=1 queue_ms=3731.2 ttft_ms=6721.8 e2e_ms=7784.3 tokens_in=1784 \
tokens_out=24 retries=1
2026-11-27 16:04:19,700 INFO router.access: id=chaos-x-1 POST /v1/chat/completions model=llama2 \
worker=127.0.0.1:59147 status=200 stream=0 queue_ms=1.0 ttft_ms=- e2e_ms=700.0 tokens_in=10 \
tokens_out=2 retries=0
"""


def test_retries_and_switches_land_on_the_runs_clock(tmp_path: Path):
    (tmp_path / "gateway.log").write_text(LINES)
    zero = datetime(2026, 11, 27, 16, 4, 0).timestamp()  # local time, as the services log it
    logs = GatewayLogs(tmp_path, zero)
    assert logs.retries == {"chaos-x-12": 1, "chaos-x-1": 0}
    [retry] = logs.retry_lines
    assert (retry.request_id, retry.worker, retry.reason) == ("chaos-x-12", "127.0.0.1:42631", "connection")
    assert abs(retry.at_s - 16.443) < 1e-6
    assert logs.retried_away("127.0.0.1:42631", 16, 17) == {"connection": 1}
    assert logs.retried_away("127.0.0.1:42631", 17, 30) == {}
    assert [(round(s.at_s, 2), s.on) for s in logs.switched(0, 30)] == [(15.55, True), (18.85, False)]


def test_a_requests_lines_are_found_by_its_id_and_not_by_a_longer_one(tmp_path: Path):
    (tmp_path / "gateway.log").write_text(LINES)
    found = log_lines_for(tmp_path, ["chaos-x-1"])
    assert len(found["chaos-x-1"]) == 1 and "id=chaos-x-1 " in found["chaos-x-1"][0]


# The two access lines of LINES: a request that looked for a worker 3.7 s, and one that did not.
HELD = "".join(LINES.splitlines(keepends=True)[-2:])


def test_the_requests_held_at_an_instant_are_known_by_id_and_by_gateway(tmp_path: Path):
    (tmp_path / "gateway.log").write_text(HELD)
    (tmp_path / "gateway1.log").write_text(HELD.split("\n", 1)[1])  # chaos-x-1 again, on gateway1
    logs = GatewayLogs(tmp_path, datetime(2026, 11, 27, 16, 4, 0).timestamp())
    # chaos-x-12 began at 19.607 - 7.784 = 11.823 s and looked for a worker for 3.731 s.
    assert [a.request_id for a in logs.held_at(12.0)] == ["chaos-x-12"]
    assert logs.held_at(11.7) == [] and logs.held_at(15.6) == []
    assert logs.held_at(19.5) == []  # chaos-x-1's 1 ms is a schedule call answered at once
    twice = logs.answered_twice()
    assert list(twice) == ["chaos-x-1"] and sorted(a.gateway for a in twice["chaos-x-1"]) == [0, 1]
