"""The gateway reads the fields it acts on as vLLM's pydantic models (lax mode) read them
(router/lax_fields.py): a value the engine takes is taken, with the meaning the engine gives
it; one the engine refuses is refused."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from router.lax_fields import lax_bool, lax_int, lax_int_or_none, lax_true
from router.tokens import max_tokens_of


class EngineFields(BaseModel):
    """The shape of vLLM's request fields the gateway reads (protocol.py: plain pydantic)."""

    stream: bool | None = False
    priority: int = 0


BOOLS = [True, False, 1, 0, 1.0, 0.0, "true", "false", "True", "yes", "no", "on", "off", "1", "0",
         "t", "f", 2, -1, 0.5, "maybe", "", " true", [], {}, "2"]
INTS = [0, 7, -3, 7.0, "7", " 7 ", "+7", "-3", True, False, 7.5, "7.5", "x", "", [], {}, 10**30]


def engine_reads(field: str, value):
    try:
        return getattr(EngineFields(**{field: value}), field)
    except ValueError:
        return "refused"


@pytest.mark.parametrize("value", BOOLS, ids=repr)
def test_a_flag_is_what_the_engine_makes_of_it(value):
    try:
        ours = lax_bool(value)
    except ValueError:
        ours = "refused"
    assert ours == engine_reads("stream", value)
    assert lax_true(value) is (engine_reads("stream", value) is True)


@pytest.mark.parametrize("value", INTS, ids=repr)
def test_an_integer_is_what_the_engine_makes_of_it(value):
    try:
        ours = lax_int(value)
    except ValueError:
        ours = "refused"
    assert ours == engine_reads("priority", value)


def test_the_estimates_take_the_engines_integers_and_plan_for_nothing_else():
    assert lax_int_or_none("12") == 12 and lax_int_or_none(12.0) == 12
    for junk in (None, True, "x", 1.5, [], {}):
        assert lax_int_or_none(junk) is None
    assert max_tokens_of({"max_tokens": "64"}) == 64
    assert max_tokens_of({"max_tokens": "lots"}) is None
