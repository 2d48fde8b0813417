"""The text fields of a multipart/form-data body: how an audio request names its model.

OpenAI's and vLLM's `/v1/audio/transcriptions` and `/v1/audio/translations` take the audio
file and the options (`model`, `stream`, `language`, ...) as a form, not JSON: the gateway
answered every such request 400 "request body is not valid JSON". It reads the form's text
fields (RFC 7578: each part's Content-Disposition names it; a part with a filename is a file,
left unread) and sends the body on untouched, with the client's Content-Type and its boundary.
"""

from __future__ import annotations

from email.message import Message

# A text field larger than this is no option the gateway reads (a prompt is at most a few KB):
# left out, as the file parts are.
MAX_FIELD_BYTES = 64 * 1024
_CRLF = b"\r\n"


class MalformedForm(ValueError):
    """The body is no multipart/form-data the Content-Type's boundary delimits."""


def form_fields(content_type: str, raw: bytes) -> dict[str, str]:
    """The form's text fields by name (the first of a repeated name); raises MalformedForm."""
    boundary = _param(content_type, "content-type", "boundary")
    if not boundary or len(boundary) > 70:  # RFC 2046: 1 to 70 characters
        raise MalformedForm("its Content-Type names no boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    start = _first_delimiter(raw, delimiter)
    fields: dict[str, str] = {}
    while True:
        end_of_line = start + len(delimiter)
        if raw.startswith(b"--", end_of_line):
            return fields  # the closing delimiter
        if not raw.startswith(_CRLF, end_of_line):
            raise MalformedForm("a delimiter is not followed by a line break")
        head_end = raw.find(_CRLF + _CRLF, end_of_line)
        if head_end < 0:
            raise MalformedForm("a part's headers do not end")
        next_start = raw.find(_CRLF + delimiter, head_end + 4)
        if next_start < 0:
            raise MalformedForm("the body does not end with the closing delimiter")
        name, filename = _disposition(raw[end_of_line + 2 : head_end])
        content = raw[head_end + 4 : next_start]
        if filename is None and name not in fields and len(content) <= MAX_FIELD_BYTES:
            try:
                fields[name] = content.decode()
            except UnicodeDecodeError:
                raise MalformedForm(f"field {name!r} is not UTF-8 text") from None
        start = next_start + 2


def _first_delimiter(raw: bytes, delimiter: bytes) -> int:
    if raw.startswith(delimiter):
        return 0
    at = raw.find(_CRLF + delimiter)  # after a preamble, which is ignored
    if at < 0:
        raise MalformedForm("the boundary does not occur in the body")
    return at + 2


def _disposition(head: bytes) -> tuple[str, str | None]:
    """A part's field name and filename (None: a text field)."""
    for line in head.split(_CRLF):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-disposition":
            text = value.decode("utf-8", "replace").strip()
            name = _param(text, "content-disposition", "name")
            if name is None:
                break
            return name, _param(text, "content-disposition", "filename")
    raise MalformedForm("a part has no Content-Disposition with a field name")


def _param(value: str, header: str, name: str) -> str | None:
    message = Message()
    message[header] = value
    found = message.get_param(name, header=header)
    if isinstance(found, tuple):  # an RFC 2231 value: (charset, language, text)
        found = found[2]
    return found
