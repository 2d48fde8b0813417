"""Cheap per-request facts for the scheduler: a prompt-token estimate and prefix fingerprints.

Both run on every request, so they avoid a tokenizer: ~4 characters per token is
the usual English average for BPE vocabularies, which is all a load estimate needs.

Prefix fingerprints: the rendered prompt is cut into fixed-size character chunks
and fingerprint i covers chunks 0..i (a chained CRC-32, i.e. the CRC of the whole
prefix so far, plus the chunk index in the high bits). Two requests that share a
long prefix share their first fingerprints, which is what a prefix-aware policy
needs. zlib.crc32 is stable across processes (unlike hash()), so two gateway
replicas fingerprint the same prompt identically.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from router.lax_fields import lax_int_or_none

CHARS_PER_TOKEN = 4
PREFIX_CHUNK_CHARS = 256
MAX_PREFIX_CHUNKS = 64


RESPONSES_PATH = "/v1/responses"


def render_prompt(body: dict[str, Any], path: str = "") -> tuple[str, int]:
    """The request's prompt as one string, plus tokens given directly as ids. Chat messages,
    the Responses API's instructions and input items, and the Anthropic Messages API's system
    and messages render alike (role, then text), so one conversation fingerprints the same
    through any of them."""
    messages = body.get("messages")
    if isinstance(messages, list):
        system = body.get("system")  # the Anthropic Messages API's system prompt (vLLM serves it)
        if isinstance(system, (str, list)) and system:
            parts: list[str] = []
            _render_turn(parts, "system", {"content": system})
            return "".join(parts) + _render_messages(messages), 0
        return _render_messages(messages), 0
    if path == RESPONSES_PATH:
        return _render_responses(body), 0
    prompt = body.get("prompt", body.get("input"))  # completions' prompt; embeddings' input
    if prompt is None:  # SGLang's native /generate (text or input_ids), TGI's (inputs)
        prompt = body.get("text", body.get("inputs", body.get("input_ids")))
    if isinstance(prompt, str):
        return prompt, 0
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\x1e".join(prompt), 0
        if isinstance(prompt[0], int):  # token ids
            return "", len(prompt)
        if isinstance(prompt[0], list):  # batch of token-id lists
            return "", sum(len(p) for p in prompt if isinstance(p, list))
    return "", 0


def _render_messages(messages: list[Any]) -> str:
    parts: list[str] = []
    for m in messages:
        if isinstance(m, dict):
            _render_turn(parts, str(m.get("role", m.get("type", ""))), m)
    return "".join(parts)


def _render_turn(parts: list[str], role: str, item: dict[str, Any]) -> None:
    parts.append(role)
    parts.append("\x1f")
    content = item.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):  # [{"type": "text" | "input_text" | ..., "text": ...}, ...]
        for p in content:
            if isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append(p["text"])
    for key in ("arguments", "output"):  # a Responses function call, or its output
        if isinstance(item.get(key), str):
            parts.append(item[key])
    parts.append("\x1e")


def _render_responses(body: dict[str, Any]) -> str:
    """`instructions` (the system message) then `input`: a string (one user message) or a
    list of items (messages, function calls and their outputs)."""
    parts: list[str] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        _render_turn(parts, "system", {"content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        _render_turn(parts, "user", {"content": items})
    elif isinstance(items, list):
        parts.append(_render_messages(items))
    return "".join(parts)


def estimate_tokens(text: str, id_tokens: int = 0) -> int:
    return id_tokens + (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def prefix_hashes(
    text: str, chunk: int = PREFIX_CHUNK_CHARS, limit: int = MAX_PREFIX_CHUNKS,
    cache_salt: str | None = None,
) -> list[int]:
    """Chained fingerprints of the complete chunks of `text` (a partial last chunk is left out:
    it is not a prefix another request can share block-for-block). A request's `cache_salt`
    (vLLM's) starts the chain, as it does the engine's block hashes: requests of other salts
    share no cached block, so they share no fingerprint either."""
    n = min(len(text) // chunk, limit)
    if n == 0:
        return []
    data = text[: n * chunk].encode("utf-8", "surrogatepass")
    # Encode once, then cut by character positions mapped to bytes only when the text is ASCII;
    # otherwise cut the str (rarely needed, slower).
    out: list[int] = []
    crc = 0
    if cache_salt is not None:
        crc = zlib.crc32(("cache_salt:" + cache_salt).encode("utf-8", "surrogatepass"))
    if len(data) == n * chunk:
        for i in range(n):
            crc = zlib.crc32(data[i * chunk : (i + 1) * chunk], crc)
            out.append((i << 32) | crc)
    else:
        for i in range(n):
            crc = zlib.crc32(text[i * chunk : (i + 1) * chunk].encode("utf-8", "surrogatepass"), crc)
            out.append((i << 32) | crc)
    return out


def max_tokens_of(body: dict[str, Any]) -> int | None:
    v = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    if v is None:  # SGLang's and TGI's native /generate
        params = body.get("sampling_params", body.get("parameters"))
        if isinstance(params, dict):
            v = params.get("max_new_tokens")
    v = lax_int_or_none(v)
    if v is None or v < 0:
        return None
    return max(v, 1)  # 0 (echo of the prompt alone): the engine still generates one token


# OpenAI's limit on n: a larger value is the engine's to refuse, not a load to plan for.
MAX_CHOICES = 128


def choices_of(body: dict[str, Any]) -> int:
    """How many sequences the engine generates for the request: n, or (older vLLM) best_of
    where it is larger. Each holds its own KV and, prefilled in one step, computes the prompt."""
    count = 1
    for key in ("n", "best_of"):
        v = lax_int_or_none(body.get(key))
        if v is not None and v > count:
            count = v
    return min(count, MAX_CHOICES)


def answers_of(body: dict[str, Any]) -> int:
    """How many answers the usage's completion tokens are spread over: n per prompt (best_of
    beyond n is generated but not returned, nor counted in the usage), times a batch's prompts."""
    n = lax_int_or_none(body.get("n"))
    if n is None or n < 1:
        n = 1
    return min(n, MAX_CHOICES) * batch_size_of(body)


