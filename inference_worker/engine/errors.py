"""Errors the engine raises to its callers (the server maps them to 4xx)."""

from __future__ import annotations


class EngineRequestError(ValueError):
    """A request the engine cannot accept; the server answers 400."""


class PromptTooLongError(EngineRequestError):
    """Prompt (or prompt + max_tokens) does not fit in max_model_len."""


class EmptyPromptError(EngineRequestError):
    """A request with no prompt tokens."""


class DuplicateRequestError(EngineRequestError):
    """A request id that is already in flight."""


class EngineDeadError(RuntimeError):
    """The engine loop died (e.g. the model raised); the server answers 500/503."""


class EngineShutdownError(RuntimeError):
    """The worker stopped before the request finished (its drain time ran out); 503."""
