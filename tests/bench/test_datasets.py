"""ShareGPT loading from the truncated packaged file, and vLLM's sampling rules."""

import json
import random

import pytest

from benchmarks import datasets


def words(texts):
    """A stand-in tokenizer for rule tests: one token per whitespace-separated word."""
    return [len(t.split()) for t in texts]


def entry(prompt_words, reply_words, tag=""):
    return {"id": tag, "conversations": [{"from": "human", "value": " ".join([f"p{tag}"] * prompt_words)},
                                         {"from": "gpt", "value": " ".join(["r"] * reply_words)}]}


def test_decode_records_stops_at_the_first_broken_record():
    good = [entry(5, 5, "a"), entry(6, 6, "b")]
    text = json.dumps(good, indent=2)[:-2] + ',\n  {"id": "c", "conversations": [{"from": "human", "val'
    assert [r["id"] for r in datasets.decode_records(text)] == ["a", "b"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # the reason record-by-record decoding exists
    assert len(datasets.decode_records(json.dumps(good))) == 2  # a complete file decodes fully


def test_packaged_sharegpt_recovers_thousands_of_conversations():
    with pytest.raises(json.JSONDecodeError):
        json.loads(datasets.sharegpt_path().read_text(encoding="utf-8"))
    entries = datasets.load_sharegpt()
    assert 17_000 < len(entries) < 18_000
    assert all(len(e["conversations"]) >= 2 for e in entries)


def test_filters_drop_short_long_and_overlong_pairs():
    entries = [
        entry(3, 50, "short_prompt"),   # prompt_len < 4
        entry(50, 3, "short_reply"),    # output_len < 4
        entry(1025, 10, "long_prompt"), # prompt_len > 1024
        entry(1000, 1049, "too_long"),  # prompt + output = 2049 > 2048
        entry(1000, 1048, "edge_ok"),   # exactly 2048
        entry(4, 4, "min_ok"),
    ]
    kept = datasets.sample_sharegpt(entries, words, num_requests=2, seed=0)
    assert sorted(s.prompt.split()[0] for s in kept) == ["pedge_ok", "pmin_ok"]
    by_tag = {s.prompt.split()[0]: s for s in kept}
    assert (by_tag["pedge_ok"].prompt_len, by_tag["pedge_ok"].expected_output_len) == (1000, 1048)


def test_order_is_vllm_seeded_shuffle_and_stops_at_num_prompts():
    entries = [entry(10 + i, 20, str(i)) for i in range(50)]
    got = datasets.sample_sharegpt(entries, words, num_requests=10, seed=7)
    shuffled = list(entries)
    random.seed(7)
    random.shuffle(shuffled)
    assert [s.prompt for s in got] == [e["conversations"][0]["value"] for e in shuffled[:10]]
    assert [s.request_id for s in got] == [str(i) for i in range(10)]
    other = datasets.sample_sharegpt(entries, words, num_requests=10, seed=8)
    assert [s.prompt for s in other] != [s.prompt for s in got]


def test_oversampling_duplicates_with_new_ids():
    entries = [entry(10, 10, str(i)) for i in range(3)] + [entry(1, 1, "bad")]
    got = datasets.sample_sharegpt(entries, words, num_requests=8, seed=0)
    assert len(got) == 8
    assert len({s.prompt for s in got}) == 3
    assert [s.request_id for s in got] == [str(i) for i in range(8)]
    assert len(datasets.sample_sharegpt(entries, words, 8, seed=0, oversample=False)) == 3


def test_disk_cache_returns_the_same_sample(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "CACHE_ROOT", tmp_path)
    entries = [entry(10 + i, 20, str(i)) for i in range(30)]
    first = datasets.sample_sharegpt(entries, words, 5, seed=1, cache_key={"t": "words"})
    calls = []
    second = datasets.sample_sharegpt(entries, lambda t: calls.append(t) or words(t), 5, seed=1,
                                      cache_key={"t": "words"})
    assert second == first and calls == []  # served from the cache, nothing re-tokenized
    assert len(list((tmp_path / "sharegpt-samples").glob("single-*.json"))) == 1


def conversation(n_turns, tag, user_words=5, reply_words=6):
    conv = []
    for t in range(n_turns):
        conv.append({"from": "human", "value": " ".join([f"u{tag}.{t}"] * user_words)})
        conv.append({"from": "gpt", "value": " ".join([f"a{tag}.{t}"] * reply_words)})
    return {"id": tag, "conversations": conv}


def test_multiturn_history_grows_and_turn_lengths_follow_it():
    entries = [conversation(4, str(i)) for i in range(10)]
    convs = datasets.sample_sharegpt_multiturn(entries, words, num_requests=12, seed=0, max_turns=3)
    assert sum(len(c.turns) for c in convs) == 12
    for c in convs:
        assert len(c.turns) <= 3
        texts = [c.prompt_text(t) for t in range(len(c.turns))]
        for t in range(1, len(texts)):
            # consecutive turns share a growing prefix: everything before the final "Assistant:"
            assert texts[t].startswith(texts[t - 1][: -len("Assistant:")])
            assert c.turns[t].prompt_len > c.turns[t - 1].prompt_len
        msgs = c.messages(len(c.turns) - 1)
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(c.turns) - 1) + ["user"]
        assert all(t.prompt_len == len(c.prompt_text(i).split()) for i, t in enumerate(c.turns))


def test_multiturn_cuts_conversations_at_the_length_limit_and_skips_bad_ones():
    entries = [
        conversation(6, "long", user_words=100, reply_words=100),  # histories of 102, 304, 506 tokens
        {"id": "starts_with_gpt", "conversations": [{"from": "gpt", "value": "x " * 10},
                                                    {"from": "human", "value": "y " * 10}] * 2},
        conversation(1, "single"),
    ]
    convs = datasets.sample_sharegpt_multiturn(entries, words, num_requests=100, seed=0, max_turns=8,
                                               max_prompt_len=310, max_total_len=600)
    assert len(convs) == 1
    assert [t.prompt_len for t in convs[0].turns] == [102, 304]  # the third (506) exceeds 310
    assert all(t.prompt_len <= 310 and t.prompt_len + t.expected_output_len <= 600 for t in convs[0].turns)


def test_real_tokenizer_sampling_of_the_packaged_file(tmp_path, monkeypatch):
    tok = datasets.load_tokenizer()  # SmolLM2, from its GGUF once, then from the cache
    lengths = datasets.tokenizer_length_fn(tok)
    assert lengths(["Hello world, how are you?"]) == [7]
    entries = datasets.load_sharegpt()
    got = datasets.sample_sharegpt(entries, lengths, num_requests=40, seed=0)
    assert len(got) == 40
    for s in got:
        assert 4 <= s.prompt_len <= 1024 and s.expected_output_len >= 4
        assert s.prompt_len + s.expected_output_len <= 2048
        assert s.prompt_len == len(tok(s.prompt).input_ids)
    convs = datasets.sample_sharegpt_multiturn(entries, lengths, num_requests=30, seed=0)
    assert sum(len(c.turns) for c in convs) == 30 and all(len(c.turns) >= 2 for c in convs[:-1])
