"""Request parsing and the OpenAI error mapping, without a model (fast unit tests)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from inference_worker.engine.errors import EngineDeadError, PromptTooLongError
from inference_worker.engine.types import FinishReason, RequestOutput
from inference_worker.server.chat_protocol import ChatCompletionRequest
from inference_worker.server.chunks import ChatChunks, CompletionChunks, UsageTally
from inference_worker.server.errors import APIError, exception_to_api_error
from inference_worker.server.protocol import CompletionRequest, normalize_prompts
from inference_worker.server.websocket import _is_cancel, generation_from_message


def test_completion_defaults_follow_openai_and_vllm() -> None:
    req = CompletionRequest.model_validate_json('{"prompt": "hi"}')
    params = req.sampling_params(prompt_len=3, max_model_len=100, prompt_param="prompt")
    assert params.max_tokens == 16 and params.max_tokens_param == 16  # OpenAI's completions default
    assert (params.temperature, params.top_p, params.top_k, params.n) == (1.0, 1.0, -1, 1)
    assert params.stop == () and not params.ignore_eos


def test_chat_without_max_tokens_gets_the_rest_of_the_context() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    params = req.sampling_params(prompt_len=30, max_model_len=100, prompt_param="messages")
    assert params.max_tokens == 70
    # Unset: vllm:request_params_max_tokens gets the effective 70 from the engine, as vLLM.
    assert params.max_tokens_param is None


def test_chat_max_completion_tokens_wins_and_options_map() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_tokens": 50,
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_k": 0,
            "stop": "END",
            "seed": 3,
            "ignore_eos": True,
        }
    )
    params = req.sampling_params(prompt_len=5, max_model_len=100, prompt_param="messages")
    assert (params.max_tokens, params.max_tokens_param) == (7, 7)
    assert params.greedy and params.top_k == -1 and params.stop == ("END",) and params.seed == 3
    assert params.ignore_eos
    assert req.template_messages() == [{"role": "system", "content": "ab"}]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("text", ["text"]), ([1, 2, 3], [[1, 2, 3]]), (["one"], ["one"]), ([[4, 5]], [[4, 5]]),
     (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_forms(prompt, expected) -> None:
    """One prompt or a batch: a string, token ids, or a list of either."""
    assert normalize_prompts(prompt) == expected


@pytest.mark.parametrize(
    "prompt", [[], [1, "a"], ["a", [1]], [[1], []], [[1], ["a"]], [-1], [True], {"a": 1}, 5]
)
def test_bad_prompt_forms(prompt) -> None:
    with pytest.raises(APIError) as err:
        normalize_prompts(prompt)
    assert err.value.status == 400 and err.value.param == "prompt"


def test_context_length_checks() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 10})
    with pytest.raises(APIError) as too_long:
        req.sampling_params(prompt_len=100, max_model_len=100, prompt_param="prompt")
    assert too_long.value.param == "prompt" and too_long.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as too_many:
        req.sampling_params(prompt_len=95, max_model_len=100, prompt_param="prompt")
    assert too_many.value.param == "max_tokens"
    assert req.sampling_params(prompt_len=90, max_model_len=100, prompt_param="prompt").max_tokens == 10


def test_exceptions_map_to_statuses() -> None:
    with pytest.raises(ValidationError) as bad:
        CompletionRequest.model_validate_json('{"prompt": "x", "top_p": 1.5}')
    err = exception_to_api_error(bad.value)
    assert (err.status, err.param) == (400, "top_p")
    with pytest.raises(ValidationError) as not_json:
        CompletionRequest.model_validate_json("{")
    assert exception_to_api_error(not_json.value).code == "invalid_json"
    assert exception_to_api_error(PromptTooLongError("too long")).status == 400
    assert exception_to_api_error(EngineDeadError("gone")).status == 503
    boom = exception_to_api_error(RuntimeError("boom"))
    assert boom.status == 500 and boom.type == "server_error" and "boom" in boom.message
    assert set(boom.body()["error"]) == {"message", "type", "param", "code"}


def _out(text: str, finished: bool, reason: FinishReason | None) -> RequestOutput:
    return RequestOutput(
        "r", text, [1], finished, reason, num_prompt_tokens=4, num_output_tokens=2, num_cached_tokens=1
    )


def test_chunks_are_valid_json_with_escaping() -> None:
    tricky = 'quote " backslash \\ newline \n unicode é 漢'
    comp = CompletionChunks("cmpl-1", 'model "x"')
    body = json.loads(comp.delta(tricky, None))
    assert body["choices"][0]["text"] == tricky and body["model"] == 'model "x"'
    assert json.loads(comp.delta("", FinishReason.LENGTH))["choices"][0]["finish_reason"] == "length"
    last = _out("", True, FinishReason.STOP)
    tally = UsageTally(4)
    tally.update(0, last)
    usage = json.loads(comp.usage(tally))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    chat = ChatChunks("chatcmpl-1", "m")
    assert json.loads(chat.first())["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(chat.delta(tricky, None))["choices"][0]["delta"]["content"] == tricky
    assert json.loads(chat.delta("", FinishReason.STOP))["choices"][0]["delta"] == {}
    full = chat.full(["hello"], [last], tally)
    assert full["choices"][0]["message"]["content"] == "hello" and full["usage"]["completion_tokens"] == 2
    # n = 2: one choice per text, the prompt counted once, the answers added up.
    pair = UsageTally(4, num_choices=2, n=2)
    for index in (0, 1):
        pair.update(index, last)
    two = chat.full(["a", "b"], [last, last], pair)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                            "prompt_tokens_details": {"cached_tokens": 1}}
    # Two prompts of 4 tokens, n = 1: each prompt counted, each one's cache hits.
    batch = UsageTally(8, num_choices=2, n=1)
    for index in (0, 1):
        batch.update(index, last)
    summed = batch.as_dict()
    assert summed["prompt_tokens"] == 8 and summed["prompt_tokens_details"]["cached_tokens"] == 2
    assert json.loads(chat.delta("x", None, None, 1))["choices"][0]["index"] == 1


def test_websocket_cancel_message_detection() -> None:
    assert _is_cancel('{"type": "cancel"}')
    assert not _is_cancel('{"type": "cancel", "prompt": "x"}')
    assert not _is_cancel('{"prompt": "cancel"}')
    assert not _is_cancel("cancel")


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, '{"a": ' * 5000 + "1" + "}" * 5000])
def test_websocket_message_nested_too_deeply_is_a_400(text) -> None:
    """json.loads raises RecursionError there, not a JSONDecodeError: it was a 500."""
    with pytest.raises(APIError) as caught:
        generation_from_message(None, text)  # refused before the factory is used
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("guided_json", {"type": "object"}),
        ("guided_choice", ["yes", "no"]),
        ("guided_regex", "[0-9]+"),
        ("guided_grammar", "root ::= 'a'"),
        ("structured_outputs", {"choice": ["a"]}),
        ("bad_words", ["no"]),
        ("allowed_token_ids", [1, 2]),
        ("truncate_prompt_tokens", 8),
        ("use_beam_search", True),
        ("skip_special_tokens", False),
        ("response_format", {"type": "json_object"}),
        ("structural_tag", '{"type": "structural_tag"}'),
        ("logits_processors", ["my_module.Processor"]),
        ("return_tokens_as_token_ids", True),
    ],
)
def test_options_that_would_change_the_answer_are_refused_not_ignored(option, value) -> None:
    """Ignored, a request for JSON-constrained output (say) would get free text and not know it."""
    for req_cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, _CHAT)):
        with pytest.raises(APIError) as err:
            req_cls.model_validate({**body, option: value})
        assert err.value.status == 400 and err.value.param == option and err.value.code == "unsupported"
        # At its neutral value (what a client library may send by default) it is fine.
        neutral = {"use_beam_search": False, "skip_special_tokens": True, "return_tokens_as_token_ids": False,
                   "response_format": {"type": "text"}}.get(option)
        req_cls.model_validate({**body, option: neutral})


@pytest.mark.parametrize(("option", "value", "neutral"), [("chat_template", "{{ messages }}", None)])
def test_chat_rendering_options_are_refused_unless_neutral(option, value, neutral) -> None:
    with pytest.raises(APIError) as err:
        ChatCompletionRequest.model_validate({**_CHAT, option: value})
    assert err.value.param == option
    ChatCompletionRequest.model_validate({**_CHAT, option: neutral})
    # Fields no one acts on (OpenAI platform options, unknown names) are still ignored.
    ChatCompletionRequest.model_validate({**_CHAT, "store": True, "metadata": {"a": "b"}, "x_y": 1})


@pytest.mark.parametrize(
    ("req_cls", "body"), [(CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, _CHAT)]
)
def test_prompt_logprobs_are_refused_in_a_stream(req_cls, body) -> None:
    """No stream chunk carries them: a stream asking for them would silently go without
    (vLLM refuses them as well). The WebSocket, which always streams, refuses them the same way."""
    with pytest.raises(APIError) as err:
        req_cls.model_validate({**body, "stream": True, "prompt_logprobs": 1})
    assert err.value.status == 400 and err.value.param == "prompt_logprobs"
    req_cls.model_validate({**body, "prompt_logprobs": 1})
    unused = type("Unused", (), {"chat_from": None, "completion_from": None})()  # refused before
    with pytest.raises(APIError) as over_ws:
        generation_from_message(unused, json.dumps({**body, "prompt_logprobs": 0}))
    assert over_ws.value.param == "prompt_logprobs"


_NEEDS_TOOLS = "When using `tool_choice`, `tools` must be set."
_NAMED = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_choice": "auto"}, _NEEDS_TOOLS),
        ({"tool_choice": "auto", "tools": None}, _NEEDS_TOOLS),
        ({"tool_choice": "required"}, _NEEDS_TOOLS),
        ({"tool_choice": _NAMED}, _NEEDS_TOOLS),
        ({"tool_choice": "sometimes"}, _NEEDS_TOOLS),  # vLLM asks for tools before the value
        ({"tools": [], "tool_choice": _NAMED}, "The tool specified in `tool_choice` does not match any"),
        ({"tools": [], "tool_choice": "sometimes"}, "Invalid value for `tool_choice`: 'sometimes'"),
    ],
)
def test_a_tool_choice_without_tools_is_refused_as_in_vllm(fields, message) -> None:
    """vLLM's check_tool_usage: any tool_choice but "none" needs `tools`, "auto" included."""
    with pytest.raises(APIError) as err:
        ChatCompletionRequest.model_validate({**_CHAT, **fields})
    assert (err.value.status, err.value.param, err.value.code) == (400, "tool_choice", None)
    assert err.value.message.startswith(message)