# Text longer than this (characters) is tokenized in a thread when counted on the event loop:
# an 8 MB prompt held the gateway's loop, and so every stream it relays, for ~3 s. Shorter
# text (~2 ms at most) costs less on the loop than a thread hop.
THREAD_TOKENIZE_CHARS = 8192


class TokenCounter:
    """Prompt token counts: exact with a local tokenizer (a `tokenizer.json`, or a directory
    holding one, given by --tokenizer), else the 4-characters-per-token estimate.

    A tokenizer costs tens of microseconds per short prompt (more for long ones), a real
    share of the gateway's budget, so it is off by default; the estimate is within the
    accuracy a load estimate needs for English text."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        self._tok = None
        if tokenizer_path:
            from pathlib import Path

            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.json"
            try:
                self._tok = Tokenizer.from_file(str(path))
            except Exception as exc:  # the library raises its own exception types
                raise SystemExit(f"error: cannot load tokenizer {path}: {exc}") from None

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def count(self, text: str, id_tokens: int = 0) -> int:
        if self._tok is None or not text:
            return estimate_tokens(text, id_tokens)
        try:
            return id_tokens + len(self._tok.encode(text, add_special_tokens=False).ids)
        except TypeError:  # a lone surrogate (see _as_unicode)
            return id_tokens + len(self._tok.encode(_as_unicode(text), add_special_tokens=False).ids)

    async def count_off_loop(self, text: str, id_tokens: int = 0) -> int:
        """count(), with a long text tokenized in a thread. encode_batch, not encode: only it
        releases the GIL (the tokenizers binding's encode holds it, so the loop would stall in
        a thread just the same)."""
        if self._tok is None or len(text) <= THREAD_TOKENIZE_CHARS:
            return self.count(text, id_tokens)
        tok = self._tok
        try:
            encodings = await asyncio.to_thread(tok.encode_batch, [text], add_special_tokens=False)
        except TypeError:  # a lone surrogate (see _as_unicode)
            text = _as_unicode(text)
            encodings = await asyncio.to_thread(tok.encode_batch, [text], add_special_tokens=False)
        return id_tokens + len(encodings[0].ids)


def _as_unicode(text: str) -> str:
    """`text` with each lone surrogate as "?". The JSON escape "\\ud800" alone is a str that
    is no Unicode text (json.loads takes it), and the tokenizer refuses such a str with a
    TypeError: the request was a 500 with --tokenizer. Counted this way, it goes on as without
    one, and the worker answers it (ours: a 400, as a body it cannot read)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def batch_size_of(body: dict[str, Any]) -> int:
    """How many prompts a completions body holds (a list of strings or of token-id lists)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def schedule_request(
    counter: TokenCounter, model: str, body: dict[str, Any], path: str = ""
) -> tuple[dict[str, Any], int, int]:
    """The scheduler's ScheduleRequest for an API body, with the prompt's token estimate (of
    every prompt of a batch) and the number of choices per prompt. A request for n choices
    is n sequences to the engine per prompt (vLLM fans it out): n prompts to prefill and n
    answers' KV each, planned for as one lease."""
    text, id_tokens = render_prompt(body, path)
    return _schedule_request(model, body, text, counter.count(text, id_tokens))


async def schedule_request_off_loop(
    counter: TokenCounter, model: str, body: dict[str, Any], path: str = ""
) -> tuple[dict[str, Any], int, int]:
    """schedule_request, with a long prompt tokenized in a thread (TokenCounter.count_off_loop)."""
    text, id_tokens = render_prompt(body, path)
    return _schedule_request(model, body, text, await counter.count_off_loop(text, id_tokens))


def _schedule_request(model: str, body: dict[str, Any], text: str, prompt: int
                      ) -> tuple[dict[str, Any], int, int]:
    choices = choices_of(body)
    sched: dict[str, Any] = {"model": model, "prompt_tokens": prompt * choices}
    max_tokens = max_tokens_of(body)
    if max_tokens is not None:
        sched["max_tokens"] = max_tokens * choices * batch_size_of(body)
    salt = body.get("cache_salt")
    hashes = prefix_hashes(text, cache_salt=salt if isinstance(salt, str) and salt else None)
    if hashes:
        sched["prefix_hashes"] = hashes
    return sched, prompt, choices
