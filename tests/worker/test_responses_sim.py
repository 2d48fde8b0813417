"""The Responses API of a sim worker (`python -m inference_worker --backend sim`, 127.0.0.1):
what OpenAI's API and its clients expect of it where a real model changes nothing. A stream
the worker cuts ends with OpenAI's `error` event; a next turn (`previous_response_id`) keeps
the system messages of the conversation's input, not its instructions."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai.types.responses import ResponseErrorEvent

from tests.worker.conftest import SIM_AVAILABLE, SIM_SKIP_REASON, Worker, launch_worker, sample, wait_for

pytestmark = pytest.mark.skipif(not SIM_AVAILABLE, reason=SIM_SKIP_REASON)

SIM = ("--backend", "sim", "--sim-profile", "tiny")
SLOW_SIM = (*SIM, "--time-scale", "5")


def _sse(worker: Worker, body: dict, started: threading.Event) -> list[tuple[str, dict]]:
    """A streamed POST /v1/responses as (event name, data) pairs."""
    events: list[tuple[str, dict]] = []
    name = ""
    with httpx.stream("POST", worker.api_url + "/responses", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                started.set()
    return events


@pytest.mark.parametrize("background", [False, True])
def test_a_stream_cut_by_the_worker_ends_with_openais_error_event(background) -> None:
    """Cut at the drain limit: the last event is an `error` whose `type` is "error" (the SDK
    picks the event's model by it) and whose sequence number follows the others'."""
    with launch_worker(*SLOW_SIM, "--shutdown-timeout", "1", model="m") as worker, \
            ThreadPoolExecutor(1) as pool:
        body = {"model": "m", "input": "cut me", "max_output_tokens": 400, "ignore_eos": True,
                "stream": True, "background": background}
        started = threading.Event()
        stream = pool.submit(_sse, worker, body, started)
        assert started.wait(30)
        worker.process.send_signal(signal.SIGTERM)
        events = stream.result(timeout=30)
    name, last = events[-1]
    assert name == "error"
    error = ResponseErrorEvent.model_validate(last)
    assert error.type == "error" and error.code == "shutting_down"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[-2][1]["type"] == "response.output_text.delta"  # it had streamed, not finished


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    with launch_worker(*SIM, model="m") as w:
        yield w


def _create(worker: Worker, **body: object) -> dict:
    r = httpx.post(worker.api_url + "/responses", json={"model": "m", "max_output_tokens": 3, **body},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] for part in item["content"])


def test_a_next_turn_keeps_the_inputs_system_messages_not_the_instructions(worker) -> None:
    system = {"role": "system", "content": "You answer like a pirate, always and everywhere."}
    first = _create(worker, instructions="Be brief.", input=[system, {"role": "user", "content": "hi"}])
    second = _create(worker, previous_response_id=first["id"], input="and then?")
    # The same conversation sent whole: the first turn's input and answer, then the new input.
    whole = _create(worker, input=[system, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": _text(first)},
                                   {"role": "user", "content": "and then?"}])
    assert second["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


@pytest.mark.parametrize("field", ["stream", "store", "background", "parallel_tool_calls", "service_tier",
                                   "tool_choice", "truncation"])
def test_an_option_set_to_null_takes_its_default(worker, field) -> None:
    """OpenAI's API (and its SDK's types) take null for each; a client that writes every field
    sends it."""
    default = _create(worker, input="hi")
    answer = _create(worker, input="hi", **{field: None})
    assert answer["status"] in ("completed", "incomplete")  # a whole answer: not streamed
    if field == "store":  # stored, the default
        assert httpx.get(f"{worker.api_url}/responses/{answer['id']}", timeout=10).status_code == 200
    elif field != "stream":
        assert answer[field] == default[field]


@pytest.mark.parametrize(("fields", "param", "named"), [
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens", "'max_output_tokens'"),
    ({"input": "word " * 2000}, "input", None),
    ({"input": "hi", "max_output_tokens": 3, "min_tokens": 50}, "min_tokens", "max_output_tokens (3)"),
])
@pytest.mark.parametrize("background", [False, True])
def test_a_400_names_the_responses_fields_not_the_chat_ones(worker, fields, param, named, background) -> None:
    r = httpx.post(worker.api_url + "/responses", json={"model": "m", **fields, "background": background},
                   timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert "max_tokens" not in error["message"] and "messages" not in error["message"]
    if named is not None:
        assert named in error["message"]


def test_a_deleted_response_is_gone_and_a_running_one_stopped_first(worker) -> None:
    url = worker.api_url + "/responses"
    finished = _finished(worker)  # so far
    done = _create(worker, input="hi")
    running = _create(worker, input="hi", max_output_tokens=400, ignore_eos=True, background=True)
    for response in (done, running):
        r = httpx.delete(f"{url}/{response['id']}", timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"id": response["id"], "object": "response", "deleted": True}
        assert httpx.get(f"{url}/{response['id']}", timeout=10).status_code == 404
        assert httpx.delete(f"{url}/{response['id']}", timeout=10).status_code == 404
        body = {"model": "m", "input": "and?", "previous_response_id": response["id"]}
        follow_up = httpx.post(url, json=body, timeout=10)
        assert follow_up.status_code == 404 and follow_up.json()["error"]["param"] == "previous_response_id"
    # The background answer was stopped, not left generating for nobody: freed, and (aborted,
    # as in vLLM) not counted as finished; only the first answer is.
    def freed() -> bool:
        samples = worker.metrics()
        running, waiting = (sample(samples, f"vllm:num_requests_{s}") for s in ("running", "waiting"))
        return running == waiting == 0

    wait_for(freed, 5, what="the background answer's abort")
    assert _finished(worker) == finished + 1


def _finished(worker) -> float:
    """Requests counted as finished, whatever their reason."""
    samples = worker.metrics()
    return sum(v for (name, _), v in samples.items() if name == "vllm:request_success_total")


@pytest.mark.parametrize(("items", "param"), [
    ([{"role": "user"}], "input.0.content"),
    ([{"role": "user", "content": [{"type": "input_text"}]}], "input.0.content.0.text"),
    ([{"role": "user", "content": 5}], "input.0.content"),
    ([{"role": "robot", "content": "hi"}], "input.0.role"),
    ({"role": "user", "content": "hi"}, "input"),
])
def test_a_malformed_input_item_is_a_400_naming_it(worker, items, param) -> None:
    """Not the first branch of the `str | list` union (`input.str: Input should be a valid
    string`, for an item that lacks a field)."""
    r = httpx.post(worker.api_url + "/responses", json={"model": "m", "input": items}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    assert "valid string" not in r.json()["error"]["message"]