@pytest.mark.parametrize("fields", [{"tool_choice": "none"}, {"tool_choice": None}, {"tools": None},
                                    {"tools": [], "tool_choice": "auto"},
                                    {"tools": [], "tool_choice": "required"}])
def test_a_tool_choice_that_allows_text_is_served(fields) -> None:
    """"none" needs no tools; with an empty list "auto" answers in text and "required" means
    "none" (OpenAI's reading, which vLLM follows)."""
    ChatCompletionRequest.model_validate({**_CHAT, **fields})


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_a_seed_beyond_a_64_bit_integer_is_refused(seed) -> None:
    """vLLM's bounds: the sampler would fold it onto another seed (2**63 drew as 0 does)."""
    for req_cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, _CHAT)):
        with pytest.raises(ValidationError) as err:
            req_cls.model_validate({**body, "seed": seed})
        assert exception_to_api_error(err.value).param == "seed"
        for within in (2**63 - 1, -(2**63)):
            assert req_cls.model_validate({**body, "seed": within}).seed == within


@pytest.mark.parametrize(
    ("options", "usage", "continuous"),
    [({}, True, False), ({"include_usage": None}, False, False), ({"include_usage": False}, False, False),
     ({"continuous_usage_stats": True}, True, True), ({"continuous_usage_stats": None}, True, False)],
)
def test_stream_options_default_to_the_usage_chunk_as_in_vllm(options, usage, continuous) -> None:
    """vLLM's StreamOptions: include_usage is true unless sent false or null, so a client that
    sends `stream_options: {}` gets the final usage chunk there; here too."""
    for req_cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, _CHAT)):
        req = req_cls.model_validate_json(json.dumps({**body, "stream": True, "stream_options": options}))
        assert (req.include_usage, req.continuous_usage) == (usage, continuous)
    # No stream_options at all: no usage chunk (vLLM's default, and OpenAI's).
    assert not CompletionRequest.model_validate({"prompt": "hi", "stream": True}).include_usage


