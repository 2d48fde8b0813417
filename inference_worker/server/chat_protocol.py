"""Request bodies of chat completions, and of vLLM's /tokenize and /detokenize, which render
messages the same way (the shared fields: protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inference_worker.server.clip import clip_repr
from inference_worker.server.errors import invalid_request
from inference_worker.server.protocol import MAX_LOGPROBS, GenerationRequest, reject_set, unsupported

# Chat's own options refused unless neutral (see protocol._UNIMPLEMENTED): a template sent
# with the request runs only where vLLM is started with --trust-request-chat-template.
_UNIMPLEMENTED_CHAT: dict[str, Any] = {
    "chat_template": None,
}


class _ChatRendering(BaseModel):
    """vLLM's options for rendering messages with the chat template (chat and /tokenize)."""

    add_generation_prompt: bool = True
    # Leave the last message open for the answer to go on from it (an assistant "prefill").
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the tokenizer's special tokens (BOS) on top of what the template writes. Off by
    # default, as there: the template writes them (a /tokenize of a prompt defaults to on).
    add_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _check_content_parts(cls, data: Any) -> Any:
        """Name a content part this text model cannot take (an image, audio, a file), where
        pydantic would report every branch of the content union it tried."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise unsupported(f"messages.{i}.content.{j}.type",
                                      f"content of type {clip_repr(kind)} (this model takes text)")
        return data

    def _check_rendering(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid_request(
                "Cannot set both continue_final_message and add_generation_prompt to true "
                "(set add_generation_prompt to false)",
                param="continue_final_message",
            )

    def rendering(self) -> dict[str, Any]:
        """The keyword arguments of WorkerTokenizer.apply_chat_template."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs,
            "add_special_tokens": self.add_special_tokens,
        }


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _CalledFunction(_Strict):
    name: str
    arguments: str


class _CalledCustomTool(_Strict):
    name: str
    input: str


class ToolCall(_Strict):
    """An assistant message's earlier tool call, as OpenAI's (and vLLM's) message types take
    it: a function's, or a custom tool's. One model rather than a union of two, so that an
    error names the field as the client wrote it (messages.1.tool_calls.0.function.name)."""

    id: str
    type: Literal["function", "custom"]
    function: _CalledFunction | None = None
    custom: _CalledCustomTool | None = None

    @model_validator(mode="after")
    def _its_own_call(self) -> ToolCall:
        if getattr(self, self.type) is None:
            raise ValueError(f"a tool call of type {self.type!r} needs its {self.type!r}")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # Taken and not rendered (this worker serves no tools), as before; declared so that a wrong
    # type is a 400 naming it, as in vLLM: an assistant's tool calls, a tool's answer's call id.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_where_vllm_reads_them(cls, data: Any) -> Any:
        """vLLM takes a message as any of OpenAI's message types, each ignoring what is not its
        own: tool_calls is read on an assistant message and tool_call_id on a tool message only
        (elsewhere anything goes, as there)."""
        if not isinstance(data, dict):
            return data
        role = data.get("role")
        drop = [k for k, own in (("tool_calls", "assistant"), ("tool_call_id", "tool"))
                if k in data and role != own]
        return {k: v for k, v in data.items() if k not in drop} if drop else data

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # The chat templates of small models know "system", not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest, _ChatRendering):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat echo: an answer that goes on from a last assistant message starts with it.
    echo: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # Taken and not used (no tools here), as vLLM takes it; not a bool is a 400, as there.
    parallel_tool_calls: bool | None = None
    # vLLM's, taken and not used either (a wrong type is a 400 naming it, as there): documents
    # for a RAG template (the served templates use none), a multimodal processor's and media
    # loaders' options (this model takes text), and whether to return the reasoning (no
    # reasoning parser here: the answer is the content).
    documents: list[dict[str, str]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.tools:
            raise unsupported("tools", "tools")
        self._check_tool_choice()
        reject_set(self, _UNIMPLEMENTED_CHAT)
        self._check_rendering()
        self._rejectunsupported()
        return self

    def _check_tool_choice(self) -> None:
        """vLLM's checks (its ChatCompletionRequest.check_tool_usage), in its order. Any choice but
        "none" needs `tools` sent: "auto" too, which vLLM refuses without tools. Sent, the list
        is empty here (tools are refused above): "auto" answers in text, "required" means
        "none" (as OpenAI and vLLM take it), and a named function names none of them."""
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if self.tools is None:
            raise invalid_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if choice in ("auto", "required"):
            return
        if isinstance(choice, dict):
            raise invalid_request(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                param="tool_choice",
            )
        raise invalid_request(
            f"Invalid value for `tool_choice`: {clip_repr(choice)}. Only named tools, \"none\", \"auto\" or "
            "\"required\" are supported.",
            param="tool_choice",
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def echoed(self) -> str | None:
        """With echo, the last message's text when it is the assistant's (what the answer
        continues), as vLLM does; else None."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return None
        return last.as_template_message()["content"]

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]


class TokenizeRequest(_ChatRendering):
    """vLLM's /tokenize body: a `prompt` or chat `messages` (rendered as a chat request with
    the same options would be)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise invalid_request("give exactly one of prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise invalid_request("messages must not be empty", param="messages")
        self._check_rendering()
        return self

    def prompt_special_tokens(self) -> bool:
        """add_special_tokens for a `prompt`: on unless sent (vLLM's TokenizeCompletionRequest;
        its TokenizeChatRequest defaults to off, as chat does)."""
        return self.add_special_tokens if "add_special_tokens" in self.model_fields_set else True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]
