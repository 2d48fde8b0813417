"""The worker's store of Responses API answers: bounded, least recently used out first, and
a next turn continues the stored conversation, its system messages included (once it is whole)."""

from __future__ import annotations

import pytest

from inference_worker.server.errors import APIError
from inference_worker.server.response_store import ResponseStore, StoredResponse


def _entry(response_id: str, answer: str = "ok", status: str = "completed") -> StoredResponse:
    output = [{"type": "message", "content": [{"type": "output_text", "text": answer}]}]
    # The conversation as stored: a system message of the input, no instructions.
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    return StoredResponse({"id": response_id, "output": output, "status": status}, messages)


def test_the_least_recently_used_response_leaves_first() -> None:
    store = ResponseStore(2)
    store.put(_entry("a"))
    store.put(_entry("b"))
    store.get("a")  # a conversation in use stays
    store.put(_entry("c"))
    assert len(store) == 2
    assert store.get("a") and store.get("c")
    with pytest.raises(APIError) as caught:
        store.get("b", "previous_response_id")
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"


def test_a_store_of_size_zero_keeps_nothing() -> None:
    store = ResponseStore(0)
    store.put(_entry("a"))
    assert len(store) == 0


def test_a_next_turn_continues_the_conversation_system_messages_of_its_input_included() -> None:
    # The instructions are not stored (responses_protocol.conversation); a system message the
    # client put in its input is part of the conversation, as in OpenAI's API.
    assert _entry("a", "hello").conversation() == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("status", ["queued", "in_progress"])
def test_a_background_response_still_running_cannot_be_continued_yet(status) -> None:
    with pytest.raises(APIError) as caught:
        _entry("a", status=status).conversation()
    assert caught.value.status == 400 and caught.value.param == "previous_response_id"
    assert status in caught.value.message
