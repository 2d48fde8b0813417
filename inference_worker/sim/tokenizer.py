"""A deterministic, cheap tokenizer that counts tokens roughly like a Llama tokenizer.

The sim backend has no model, so it has no real vocabulary; what matters is that a
prompt costs about as many tokens (KV blocks, prefill time) as it would on the real
engine, and that streamed output reads like text.

Encoding: the text is cut by one regex into pieces the way SentencePiece/BPE
tokenizers of the Llama family cut English text:
- a word with its leading space (" hello") is one piece; a word longer than
  `WHOLE_WORD_MAX_LEN` letters is that many letters followed by `SUBWORD_LEN`-letter
  chunks (long words are several tokens in a 32k vocabulary);
- every digit is its own token (Llama and SmolLM2 both split numbers into digits),
  and a space before a number is a token of its own;
- punctuation: runs are chunked by 2 ("()", ");", "**", ".\"" are single tokens in BPE
  vocabularies), with an optional leading space;
- newlines are chunked by 2, runs of spaces/tabs by 8 (code indentation);
- any other character is one token, and a non-Latin one (CJK, Cyrillic, emoji) two.

An empty text has no tokens, not even <s> (Llama-2's tokenizer would give [<s>]): the torch
worker's tokenizer (SmolLM2's, which adds no BOS) gives it none, so the server refuses an
empty prompt with a 400 ("The prompt is empty.", as vLLM refuses an empty decoder prompt),
and the sim must refuse it too rather than serve a prompt of one start token.

Ids 0-2 are the Llama specials (<unk>, <s>, </s>), 3 marks the second token of a
non-Latin character, 4-258 (byte fallback in Llama) are unused, then come the words the
sim generates (a fixed list), and every other piece gets `crc32(piece)` folded into the
rest of the 32,000 ids.

Accuracy against the SmolLM2 tokenizer (Llama-architecture model, 49k BPE vocab; the
tokenizer the benchmark client counts with), counts without special tokens, on 3,000
ShareGPT first-turn prompts in vLLM's shuffle order with seed 1
(`python -m benchmarks.sim_tokenizer_accuracy --seed 1`): mean relative error of a
prompt's count 7.5 %, median 5.7 %, p90 16.4 %, p99 40 % (mostly non-English or
symbol-heavy prompts); the total count is 1.9 % high. The constants were fitted on other
prompts (seed 0). Encoding costs ~1.5 us per token. (Llama-2's own SentencePiece
vocabulary is not available offline here; being smaller, it likely splits a little finer.)

Decoding: ids are hashes, so decoding needs a memory of what each id stands for.
Every piece seen by `encode` is remembered (up to `MAX_LEARNED_PIECES`), and the words
the sim generates come from a fixed list registered up front, so generated text is
readable English-like words. An id never seen decodes to a word of the list. Two prompt
pieces hashing to the same id decode as the first one learned: prompts of a few hundred
distinct pieces decode exactly, but after tens of thousands of distinct pieces most ids
are taken and decoding a *prompt* gets lossy (generated text never is).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

VOCAB_SIZE = 32000
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# A non-Latin character (CJK, Cyrillic, emoji...) is two tokens: its own id and this
# one, which decodes to nothing (Llama falls back to 2-3 byte tokens for most of them).
CONTINUATION_ID = 3
FIRST_WORD_ID = 259  # after the specials and the 256 byte-fallback ids of Llama's vocab
WHOLE_WORD_MAX_LEN = 8  # letters; longer words are this many letters + SUBWORD_LEN chunks
SUBWORD_LEN = 4
_LAST_LATIN = "\u02ff"
MAX_LEARNED_PIECES = 262_144

_SPECIALS = {UNK_ID: "", BOS_ID: "", EOS_ID: "", CONTINUATION_ID: ""}

# Order matters: words (with apostrophe suffixes as their own piece), the space before
# a number, digits, punctuation pairs, newlines, spaces and tabs, anything else.
_PIECE_RE = re.compile(
    r"'(?:s|t|re|ve|m|ll|d)\b"
    r"| ?[A-Za-z]+"
    r"| (?=\d)"
    r"|\d"
    r"| ?[!-/:-@\[-`{-~]{1,2}"
    r"|\n{1,2}"
    r"|[ \t]{1,8}"
    r"|.",
    re.DOTALL,
)

# What the sim "generates": common English words with their leading space, and
# punctuation, so that a streamed answer reads like (meaningless) text.
_WORDS = (
        "the of and to in is that for it as with was on be by this are or from at an which "
        "have not but can all their more one has also other will been its they these time "
        "new some into used such first would about may two than only most when many like over "
        "use people system data model each where between both after well made through work "
        "then number world under what make because very could same part how any just "
        "state small large high long good great important different following however example "
        "process value information result level order point form group case research based "
        "possible general common simple local early public given known further several often "
        "design power energy water light space area field network service support report "
        "question answer method approach problem solution request response token cluster "
        "worker engine memory cache block queue batch stream server client router load "
        "measure latency throughput average second minute hour day week year history "
        "language text word sentence paper study review analysis theory practice policy "
        "market price cost growth change increase decrease rate total share product user "
        "simply clearly quickly usually rather quite almost always never sometimes often "
        "therefore thus still again perhaps instead together already within without against"
)
GENERATION_WORDS: tuple[str, ...] = (*(" " + w for w in _WORDS.split()), ",", ".", ";", " -")


# The generated words own a fixed id range, so no prompt piece can collide with them.
FIRST_HASHED_ID = FIRST_WORD_ID + len(GENERATION_WORDS)


def _piece_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % (VOCAB_SIZE - FIRST_HASHED_ID) + FIRST_HASHED_ID


class SimTokenizer:
    """Implements `WorkerTokenizer` for the sim backend (see the module docstring)."""

    eos_token_id = EOS_ID
    bos_token_id = BOS_ID
    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self.eos_token_ids: frozenset[int] = frozenset({EOS_ID})
        self._id_of: dict[str, int] = {w: FIRST_WORD_ID + i for i, w in enumerate(GENERATION_WORDS)}
        self._piece_of: dict[int, str] = {i: w for w, i in self._id_of.items()} | _SPECIALS
        self.generation_token_ids: tuple[int, ...] = tuple(self._id_of.values())

    def _lookup(self, piece: str) -> int:
        token_id = self._id_of.get(piece)
        if token_id is None:
            token_id = _piece_id(piece)
            if len(self._id_of) < MAX_LEARNED_PIECES:
                self._id_of[piece] = token_id
                self._piece_of.setdefault(token_id, piece)
        return token_id

    def pieces(self, text: str) -> list[str]:
        """The text cut into token pieces; `"".join(pieces(t)) == t` always holds."""
        out: list[str] = []
        for match in _PIECE_RE.finditer(text):
            piece = match.group(0)
            start = 1 if piece[0] == " " else 0
            if len(piece) - start > WHOLE_WORD_MAX_LEN and piece[-1].isalpha():
                head = start + WHOLE_WORD_MAX_LEN
                out.append(piece[:head])
                out.extend(piece[i : i + SUBWORD_LEN] for i in range(head, len(piece), SUBWORD_LEN))
            else:
                out.append(piece)
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with a leading <s> like Llama's tokenizer unless disabled; an
        empty text has none (see the module docstring: the torch worker's parity)."""
        lookup = self._lookup
        ids = [BOS_ID] if add_special_tokens and text else []
        for piece in self.pieces(text):
            ids.append(lookup(piece))
            if len(piece) == 1 and piece > _LAST_LATIN:
                ids.append(CONTINUATION_ID)  # non-Latin characters cost ~2 tokens
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        piece_of = self._piece_of
        words = GENERATION_WORDS
        parts = []
        for t in token_ids:
            piece = piece_of.get(t)
            if piece is None:
                piece = words[t % len(words)]
            elif not piece and not skip_special_tokens and t < CONTINUATION_ID:
                piece = ("<unk>", "<s>", "</s>")[t]
            parts.append(piece)
        return "".join(parts)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Llama-2 chat format, ending with an open assistant turn.

        `<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] ...`

        Llama-2's format has no separate generation prompt (add_generation_prompt changes
        nothing) and uses no template variables; continue_final_message leaves a last
        assistant message open (no closing `</s>`), for the answer to go on from it.
        add_special_tokens puts the tokenizer's <s> before the template's own, as Llama-2's
        tokenizer does to the rendered text in vLLM (`<s><s>[INST] ...`).
        """
        system = "\n\n".join(_text_of(m) for m in messages if m.get("role") == "system")
        ids: list[int] = []
        pending_user: str | None = None
        for message in messages:
            role = message.get("role")
            if role == "system":
                continue
            content = _text_of(message)
            if role == "assistant":
                ids += self._user_turn(pending_user or "", system if not ids else "")
                if continue_final_message and message is messages[-1]:
                    ids += self.encode(f" {content.strip()}", add_special_tokens=False)
                else:
                    ids += [*self.encode(f" {content.strip()} ", add_special_tokens=False), EOS_ID]
                pending_user = None
            else:  # user, and any other role, speaks in an [INST] block
                pending_user = content if pending_user is None else f"{pending_user}\n\n{content}"
        if pending_user is not None or not ids:
            ids += self._user_turn(pending_user or "", system if not ids else "")
        return [BOS_ID, *ids] if add_special_tokens else ids

    def _user_turn(self, user: str, system: str) -> list[int]:
        if system:
            user = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}"
        return self.encode(f"[INST] {user.strip()} [/INST]", add_special_tokens=True)


def _text_of(message: dict) -> str:
    """A message's text; OpenAI content-part lists are joined (text parts only)."""
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))
