"""Stored responses of the Responses API: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

vLLM keeps them only with `VLLM_ENABLE_RESPONSES_API_STORE=1`, in a dict that grows without
bound; here the store is on by default and bounded (`--responses-store-size`, least recently
used first out; 0 switches it off, and then `store: true` is accepted and has no effect, as in
vLLM). Each entry is the response object and the conversation that produced it, so a next
turn renders as the chat of the whole conversation. A store lives in one worker process: a
router in front of several must send a follow-up to the worker that answered the turn before.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from inference_worker.server.background import LIVE_STATUSES, BackgroundRun
from inference_worker.server.clip import clip
from inference_worker.server.errors import APIError, invalid_request


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    # The conversation the response answered, without its instructions (they do not carry over
    # to the next response, as in OpenAI's API): the earlier turns, then its input.
    messages: list[dict[str, Any]]
    # A background response's run (server/background.py): its status and its stream's events.
    run: BackgroundRun | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """What a next turn continues: the conversation (system messages of its input too), then
        the answer."""
        if self.response["status"] in LIVE_STATUSES:
            raise invalid_request(
                f"Response '{self.response['id']}' is still {self.response['status']}: a next turn can "
                "continue it once it has completed.", param="previous_response_id")
        history = list(self.messages)
        for item in self.response["output"]:
            if item.get("type") == "message":
                history.extend({"role": "assistant", "content": part["text"]} for part in item["content"])
        return history


class ResponseStore:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        response_id = entry.response["id"]
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, or the 404 vLLM answers for an id it does not hold."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)  # a conversation in use stays
        return entry


def not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{clip(response_id)}' not found.", param=param)
