"""The request body of OpenAI's Responses API (`POST /v1/responses`), the subset a text model
without tools serves: `instructions` and `input` (a string, or message items with text
parts), sampling options and `stream`. It is answered as a chat completion of the same
messages (`to_chat`), as vLLM does for models without a Harmony format.

With `store` (the default) the answer is kept (server/response_store.py), and a later
request's `previous_response_id` continues its conversation; `background` answers later
(server/background.py), and needs `store`. Refused: tools, structured output (`text.format`
other than text), `include` and image or file inputs: a 400 naming them, as for the other
endpoints' options this worker does not implement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from inference_worker.server.chat_protocol import ChatCompletionRequest
from inference_worker.server.clip import clip_repr
from inference_worker.server.errors import (
    APIError,
    error_loc,
    error_msg,
    from_validation_error,
    invalid_request,
)
from inference_worker.server.protocol import reject_set, unsupported

_TEXT_PARTS = {"input_text", "output_text"}

# Options refused unless at their neutral value (an empty list counts as neutral).
_UNIMPLEMENTED_RESPONSES: dict[str, Any] = {
    "conversation": None,
    "tools": None,
    "include": None,
    "prompt": None,
    "max_tool_calls": None,
    "top_logprobs": 0,  # logprobs are not offered on this endpoint
}


# Options with a default that a request may also set to null.
_NULL_MEANS_DEFAULT = frozenset(
    {"stream", "store", "background", "parallel_tool_calls", "service_tier", "tool_choice", "truncation"}
)


def _text_or_list(value: Any) -> str | None:
    """Which of a `str | list` union a value is for: the error then names that branch's fault
    (pydantic would list every branch's, the first one `input.str: Input should be a valid
    string` for a list whose item lacks a field)."""
    return _TEXT if isinstance(value, str) else _LIST if isinstance(value, list) else None


# The union's tags: in an error's location, where no field has such a name, and left out of
# the `param` it names (to_api_error).
_TEXT, _LIST = "<text>", "<list>"


class TextInput(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[
        Annotated[str, Tag(_TEXT)] | Annotated[list[TextInput], Tag(_LIST)],
        Discriminator(_text_or_list, custom_error_type="invalid_type",
                      custom_error_message="Input should be a string or a list of text parts"),
    ]

    def as_chat(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: Annotated[
        Annotated[str, Tag(_TEXT)] | Annotated[list[InputMessage], Tag(_LIST)],
        Discriminator(_text_or_list, custom_error_type="invalid_type",
                      custom_error_message="Input should be a string or a list of input items"),
    ]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(None, min_length=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str = "auto"
    parallel_tool_calls: bool = True
    tool_choice: Literal["none", "auto"] = "none"
    truncation: Literal["disabled", "auto"] = "disabled"
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # a model that does not reason: nothing to set

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """OpenAI's API takes null for these options (clients that write every field send it):
        null is the default, not a 400."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_MEANS_DEFAULT):
            data = {k: v for k, v in data.items() if not (v is None and k in _NULL_MEANS_DEFAULT)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_items(cls, data: Any) -> Any:
        """Name what is not a text message (a function call, an image, ...), where pydantic
        would list every branch of the union it tried."""
        items = data.get("input") if isinstance(data, dict) else None
        if not isinstance(items, list):
            return data
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if kind != "message":
                raise unsupported(f"input.{i}.type", f"input items of type {clip_repr(kind)}")
            for j, part in enumerate(item["content"] if isinstance(item.get("content"), list) else ()):
                if isinstance(part, dict) and part.get("type") not in _TEXT_PARTS:
                    raise unsupported(f"input.{i}.content.{j}.type",
                                      f"content of type {clip_repr(part.get('type'))}")
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        reject_set(self, _UNIMPLEMENTED_RESPONSES)
        for name in ("text", "reasoning"):
            # Free-form options the response repeats (echoed_fields): a NaN or Infinity literal
            # in them (JSON's parser here takes those) went into every answer, stored and
            # streamed, as JSON that a strict client's parser refuses.
            if (where := _non_finite_at(getattr(self, name), name)) is not None:
                raise invalid_request(f"{where}: Input should be a finite number", param=where,
                                      code="invalid_value")
        text_format = (self.text or {}).get("format")
        if isinstance(text_format, dict) and text_format.get("type", "text") != "text":
            raise unsupported("text.format", f"text.format of type {clip_repr(text_format.get('type'))}")
        if self.background and not self.store:
            raise invalid_request("background can only be used when `store` is true", param="background")
        if isinstance(self.input, list) and not self.input:
            raise invalid_request("input must not be empty", param="input")
        return self

    def conversation(self, history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """The earlier turns (those of `previous_response_id`), then the input: what a next turn
        continues. Without the instructions, which do not carry over (OpenAI's API); system
        and developer messages of the input do."""
        messages = list(history)
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages.extend(item.as_chat() for item in self.input)
        return messages

    def messages(self, conversation: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the model answers: the instructions as the system message, then `conversation`."""
        instructions = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return [*instructions, *conversation]

    def to_chat(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The same request as a chat completion of `messages` (see messages()): vLLM's extra
        sampling options (top_k, seed, penalties, stop, ...) come along and are checked there."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in _NOT_FOR_CHAT}
        return ChatCompletionRequest.model_validate(
            {
                **extra,
                "model": self.model,
                "messages": messages,
                "max_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "stream": self.stream,
            }
        )

    def echoed_fields(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        return {
            "instructions": self.instructions,
            "metadata": self.metadata,
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "tool_choice": self.tool_choice,
            "tools": [],
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "background": self.background,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": None,
            "previous_response_id": self.previous_response_id,
            "prompt": None,
            "reasoning": self.reasoning,
            "service_tier": self.service_tier,
            "text": self.text,
            "top_logprobs": None,
            "truncation": self.truncation,
            "user": self.user,
        }


# Responses fields (or chat-only ones a Responses body has no business setting) that must not
# reach the chat request built from it. request_id is ignored, as before: vLLM's names the
# response (its `resp_...` id), and this worker's response ids are its own, never reused.
_NOT_FOR_CHAT = frozenset(
    {"messages", "n", "max_tokens", "max_completion_tokens", "logprobs", "echo", "stream_options",
     "add_generation_prompt", "continue_final_message", "tools", "response_format", "top_logprobs",
     "request_id"}
)


def _non_finite_at(value: Any, path: str) -> str | None:
    """The path of the first NaN or infinite number in a JSON value, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _non_finite_at(item, f"{path}.{key}")) is not None:
            return found
    return None


def parse_request(raw: bytes) -> ResponsesRequest:
    """The request body, or the 400 naming the field at fault (to_api_error)."""
    try:
        return ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise to_api_error(exc) from None


def to_api_error(exc: ValidationError) -> APIError:
    """errors.from_validation_error, with the `str | list` unions' tags left out of `param`."""
    err = exc.errors(include_url=False)[0]
    loc = error_loc(tuple(part for part in err["loc"] if part not in (_TEXT, _LIST)))
    if err["type"] == "json_invalid" or not loc:
        return from_validation_error(exc)
    param = ".".join(loc)
    message = error_msg(err["msg"]).removeprefix("Value error, ")
    return invalid_request(f"{param}: {message}", param=param, code="invalid_value")
