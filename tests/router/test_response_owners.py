"""How the gateway looks for the worker that stores a response it has not seen
(router/stored_responses.py), against small HTTP servers on 127.0.0.1 that answer
`GET /v1/responses/{id}` as a worker does and count the GETs: concurrent lookups of one id
share one round of probes, and an id nobody holds is not asked about again at once."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router import stored_responses
from router.stored_responses import ResponseOwners
from scheduler.tls import PeerContext

NO_TLS = PeerContext()  # the workers here serve http://

STORED = "resp_stored"


class ProbedWorker:
    """Stores STORED when `holds`; answers each GET after `delay_s`, counting them by id."""

    def __init__(self, holds: bool, delay_s: float = 0.05) -> None:
        self.holds = holds
        self.delay_s = delay_s
        self.gets: Counter[str] = Counter()
        app = web.Application()
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        self.server = TestServer(app, host="127.0.0.1")

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        self.gets[response_id] += 1
        await asyncio.sleep(self.delay_s)
        if self.holds and response_id == STORED:
            return web.json_response({"id": STORED, "usage": {"input_tokens": 7, "output_tokens": 3}})
        return web.json_response({"error": {"message": "not found"}}, status=404)


@pytest.fixture
async def cluster():
    workers = [ProbedWorker(holds=False), ProbedWorker(holds=True), ProbedWorker(holds=False)]
    for w in workers:
        await w.server.start_server()
    async with aiohttp.ClientSession() as session:
        pairs = [(f"w{i}", str(w.server.make_url("")).rstrip("/")) for i, w in enumerate(workers)]
        yield workers, pairs, session
    for w in workers:
        await w.server.close()


async def test_concurrent_lookups_of_one_id_share_one_round_of_probes(cluster):
    workers, pairs, session = cluster
    owners = ResponseOwners()
    found = await asyncio.gather(*(owners.locate(STORED, pairs, session, NO_TLS, {}) for _ in range(20)))
    assert {o.worker_id for o in found} == {"w1"} and found[0].tokens == 10
    # One GET per worker at most (the others' probes may be cut once the owner answered).
    assert all(w.gets[STORED] <= 1 for w in workers) and workers[1].gets[STORED] == 1
    assert owners.get(STORED) == found[0]


async def test_an_id_nobody_holds_is_not_asked_about_again_at_once(cluster, monkeypatch):
    workers, pairs, session = cluster
    monkeypatch.setattr(stored_responses, "MISSING_TTL_S", 0.3)
    owners = ResponseOwners()
    missing = await asyncio.gather(*(owners.locate("resp_nobody", pairs, session, NO_TLS, {})
                                     for _ in range(20)))
    assert missing == [None] * 20
    assert [w.gets["resp_nobody"] for w in workers] == [1, 1, 1]
    for _ in range(5):  # a client polling it
        assert await owners.locate("resp_nobody", pairs, session, NO_TLS, {}) is None
    assert [w.gets["resp_nobody"] for w in workers] == [1, 1, 1]
    # Once the time is up, it is asked about again.
    await asyncio.sleep(0.3)
    assert await owners.locate("resp_nobody", pairs, session, NO_TLS, {}) is None
    assert [w.gets["resp_nobody"] for w in workers] == [2, 2, 2]


async def test_a_caller_that_goes_away_does_not_stop_the_others_lookup(cluster):
    workers, pairs, session = cluster
    for w in workers:
        w.delay_s = 0.3
    owners = ResponseOwners()
    leaving = asyncio.ensure_future(owners.locate(STORED, pairs, session, NO_TLS, {}))
    staying = asyncio.ensure_future(owners.locate(STORED, pairs, session, NO_TLS, {}))
    await asyncio.sleep(0.05)
    leaving.cancel()
    owner = await staying
    assert owner is not None and owner.worker_id == "w1"
    assert workers[1].gets[STORED] == 1


def test_a_lost_response_is_remembered_as_lost_not_owned_and_the_oldest_go_first(monkeypatch):
    """mark_lost: the owner is forgotten and the loss remembered (what every later call on the
    id answers), at most MAX_LOST of them; a response learnt again is owned again."""
    monkeypatch.setattr(stored_responses, "MAX_LOST", 2)
    owners = ResponseOwners()
    owners.learn("resp_a", "w1", "http://w1", 10)
    lost = owners.mark_lost("resp_a", "w1", stored_responses.DROPPED)
    assert owners.get("resp_a") is None and owners.lost("resp_a") == lost
    assert "lost with worker 'w1'" in stored_responses.lost_message("resp_a", lost)
    owners.mark_lost("resp_b", "w1", stored_responses.LEFT)
    owners.mark_lost("resp_c", "w2", stored_responses.LEFT)
    assert owners.lost("resp_a") is None and owners.lost("resp_c") is not None
    owners.learn("resp_c", "w3", "http://w3")
    assert owners.lost("resp_c") is None and owners.get("resp_c").worker_id == "w3"
