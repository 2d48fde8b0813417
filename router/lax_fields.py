"""The request fields the gateway acts on, read as the engines behind it read them.

vLLM and SGLang validate a request with pydantic models in its default (lax) mode: `"stream":
"true"`, `1` and `1.0` are true, `"priority": "2"` and `2.0` are 2. The gateway reads a few
fields itself (stream, priority, stream_options, background; max_tokens and n for its
estimates) and refused anything but a JSON boolean or integer there: a client that worked
against vLLM got a 400 once the router stood in front of it. Read here with pydantic's own
rules, so the gateway takes what the engine takes and means what the engine will mean (a
stream the engine streams is relayed as one); what neither takes is still refused, and a
stricter engine (TGI) answers for itself, as it would without the gateway.

The JSON types come first, without pydantic: they are what clients send.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

_BOOL = TypeAdapter(bool)
_INT = TypeAdapter(int)


def lax_bool(value: Any) -> bool:
    """`value` as pydantic's lax bool (true, 1, 1.0, "true", "yes", "on", "1", ...); raises
    ValueError (pydantic's ValidationError is one) for what it refuses."""
    if value is True or value is False:
        return value
    return _BOOL.validate_python(value)


def lax_int(value: Any) -> int:
    """`value` as pydantic's lax int (4, 4.0, "4", True); raises ValueError for what it refuses
    (4.5, "4.5", "", an object, more than 4300 digits)."""
    if type(value) is int:
        return value
    return _INT.validate_python(value)


def lax_int_or_none(value: Any) -> int | None:
    """lax_int, or None where the engine would refuse the value (the estimates' "not given")."""
    if type(value) is int:
        return value
    if value is None or isinstance(value, bool):  # no count an estimate should plan for
        return None
    try:
        return _INT.validate_python(value)
    except ValueError:
        return None


def lax_true(value: Any) -> bool:
    """Whether the engine reads `value` as true (a value it refuses is not: it answers 400)."""
    if value is True or value is None or value is False:
        return value is True
    try:
        return _BOOL.validate_python(value)
    except ValueError:
        return False
