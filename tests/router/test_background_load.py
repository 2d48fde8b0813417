"""Background responses behind the gateway, with real processes (sim workers, the
scheduler, the gateway).

A background response is answered `queued` at once and goes on in the worker. Its lease is
handed off, not ended: the load stays counted until a scrape shows it in the worker's own
numbers. Ended at once, every request of a burst saw the same empty cluster and went to the
same worker (three workers, scraped only every 3 s, so that a whole burst falls between two
scrapes). And a replay of a background response waits for it, however long it is queued."""

from __future__ import annotations

import collections
import time

import httpx

from tests.router.procs import series_value, sim_stack


def test_a_burst_of_background_responses_spreads_over_the_workers():
    with sim_stack(3, scheduler_flags=("--scrape-interval-ms", "3000")) as stack:
        body = {"model": "m", "input": "summarise this", "max_output_tokens": 50, "background": True}
        placed = []
        for _ in range(12):
            r = httpx.post(stack.gateway + "/v1/responses", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["status"] == "queued"
            placed.append(r.headers["x-router-worker"])
        assert sorted(collections.Counter(placed).values()) == [4, 4, 4]
        handed_off = 'scheduler_lease_releases_total{outcome="handed_off"}'
        assert series_value(stack.scheduler, handed_off) == 12
        # A background stream whose client leaves: the worker goes on with it, so it is handed
        # off too (its tokens are not freed).
        stream = {**body, "stream": True, "max_output_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", stack.gateway + "/v1/responses", json=stream, timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 10
        while series_value(stack.scheduler, handed_off) < 13 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert series_value(stack.scheduler, handed_off) == 13


def test_a_replay_waits_for_a_response_queued_longer_than_the_first_byte_timeout():
    """A background response queued in a busy engine sends no event until it starts: its
    replay through the gateway waits for it (its client decides when to give up), rather than
    end at the first-byte timeout with an error."""
    with sim_stack(1, "--time-scale", "5", "--max-num-seqs", "1",
                   gateway_flags=("--first-byte-timeout-ms", "1000")) as stack:
        url = stack.gateway + "/v1/responses"
        busy = {"model": "m", "input": "long", "max_output_tokens": 100, "ignore_eos": True,
                "background": True}
        assert httpx.post(url, json=busy, timeout=30).status_code == 200  # ~3 s of decoding
        queued = httpx.post(url, json={**busy, "max_output_tokens": 5}, timeout=30).json()
        assert queued["status"] == "queued"
        with httpx.stream("GET", f"{url}/{queued['id']}", params={"stream": "true"}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"type":"response.completed"' in events[-1], events[-1]
