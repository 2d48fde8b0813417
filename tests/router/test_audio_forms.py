"""Audio requests (OpenAI's and vLLM's /v1/audio/transcriptions and /translations) are
multipart forms, not JSON: the gateway answered each one 400 "request body is not valid JSON".
It now reads the form's text fields (router/form_fields.py) to place the request and passes
the form on untouched."""

from __future__ import annotations

import hashlib
import os

import httpx
import openai
import pytest

from tests.router.procs import gateway_over_an_echo_worker

AUDIO = os.urandom(200_000)  # any bytes: the stand-in worker only measures what arrived
ARRIVED = f"{len(AUDIO)} bytes sha256 {hashlib.sha256(AUDIO).hexdigest()}"


@pytest.fixture(scope="module", params=["scheduled", "static"])
def gateway(request):
    with gateway_over_an_echo_worker(request.param) as (url, _proc):
        yield url


def test_audio_is_transcribed_and_translated_through_the_gateway(gateway):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=30)
    text = client.audio.transcriptions.create(model="m", file=("a.wav", AUDIO, "audio/wav")).text
    assert text == f"{ARRIVED} at /v1/audio/transcriptions"
    r = httpx.post(gateway + "/v1/audio/translations", timeout=30, data={"model": "m"},
                   files={"file": ("a.wav", AUDIO, "audio/wav")})  # (the client's is deprecated)
    assert r.status_code == 200 and r.json()["text"] == f"{ARRIVED} at /v1/audio/translations", r.text


def test_a_streamed_transcription_is_relayed_as_a_stream(gateway):
    with httpx.stream("POST", gateway + "/v1/audio/transcriptions", timeout=30,
                      files={"file": ("a.wav", AUDIO, "audio/wav")},
                      data={"model": "m", "stream": "true", "language": "en"}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(httpx.Response(200, content=e).json()["choices"][0]["delta"]["content"]
                   for e in events[:-1])
    assert text.strip() == f"{ARRIVED} at /v1/audio/transcriptions"


def test_a_form_without_a_model_goes_to_the_pools_model(gateway):
    r = httpx.post(gateway + "/v1/audio/transcriptions", timeout=30, files={"file": ("a.wav", AUDIO)})
    assert r.status_code == 200 and r.json()["text"].startswith(ARRIVED), r.text


def test_a_form_for_a_model_nobody_serves_is_a_404(gateway):
    r = httpx.post(gateway + "/v1/audio/transcriptions", timeout=30, files={"file": ("a.wav", AUDIO)},
                   data={"model": "whisper-large"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


@pytest.mark.parametrize("content_type", ["multipart/form-data", "multipart/form-data; boundary=other"])
def test_a_form_its_boundary_does_not_delimit_is_a_400(gateway, content_type):
    body = b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--b0--\r\n'
    r = httpx.post(gateway + "/v1/audio/transcriptions", content=body, timeout=30,
                   headers={"Content-Type": content_type})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "multipart/form-data" in err["message"]