def test_empty_stream_options_are_taken_without_stream_as_in_vllm() -> None:
    """vLLM refuses stream_options on a request that does not stream only when they say
    something (its check reads the raw dict's truth): `{}` is taken, `{"include_usage": true}`
    is refused."""
    for req_cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, _CHAT)):
        req = req_cls.model_validate({**body, "stream_options": {}})
        assert not req.stream
        for options in ({"include_usage": True}, {"include_usage": None}):
            with pytest.raises(APIError) as err:
                req_cls.model_validate({**body, "stream_options": options})
            assert err.value.param == "stream_options"


@pytest.mark.parametrize(("field", "default"), [("n", 1), ("stream", False), ("min_p", 0.0), ("echo", False)])
def test_null_means_the_default_where_openai_allows_null(field, default) -> None:
    """OpenAI's reference gives these as "or null" and vLLM takes null: a client that sends the
    key with null (rather than leaving it out) is served, not refused."""
    for req_cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, _CHAT)):
        req = req_cls.model_validate_json(json.dumps({**body, field: None}))
        assert getattr(req, field) == default
        req.sampling_params(prompt_len=3, max_model_len=100, prompt_param="prompt")


_CMPL = {"prompt": "hi"}
_BOTH = ((CompletionRequest, _CMPL), (ChatCompletionRequest, _CHAT))
_CHAT_ONLY = ((ChatCompletionRequest, _CHAT),)
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_CUSTOM_CALL = {"id": "call_2", "type": "custom", "custom": {"name": "g", "input": "x"}}


