"""The Responses API's request body (inference_worker/server/responses_protocol.py) as parsed,
without a worker: what it refuses before anything is generated."""

from __future__ import annotations

import json

import pytest

from inference_worker.server.errors import APIError
from inference_worker.server.responses_protocol import parse_request


@pytest.mark.parametrize(
    ("option", "param"),
    [
        ('"text": {"verbosity": NaN}', "text.verbosity"),
        ('"text": {"format": {"type": "text", "x": [1, -Infinity]}}', "text.format.x.1"),
        ('"reasoning": {"effort": Infinity}', "reasoning.effort"),
    ],
)
def test_a_non_finite_number_in_an_echoed_option_is_a_400_naming_it(option, param) -> None:
    # The response repeats `text` and `reasoning`: a NaN there made every answer (whole, each
    # stream event, the stored one) JSON that strict parsers refuse. Found by sampler_fuzz.
    raw = b'{"model": "m", "input": "hi", ' + option.encode() + b"}"
    with pytest.raises(APIError) as caught:
        parse_request(raw)
    assert caught.value.status == 400 and caught.value.param == param


def test_finite_free_form_options_are_taken_and_echoed_as_strict_json() -> None:
    body = parse_request(b'{"model": "m", "input": "hi", "text": {"verbosity": "low", "n": [1.5, 2]},'
                         b' "reasoning": {"effort": 1e308}}')
    echoed = body.echoed_fields()
    assert json.loads(json.dumps(echoed, allow_nan=False)) == echoed
