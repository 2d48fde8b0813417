"""WorkerTokenizer over a Hugging Face tokenizer."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any


class HFTokenizer:
    """The engine's and server's view of an HF tokenizer (implements engine.types.WorkerTokenizer)."""

    def __init__(self, hf_tokenizer, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = len(hf_tokenizer)
        # Names a request's chat_template_kwargs may not take: apply_chat_template's own
        # arguments, and `messages`, which its renderer passes to the template itself (a second
        # one is a TypeError, not a TemplateError).
        own = inspect.signature(hf_tokenizer.apply_chat_template).parameters
        self._own_params = frozenset(own) | {"messages"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids; with add_special_tokens (vLLM's completions default) the tokenizer's
        own special tokens too (a BOS for Llama's; SmolLM2's adds none), as in vLLM."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The chat prompt's token ids. template_kwargs: extra variables for the template
        (vLLM's chat_template_kwargs); a template that fails on them is a ValueError (a 400).
        add_special_tokens: the tokenizer's special tokens (BOS) on top of what the template
        writes, as vLLM tokenizes the rendered prompt (off by default, there too)."""
        if getattr(self.hf, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        from jinja2 import TemplateError

        # Template variables only: a name of apply_chat_template's own (tokenize, tools, ...)
        # would change what it returns or fail the call, so such names are dropped, as vLLM does.
        variables = {k: v for k, v in (template_kwargs or {}).items() if k not in self._own_params}
        try:
            # Tokenized by apply_chat_template, the rendered text gets none of the tokenizer's
            # special tokens; with them, vLLM renders the text and tokenizes it adding them.
            rendered = self.hf.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=not add_special_tokens,
                **variables,
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template failed: {exc}") from None
        if add_special_tokens:  # the rendered text
            return self.encode(rendered, add_special_tokens=True)
        ids = rendered
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]
