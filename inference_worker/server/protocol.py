"""Request bodies of the OpenAI API subset this worker serves (pydantic, vLLM-shaped):
what completions and chat share, and completions (chat and /tokenize: chat_protocol.py).

Requests are validated once, in strict JSON mode, so a wrong type ("max_tokens": "5")
is a 400 rather than silently coerced. Options this worker does not implement
(a per-request chat_template, tools, best_of, vLLM's guided decoding and other options that
would change the answer, ...) are rejected with a 400 naming the parameter instead of being ignored. Other
unknown fields are ignored, as vLLM does.
Responses are built by hand in `chunks.py` (no pydantic on the per-token path).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from inference_worker.engine.types import SamplingParams
from inference_worker.server.clip import clip_repr
from inference_worker.server.errors import APIError, invalid_request

# OpenAI's limit on choices per request (each is an engine request of its own).
MAX_N = 128
# vLLM's default --max-logprobs: the most alternatives a request may ask for at each token.
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    """vLLM's defaults: a request that sends stream_options at all (`{}` too) gets the final
    usage chunk unless it says otherwise; null is taken and means no, as there."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


def unsupported(param: str, what: str) -> APIError:
    return invalid_request(f"{what} is not supported by this worker", param=param, code="unsupported")


# Request options that change the answer and that this worker does not implement, with the
# value that means "off". Set to anything else, they are a 400 naming them: ignored, a
# constrained-output request (guided_json, ...) would get free text and not know it. They
# are read from the unvalidated extras (or a declared field, where one is).
_UNIMPLEMENTED: dict[str, Any] = {
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "use_beam_search": False,
    "skip_special_tokens": True,
    "structural_tag": None,
    "logits_processors": None,
    # Logprobs' tokens as "token_id:<id>": a client that parses them so would misread the text.
    "return_tokens_as_token_ids": False,
}
def reject_set(request: BaseModel, options: dict[str, Any]) -> None:
    extra = request.model_extra or {}
    declared = type(request).model_fields
    for name, neutral in options.items():
        value = getattr(request, name) if name in declared else extra.get(name, neutral)
        if value is not None and value != neutral and value != []:
            raise unsupported(name, name)


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are kept aside (model_extra), not validated: ignored, as vLLM does, but
    # those of _UNIMPLEMENTED are looked at.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # vLLM's bounds (a torch.long): a seed beyond them is a 400, not folded by the sampler onto
    # another one (2**63 drew what 0 draws).
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    # vLLM's: lower is scheduled first under --scheduling-policy priority; ignored under fcfs
    # (the default), as vLLM does.
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    # vLLM's: the prompt tokens' log-probabilities and N alternatives, in vLLM's shape.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Accepted only at their neutral values. vLLM constrains completions to response_format
    # too, not only chat.
    best_of: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    # For the WebSocket: which endpoint a message is for (ignored over HTTP).
    endpoint: str | None = None
    # OpenAI's end-user id: taken and not used, as vLLM does; declared so that one that is not
    # text is a 400 naming it, as in vLLM, not passed over as an unknown field.
    user: str | None = None
    # vLLM's fields this worker takes and does not act on, declared with vLLM's types for the
    # same reason (a wrong type was passed over as an unknown field, where vLLM answers 400):
    # beam search's length penalty (beam search is refused above); the detokenizer's spacing
    # of special tokens (skipped here: skip_special_tokens must be true); disaggregated
    # serving's KV transfer and custom extensions' arguments.
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    # The prefix-cache salt, acted on: only requests of the same salt share cached blocks
    # (engine/block_manager.py). vLLM refuses an empty one.
    cache_salt: str | None = Field(None, min_length=1)
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # vLLM's: the request's id (the answer's is `cmpl-<request_id>`, `chatcmpl-<request_id>`)
    # where no X-Request-Id header gives one, under the header's rules (prepare.py). A string,
    # as vLLM's (null too is a 400 there); empty, or unusable as an id: a fresh one.
    request_id: str = ""

    @field_validator("n", "stream", "min_p", "echo", mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's API takes null for these ("integer or null"), and so does vLLM: the default."""
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²".isdigit(), but int("²") fails
                raise ValueError(f"logit_bias keys are token ids, not {clip_repr(key)}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], not {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    def _rejectunsupported(self) -> None:
        reject_set(self, _UNIMPLEMENTED)
        if self.best_of is not None and self.best_of > 1:
            raise unsupported("best_of", "best_of > 1")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", "response_format other than text")
        if self.stream and self.prompt_logprobs is not None:
            # No stream chunk carries them (vLLM refuses them too): they would just go missing.
            raise invalid_request(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )
        # vLLM refuses only options that say something: an empty `stream_options: {}` (which
        # some clients always send) is taken on a request that does not stream.
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise invalid_request(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: continuous_usage_stats, which (as in vLLM) needs include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """None: no logprobs; N: the sampled token's and the N likeliest."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (vLLM's prompt_logprobs; completions' echo)."""
        return self.prompt_logprobs

    def sampling_params(self, prompt_len: int, max_model_len: int, prompt_param: str) -> SamplingParams:
        """Check lengths against the context window (vLLM's wording) and build the engine's params."""
        if prompt_len == 0:
            raise invalid_request("The prompt is empty.", param=prompt_param)
        if prompt_len >= max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {max_model_len} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the input.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        requested = self.requested_max_tokens()
        if requested is not None and prompt_len + requested > max_model_len:
            raise invalid_request(
                f"'max_tokens' is too large: {requested}. This model's maximum context length is "
                f"{max_model_len} tokens and your request has {prompt_len} input tokens "
                f"({requested} > {max_model_len} - {prompt_len}).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else max_model_len - prompt_len
        if self.min_tokens > max_tokens:
            raise invalid_request(
                f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({max_tokens})",
                param="min_tokens",
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        top_k = -1 if self.top_k in (None, 0) else self.top_k
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            n=self.n,
            max_tokens_param=requested,
            priority=self.priority,
            cache_salt=self.cache_salt,
        )


class CompletionRequest(GenerationRequest):
    prompt: Any = None
    # OpenAI's default for /v1/completions (vLLM keeps it). 0 only with echo: the prompt alone.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # vLLM's: a text prompt is tokenized with the tokenizer's special tokens (BOS) unless false.
    # Token-id prompts are taken as they are.
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.prompt is None:
            raise invalid_request("prompt is required", param="prompt")
        if self.max_tokens == 0 and not self.echo:
            raise invalid_request(
                "max_tokens must be at least 1, got 0 (0 only with echo)", param="max_tokens"
            )
        if self.suffix:
            raise unsupported("suffix", "suffix")
        self._rejectunsupported()
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (the engine still generates one
        token, which is dropped, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list, or a batch of them (OpenAI's and vLLM's
        completions take both; each prompt's answers are choices of the one response)."""
        return normalize_prompts(self.prompt)


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return list(prompt)
    raise invalid_request(
        "prompt must be a string, a non-empty list of token ids, or a non-empty list of either",
        param="prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
