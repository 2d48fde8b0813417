"""A request that names no model, as vLLM serves it: for the model the pool serves
(router/default_model.py). The gateway answered such a request 400 "'model' is required",
where the engine behind it (vLLM, or our worker) serves it."""

from __future__ import annotations

import json

import aiohttp
import httpx
import pytest
from aiohttp.test_utils import make_mocked_request

from router.default_model import NoDefaultModel, default_model
from router.request_checks import model_request
from tests.router.procs import sim_stack, start_gateway, start_sim_worker


def test_the_one_model_served_is_the_default():
    assert default_model(["m"]) == "m"


@pytest.mark.parametrize("body", [b'{"prompt": "x"}', b'{"model": "", "prompt": "x"}'])
def test_no_model_on_a_path_that_is_no_endpoint_is_a_wrong_path(body):
    request = make_mocked_request("POST", "/v1/nothing", headers={"Content-Type": "application/json"})
    assert model_request(request, "/v1/nothing", body) is None  # the caller answers 404
    request = make_mocked_request("POST", "/v1/completions", headers={"Content-Type": "application/json"})
    assert model_request(request, "/v1/completions", body).model is None  # the pool's model


@pytest.mark.parametrize(("served", "named"), [([], "no worker"), (["a", "b"], "'a', 'b'"),
                                               ([f"m{i}" for i in range(7)], "and 2 more")])
def test_no_default_where_the_pool_serves_several_models_or_none_is_known(served, named):
    with pytest.raises(NoDefaultModel, match="'model' is required") as exc:
        default_model(served)
    assert named in str(exc.value)


@pytest.fixture(scope="module")
def pool():
    """A scheduled gateway over a sim worker of model "m", and a gateway with static workers
    over it and a second worker of model "n"."""
    with sim_stack(1) as stack:
        other, other_url = start_sim_worker("n")
        static, static_url = start_gateway("--workers", ",".join([*stack.workers, other_url]))
        try:
            yield {"scheduled": stack.gateway, "worker": next(iter(stack.workers)), "two_models": static_url}
        finally:
            static.stop()
            other.stop()


@pytest.mark.parametrize("named", [{}, {"model": None}, {"model": ""}], ids=["absent", "null", "empty"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_without_a_model_is_served_as_the_engine_serves_it(pool, named, path):
    body = {"max_tokens": 3, **named}
    body.update({"prompt": "hello"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hello"}]})
    direct = httpx.post(pool["worker"] + path, json=body, timeout=30)
    assert direct.status_code == 200, direct.text  # what the client had without the gateway
    r = httpx.post(pool["scheduled"] + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "m" and r.json()["usage"]["completion_tokens"] == 3


def test_a_stream_without_a_model_is_streamed(pool):
    body = {"prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", pool["scheduled"] + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 2


async def test_a_websocket_whose_first_request_names_no_model_is_placed(pool):
    ws_url = pool["scheduled"] + "/v1/ws"
    async with aiohttp.ClientSession() as s, s.ws_connect(ws_url) as ws:
        await ws.send_str(json.dumps({"prompt": "hello", "max_tokens": 2}))
        answers = []
        while not answers or ("type" not in answers[-1] and "error" not in answers[-1]):
            msg = await ws.receive(timeout=30)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg
            answers.append(json.loads(msg.data))
    assert answers[-1]["type"] == "done", answers


def test_a_pool_of_several_models_asks_the_client_to_name_one(pool):
    r = httpx.post(pool["two_models"] + "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "model" and "'m', 'n'" in err["message"], err
    named = httpx.post(pool["two_models"] + "/v1/completions",
                       json={"model": "n", "prompt": "hello", "max_tokens": 2}, timeout=30)
    assert named.status_code == 200 and named.json()["model"] == "n"
