"""The Responses API (`POST /v1/responses`) of a real `python -m inference_worker` (real model,
127.0.0.1), driven by the official `openai` client: the answer is the chat answer of the same
conversation, streamed in vLLM's event order, with its usage; a stored answer is continued by
`previous_response_id` and returned by GET; a background response is answered later, can be
streamed again from where a client left off, and cancelled; what it does not serve is a 400."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.worker.conftest import sample, wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2"
INSTRUCTIONS = "Answer in one word."
QUESTION = "Name a fruit."


@pytest.fixture(scope="module")
def client(shared_torch_worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_torch_worker.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_answer(client) -> openai.types.chat.ChatCompletion:
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)


def test_a_response_is_the_chat_answer_of_the_same_conversation(client, chat_answer) -> None:
    r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                max_output_tokens=10, temperature=0)
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
    assert r.output_text == chat_answer.choices[0].message.content
    assert r.usage.input_tokens == chat_answer.usage.prompt_tokens
    assert r.usage.output_tokens == chat_answer.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finished_by_length = chat_answer.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if finished_by_length else "completed")
    if finished_by_length:
        assert r.incomplete_details.reason == "max_output_tokens"
    # The same conversation as input items with text parts.
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    again = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=items,
                                    max_output_tokens=10, temperature=0)
    assert again.output_text == r.output_text


def test_a_streamed_response_has_vllms_events_and_the_same_text(client, chat_answer) -> None:
    events = list(client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == chat_answer.choices[0].message.content == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == chat_answer.usage.completion_tokens
    assert events[0].response.status == "in_progress" and events[0].response.usage is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"background": True, "store": False}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0.type"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "other"}, "model"),
    ],
)
def test_what_the_worker_does_not_serve_is_a_400_naming_it(shared_torch_worker, fields, param) -> None:
    body = {"model": MODEL, "input": "hi", **fields}
    r = httpx.post(shared_torch_worker.api_url + "/responses", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


def test_previous_response_id_continues_the_stored_conversation(client) -> None:
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                    max_output_tokens=10, temperature=0)
    follow_up = "And a vegetable?"
    second = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=follow_up,
                                     previous_response_id=first.id, max_output_tokens=10, temperature=0)
    assert second.previous_response_id == first.id
    # The same as the chat of the whole conversation: instructions, first turn, its answer, input.
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": follow_up}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # Both are kept, as they were answered.
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_a_streamed_response_is_stored_too(client) -> None:
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5,
                                          temperature=0, stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_what_is_not_stored_is_a_404_and_a_stored_response_cannot_be_cancelled(client) -> None:
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(unstored.id)
    assert caught.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="more", previous_response_id=unstored.id)
    assert caught.value.body["message"] == f"Response with id '{unstored.id}' not found."
    assert caught.value.body["param"] == "previous_response_id"
    stored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_response_ids_are_unique_whatever_the_callers_request_id(shared_torch_worker) -> None:
    """A client that sends one X-Request-Id for a whole session must not have its stored
    responses overwrite each other."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 2}
    ids = [httpx.post(shared_torch_worker.api_url + "/responses", json=body, timeout=60,
                      headers={"X-Request-Id": "session-7"}).json()["id"] for _ in range(2)]
    assert ids[0] != ids[1]
    for response_id in ids:
        stored = httpx.get(f"{shared_torch_worker.api_url}/responses/{response_id}", timeout=10)
        assert stored.status_code == 200


def _status(client: openai.OpenAI, response_id: str) -> str:
    return client.responses.retrieve(response_id).status


def test_a_background_response_is_queued_and_completes_with_the_synchronous_answer(client) -> None:
    synchronous = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=10, temperature=0)
    queued = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                     max_output_tokens=10, temperature=0, background=True)
    assert queued.background is True and queued.output == [] and queued.usage is None
    assert queued.status in ("queued", "in_progress")
    wait_for(lambda: _status(client, queued.id) not in ("queued", "in_progress"), 60, 0.1, "its end")
    final = client.responses.retrieve(queued.id)
    assert final.status == synchronous.status  # incomplete, when the answer ran to 10 tokens
    assert final.output_text == synchronous.output_text
    assert final.usage.output_tokens == synchronous.usage.output_tokens
    # It is continued like any stored response.
    follow_up = client.responses.create(model=MODEL, input="And a vegetable?", previous_response_id=queued.id,
                                        max_output_tokens=3, temperature=0)
    assert follow_up.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


