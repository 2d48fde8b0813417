"""HFTokenizer's add_special_tokens (vLLM's request field), on a tokenizer that adds a BOS as
Llama's does (built here: SmolLM2's adds no special tokens, so it cannot tell the difference),
and on SmolLM2's own."""

from __future__ import annotations

import pytest

from inference_worker.model.tokenizer import HFTokenizer

BOS, EOS, HELLO, WORLD, HI = 1, 2, 3, 4, 5
# <s>{content}</s> per message, and an open <s> for the answer.
TEMPLATE = ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>{% endif %}")


@pytest.fixture(scope="module")
def bos_tokenizer() -> HFTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, "hello": HELLO, "world": WORLD, "hi": HI}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = TEMPLATE
    return HFTokenizer(hf)


def test_a_text_gets_the_tokenizers_bos_unless_asked_not_to(bos_tokenizer) -> None:
    """vLLM's completions default (add_special_tokens true) is the tokenizer's own behaviour."""
    assert bos_tokenizer.encode("hello world") == [BOS, HELLO, WORLD]
    assert bos_tokenizer.encode("hello world", add_special_tokens=True) == [BOS, HELLO, WORLD]
    assert bos_tokenizer.encode("hello world", add_special_tokens=False) == [HELLO, WORLD]


def test_a_chat_gets_the_tokenizers_bos_on_top_of_the_templates_only_when_asked(bos_tokenizer) -> None:
    """vLLM's chat default (false): the template's text as it is; true: the rendered text is
    tokenized with the tokenizer's special tokens, a second <s> before the template's."""
    messages = [{"role": "user", "content": "hi"}]
    rendered = [BOS, HI, EOS, BOS]
    assert bos_tokenizer.apply_chat_template(messages) == rendered
    assert bos_tokenizer.apply_chat_template(messages, add_special_tokens=False) == rendered
    assert bos_tokenizer.apply_chat_template(messages, add_special_tokens=True) == [BOS, *rendered]
    # The other rendering options hold on that path too.
    assert bos_tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, add_special_tokens=True) == [BOS, BOS, HI, EOS]


@pytest.mark.slow
def test_smollm2_adds_no_special_tokens_either_way() -> None:
    """Why the torch worker's answers to add_special_tokens do not differ (the sim's do:
    tests/sim/test_sim_worker.py): SmolLM2's tokenizer adds no BOS, and its template writes
    its own markers."""
    from transformers import AutoTokenizer

    from inference_worker.model.loader import resolve_model_dir

    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2"))))
    assert tokenizer.encode("Hello world", add_special_tokens=True) == tokenizer.encode(
        "Hello world", add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, add_special_tokens=True) == tokenizer.apply_chat_template(
        messages)
