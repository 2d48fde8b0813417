"""The Responses API (`POST /v1/responses`) of a real `python -m inference_worker` (real model,
127.0.0.1), driven by the official `openai` client: the answer is the chat answer of the same
conversation, streamed in vLLM's event order, with its usage; a stored answer is continued by
`previous_response_id` and returned by GET; what it does not serve is a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

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
        ({"background": True}, "background"),
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
