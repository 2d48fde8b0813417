"""A conversation's next turn takes the room its previous turn freed, ahead of requests
already queued in the gateway (scheduler --followup-hold-ms, scheduler/reservations.py).

Real processes: two sim workers (tiny profile: 1,024 tokens of KV each), the scheduler with
a low KV ceiling so that one long prompt saturates a worker, and the gateway."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.router.procs import start_gateway, start_scheduler, start_sim_workers

# ~250 tokens each: one such prompt takes a quarter of a tiny worker's KV.
FIRST_TURN = "Tell me about the history of the city of Lyon. " * 21
OTHER = "Describe how a steam engine turns heat into motion. " * 20
STRANGER = "List ten prime numbers and say why each is prime. " * 20


def chat(gw: str, messages: list[dict], max_tokens: int) -> httpx.Response:
    r = httpx.post(gw + "/v1/chat/completions", timeout=60,
                   json={"model": "m", "messages": messages, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r


def wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_follow_up_turn_passes_the_queue_into_its_own_freed_room():
    procs = []
    try:
        (w1, u1), (w2, u2) = start_sim_workers(2)
        procs += [w1, w2]
        params = {"max_kv_usage": 0.2, "output_fraction": 0.0, "max_waiting": 1}
        sched, su = start_scheduler([u1, u2], "--policy-params", json.dumps(params),
                                    "--followup-hold-ms", "3000", "--scrape-interval-ms", "50")
        procs.append(sched)
        gw_proc, gw = start_gateway("--scheduler", su, "--debug-headers", "--max-queue-size", "8",
                                    "--followup-pass-ms", "10000")
        procs.append(gw_proc)

        def leases() -> int:
            return sum(w["in_flight_leases"] for w in httpx.get(su + "/v1/workers").json()["workers"])

        def scraped_kv() -> list[float]:
            workers = httpx.get(su + "/v1/workers").json()["workers"]
            return [(w["snapshot"] or {}).get("kv_usage") or 0.0 for w in workers]

        def conversation() -> tuple[httpx.Response, httpx.Response]:
            first_msgs = [{"role": "user", "content": FIRST_TURN}]
            first = chat(gw, first_msgs, 60)
            answer = first.json()["choices"][0]["message"]["content"]
            follow = [*first_msgs, {"role": "assistant", "content": answer},
                      {"role": "user", "content": "And its food?"}]
            return first, chat(gw, follow, 40)

        with ThreadPoolExecutor(3) as ex:
            conv = ex.submit(conversation)
            wait_for(lambda: leases() == 1, "the first turn's lease")
            other = ex.submit(chat, gw, [{"role": "user", "content": OTHER}], 250)  # runs ~1.5 s
            wait_for(lambda: leases() == 2, "the other request's lease")
            # The stranger must find both workers past the KV ceiling in the scheduler's view:
            # wait for the scrapes that show it (a fixed pause was too short on a loaded machine,
            # and the stranger was placed instead of queued).
            wait_for(lambda: all(kv >= params["max_kv_usage"] for kv in scraped_kv()),
                     "scrapes showing both workers past the KV ceiling")
            stranger = ex.submit(chat, gw, [{"role": "user", "content": STRANGER}], 20)
            wait_for(lambda: httpx.get(gw + "/admin/state").json()["queued"] == 1, "the stranger to queue")
            first, follow_up = conv.result()
            late = stranger.result()
            other.result()

        # The follow-up went where its history is, though the stranger had queued first...
        assert follow_up.headers["x-router-worker"] == first.headers["x-router-worker"]
        reason = json.loads(follow_up.headers["x-router-reason"])
        assert reason["followup"] is True and reason["prefix_match"] >= 1
        assert float(follow_up.headers["x-router-queue-ms"]) < 200
        # ...and the stranger, queued before the follow-up was sent, was not given the room held
        # for it (it went wherever room freed otherwise). Not a duration: on a loaded machine
        # the other request can end soon after the stranger queued.
        assert not json.loads(late.headers["x-router-reason"]).get("followup")
        metrics = httpx.get(su + "/metrics").text
        assert 'scheduler_followup_reservations_total{outcome="claimed"} 1.0' in metrics
    finally:
        for p in procs:
            p.stop()