def _chat_with(message: dict) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "go on"}]}


@pytest.mark.parametrize(
    ("requests", "field", "wrong", "right"),
    [
        (_BOTH, "length_penalty", "long", 0.5),
        (_BOTH, "length_penalty", None, 2),
        (_BOTH, "spaces_between_special_tokens", "no", False),
        (_BOTH, "cache_salt", 42, "a-random-salt"),
        (_BOTH, "cache_salt", "", None),  # vLLM refuses an empty salt
        (_BOTH, "kv_transfer_params", ["x"], {"do_remote_prefill": False}),
        (_BOTH, "vllm_xargs", {"k": {"nested": 1}}, {"k": "v", "n": 2, "f": 0.5, "l": [1, "a"]}),
        (_BOTH, "add_special_tokens", "yes", False),
        (_BOTH, "request_id", 7, "trace-7"),  # acted on: the answer's id (prepare.py)
        (_BOTH, "request_id", None, "trace-7"),  # vLLM's is a string, never null
        (_CHAT_ONLY, "documents", [{"title": 5}], [{"title": "A", "text": "B"}]),
        (_CHAT_ONLY, "documents", "doc", None),
        (_CHAT_ONLY, "chat_template_kwargs", ["enable_thinking"], {"enable_thinking": False}),
        (_CHAT_ONLY, "mm_processor_kwargs", "fps=2", {"fps": 2}),
        (_CHAT_ONLY, "media_io_kwargs", {"video": 5}, {"video": {"num_frames": 4}}),
        (_CHAT_ONLY, "include_reasoning", "false", False),
    ],
)
def test_vllm_fields_taken_and_not_used_refuse_a_wrong_type(requests, field, wrong, right) -> None:
    """vLLM declares these fields (this worker does not act on them): a value of the wrong type
    was passed over as an unknown field and served, where vLLM answers 400. Now a 400 naming the
    field, in the OpenAI error shape; a value of the right type is taken as before."""
    for req_cls, body in requests:
        with pytest.raises(ValidationError) as err:
            req_cls.model_validate_json(json.dumps({**body, field: wrong}))
        api_error = exception_to_api_error(err.value)
        assert (api_error.status, api_error.type) == (400, "invalid_request_error")
        assert api_error.param is not None and api_error.param.split(".")[0] == field, api_error.param
        assert set(api_error.body()["error"]) == {"message", "type", "param", "code"}
        req = req_cls.model_validate_json(json.dumps({**body, field: right}))
        req.sampling_params(prompt_len=3, max_model_len=100, prompt_param="prompt")


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant", "content": None, "tool_calls": "f()"}, "messages.1.tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, "messages.1.tool_calls.0"),
        ({"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": {}}}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"role": "assistant", "tool_calls": [{**_CALL, "id": 1}]}, "messages.1.tool_calls.0.id"),
        ({"role": "assistant", "tool_calls": [{**_CALL, "type": "call"}]}, "messages.1.tool_calls.0.type"),
        ({"role": "assistant", "tool_calls": [{**_CUSTOM_CALL, "custom": {"name": "g"}}]},
         "messages.1.tool_calls.0.custom.input"),
        ({"role": "tool", "content": "42", "tool_call_id": 7}, "messages.1.tool_call_id"),
    ],
)
def test_a_messages_tool_calls_of_the_wrong_type_are_refused(message, param) -> None:
    """An assistant message's tool_calls (and a tool message's tool_call_id) were passed over
    whatever they held; vLLM validates them as OpenAI's message types and answers 400."""
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate_json(json.dumps(_chat_with(message)))
    api_error = exception_to_api_error(err.value)
    assert (api_error.status, api_error.param) == (400, param)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "assistant", "content": "calling", "tool_calls": [_CALL, _CUSTOM_CALL]},
        {"role": "assistant", "content": "none", "tool_calls": None},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "tool", "content": "42"},
        # Where vLLM does not read them (OpenAI's user message type ignores them), anything goes.
        {"role": "user", "content": "x", "tool_calls": "whatever", "tool_call_id": 7},
        {"role": "assistant", "content": "x", "tool_call_id": 7},
    ],
)
def test_a_messages_tool_calls_of_the_right_type_are_taken_and_not_rendered(message) -> None:
    req = ChatCompletionRequest.model_validate_json(json.dumps(_chat_with(message)))
    assert req.template_messages()[1] == {"role": message["role"], "content": message["content"] or ""}
