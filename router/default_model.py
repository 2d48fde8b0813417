"""The model a request that names none is for.

vLLM serves a request without `model` (absent, null or "") with the model it serves, and our
worker does the same: a client that worked against one engine without naming the model got a
400 "'model' is required" once the gateway stood in front. The gateway routes such a request
as the one model its pool serves, and forwards the body as it came (the engine fills the name
in itself, as without the gateway). A pool that serves several models has no default: the
client must say which (a 400 naming them), as it must when no worker has said what it serves.
"""

from __future__ import annotations

from scheduler.clip import clip_repr

# How many of the models served a refusal names.
_NAMED = 5


class NoDefaultModel(ValueError):
    """The request names no model and the pool serves several (or none is known)."""


def default_model(served: list[str]) -> str:
    """The one model served, or NoDefaultModel with the message the client gets."""
    if len(served) == 1:
        return served[0]
    if not served:
        raise NoDefaultModel("'model' is required: no worker has said which model it serves yet")
    names = ", ".join(clip_repr(m) for m in served[:_NAMED])
    more = f" and {len(served) - _NAMED} more" if len(served) > _NAMED else ""
    raise NoDefaultModel(f"'model' is required: this gateway serves several models ({names}{more})")