def _sse_events(lines) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


def test_a_background_stream_is_picked_up_where_the_client_left_it(shared_torch_worker, client) -> None:
    url = shared_torch_worker.api_url + "/responses"
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 40, "temperature": 0,
            "background": True, "stream": True}
    seen: list[dict] = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while len(seen) < 6:  # the opening events and a couple of deltas, then the client leaves
            line = next(lines)
            if line.startswith("data: "):
                seen.append(json.loads(line[len("data: "):]))
    response_id = seen[0]["response"]["id"]
    last = seen[-1]["sequence_number"]
    with httpx.stream("GET", f"{url}/{response_id}", params={"stream": "true", "starting_after": last},
                      timeout=60) as r:
        assert r.status_code == 200
        rest = _sse_events(r.iter_lines())
    events = seen + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert client.responses.retrieve(response_id).output_text == text
    # The whole stream again, from its start.
    with httpx.stream("GET", f"{url}/{response_id}", params={"stream": "true"}, timeout=60) as r:
        assert _sse_events(r.iter_lines()) == events


def test_a_background_response_is_cancelled_and_its_engine_request_aborted(shared_torch_worker,
                                                                           client) -> None:
    running = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=1500,
                                      background=True, extra_body={"ignore_eos": True})
    wait_for(lambda: _status(client, running.id) == "in_progress", 60, 0.05, "in progress")
    with pytest.raises(openai.BadRequestError, match="still in_progress"):
        client.responses.create(model=MODEL, input="more", previous_response_id=running.id)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert _status(client, running.id) == "cancelled"

    def engine_idle() -> bool:
        return sample(shared_torch_worker.metrics(), "vllm:num_requests_running") == 0

    wait_for(engine_idle, 10, 0.1, "the engine request aborted")
    time.sleep(0.3)
    assert _status(client, running.id) == "cancelled"  # the answer did not overwrite it
    with pytest.raises(openai.BadRequestError, match="status is 'cancelled'"):
        client.responses.cancel(running.id)


def test_a_background_request_the_engine_would_refuse_is_a_400_at_once(shared_torch_worker) -> None:
    body = {"model": MODEL, "input": "hi " * 10, "max_output_tokens": 10_000_000, "background": True}
    r = httpx.post(shared_torch_worker.api_url + "/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "maximum context length" in r.json()["error"]["message"]


def test_only_background_responses_are_streamed_again(client, shared_torch_worker) -> None:
    stored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    r = httpx.get(f"{shared_torch_worker.api_url}/responses/{stored.id}", params={"stream": "true"},
                  timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_the_stream_query_parameter_takes_vllms_bools_and_refuses_others(client, shared_torch_worker) -> None:
    """Anything but "false" or "0" was taken for true: `stream=no` replayed the events, and
    `stream=maybe` or an empty one was answered as a replay. vLLM's parameter is a bool."""
    queued = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, background=True)
    url = f"{shared_torch_worker.api_url}/responses/{queued.id}"
    for value in ("no", "OFF", "f", "0", "false"):
        r = httpx.get(url, params={"stream": value}, timeout=60)
        assert r.status_code == 200 and r.json()["id"] == queued.id, (value, r.text[:200])
    for value in ("yes", "On", "1", "true"):
        with httpx.stream("GET", url, params={"stream": value}, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), value
            assert _sse_events(r.iter_lines())[-1]["type"] in ("response.completed", "response.incomplete")
    for value in ("maybe", "", "truth"):
        r = httpx.get(url, params={"stream": value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream", (value, r.text)


@pytest.mark.parametrize("starting_after", ["x", "-2", "1.5"])
def test_a_replay_from_a_bad_place_is_a_400(client, shared_torch_worker, starting_after) -> None:
    queued = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, background=True)
    r = httpx.get(f"{shared_torch_worker.api_url}/responses/{queued.id}", timeout=10,
                  params={"stream": "true", "starting_after": starting_after})
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
