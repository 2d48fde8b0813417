"""router/form_fields.py: the text fields of a multipart/form-data body, as httpx, curl and
OpenAI's clients write one."""

from __future__ import annotations

import httpx
import pytest

from router.form_fields import MAX_FIELD_BYTES, MalformedForm, form_fields


def encoded(data: dict) -> tuple[str, bytes]:
    files = {"file": ("a.wav", b"\0" * 100)}
    request = httpx.Request("POST", "http://127.0.0.1/", data=data, files=files)
    return request.headers["Content-Type"], request.read()


def test_the_text_fields_and_not_the_files():
    content_type, body = encoded({"model": "whisper", "stream": "true", "prompt": "Grüße"})
    assert form_fields(content_type, body) == {"model": "whisper", "stream": "true", "prompt": "Grüße"}


def test_a_quoted_boundary_a_preamble_and_a_repeated_field():
    body = (b"ignored preamble\r\n--b 1\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n"
            b"--b 1\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nsecond\r\n--b 1--\r\n")
    assert form_fields('multipart/form-data; boundary="b 1"', body) == {"model": "m"}


def test_a_field_too_large_to_be_an_option_is_left_out():
    content_type, body = encoded({"model": "m", "prompt": "x" * (MAX_FIELD_BYTES + 1)})
    assert form_fields(content_type, body) == {"model": "m"}


@pytest.mark.parametrize(("content_type", "body", "why"), [
    ("multipart/form-data", b"--b\r\n\r\n--b--", "no boundary"),
    ("multipart/form-data; boundary=b", b"no delimiter here", "does not occur"),
    ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; name=\"m\"\r\n\r\nx",
     "closing delimiter"),
    ("multipart/form-data; boundary=b", b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--", "field name"),
    ("multipart/form-data; boundary=b",
     b"--b\r\nContent-Disposition: form-data; name=\"m\"\r\n\r\n\xff\r\n--b--", "UTF-8"),
    ("multipart/form-data; boundary=b", b"--bX\r\n", "line break"),
])
def test_a_malformed_form_says_what_is_wrong(content_type, body, why):
    with pytest.raises(MalformedForm, match=why):
        form_fields(content_type, body)
