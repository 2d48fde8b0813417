"""Incremental detokenization with stop strings, per request.

Decoding a token on its own can produce a broken character (a UTF-8 sequence split
across tokens) or lose a leading space, so each step decodes a short window
(`prefix_offset:`) and emits only what it adds over the window's previous text
(the scheme vLLM and TGI use). Text that could still turn into a stop string is held
back until it cannot; a matched stop string is cut out of the text, as OpenAI does, or
kept as its end (`include_stop`, vLLM's include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Sequence

from inference_worker.engine.types import WorkerTokenizer

_PROMPT_CONTEXT = 6  # prompt tokens kept as decoding context for the first output tokens


class IncrementalDetokenizer:
    __slots__ = (
        "_ids",
        "_include_stop",
        "_max_stop_len",
        "_prefix_offset",
        "_read_offset",
        "_sent",
        "_stops",
        "_text",
        "_tokenizer",
    )

    def __init__(
        self,
        tokenizer: WorkerTokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str],
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._include_stop = include_stop
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""  # all output text decoded so far
        self._sent = 0  # how much of _text has been emitted
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

    def add_token(self, token_id: int, find_stop: bool = True) -> str | None:
        """Feed one output token. Returns the matched stop string if the text now contains one
        (not looked for with find_stop false: before the request's min_tokens)."""
        ids = self._ids
        ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(ids[self._prefix_offset : self._read_offset])
        new_text = decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if len(ids) > 4 * _PROMPT_CONTEXT:  # keep the window short: decoding cost stays O(1)
            drop = self._prefix_offset
            del ids[:drop]
            self._prefix_offset = 0
            self._read_offset -= drop
        start = max(0, len(self._text) - self._max_stop_len + 1)
        self._text += delta
        if not find_stop:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:  # the earliest match wins, whatever the list order
            pos = self._text.find(stop, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        self._text = self._text[: pos + len(stop) if self._include_stop else pos]
        return stop

    def take(self, final: bool) -> str:
        """The text not yet emitted; short of the end, keep back what may begin a stop string."""
        end = len(self._text)
        if not final and self._max_stop_len > 1:
            end = max(self._sent, end - self._max_stop_len + 1)
        out = self._text[self._sent : end]
        self._sent = end
        return out

    @property
    def text(self) -> str:
        return self._text
