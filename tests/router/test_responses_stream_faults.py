"""A Responses API stream (`POST /v1/responses`, stream true) whose worker fails after the
stream began, through a real scheduler and gateway on 127.0.0.1: the worker is a stand-in
that sends the first events of a response, then cuts its connection (or goes silent). The
client must get the Responses API's own `error` event, numbered after the last event it got,
not chat's untyped `data: {"error": ...}` and `data: [DONE]`, which a Responses client does not
parse."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal

import httpx
from aiohttp import web
from openai.types.responses import ResponseErrorEvent

from tests.router.procs import start_gateway
from tests.router.stand_ins import serve_stand_in, stand_ins_behind_router

DELTAS = 5


def _event(kind: str, seq: int, **fields: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n".encode()


def _opening() -> list[bytes]:
    """A response's first events, as a worker writes them: created, in progress, then deltas."""
    response = {"id": "resp_cut", "object": "response", "status": "in_progress", "output": []}
    events = [_event("response.created", 0, response=response),
              _event("response.in_progress", 1, response=response)]
    events += [_event("response.output_text.delta", 2 + i, item_id="msg_1", output_index=0,
                      content_index=0, delta=" tok") for i in range(DELTAS)]
    return events


async def _answer_opening(request: web.Request) -> web.StreamResponse:
    """A stream begun, its opening events written (_opening)."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in _opening():
        await resp.write(event)
    return resp


async def _cut_mid_stream(request: web.Request) -> web.StreamResponse:
    """The worker's process dies mid-answer: its connection closes without the stream's end."""
    resp = await _answer_opening(request)
    await asyncio.sleep(0.2)
    assert request.transport is not None
    request.transport.close()
    return resp


async def _silent_mid_stream(request: web.Request) -> web.StreamResponse:
    """A worker that hangs after a few events: the gateway's idle-stream timeout ends it."""
    resp = await _answer_opening(request)
    await asyncio.sleep(30)  # cancelled when the gateway gives up on it (handler_cancellation)
    return resp


def _read_stream(gateway: str) -> str:
    body = {"model": "m", "input": "hello", "stream": True}
    with httpx.stream("POST", gateway + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        return r.read().decode()


def _events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of every event of a stream."""
    events: list[tuple[str, dict]] = []
    name = ""
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


async def _check_ends_with_responses_error(handler, gateway_args: tuple[str, ...] = ()) -> ResponseErrorEvent:
    stand_in = ([("POST", "/v1/responses", handler)], None)
    async with stand_ins_behind_router([stand_in], gateway_args, handler_cancellation=True) as (_, gateway):
        text = await asyncio.to_thread(_read_stream, gateway)
    assert "[DONE]" not in text, text[-300:]
    events = _events(text)
    # Every event the worker sent came through, then one error event numbered after the last.
    assert [name for name, _ in events[:-1]] == [
        "response.created", "response.in_progress", *["response.output_text.delta"] * DELTAS]
    name, last = events[-1]
    assert name == "error"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return ResponseErrorEvent.model_validate(last)


async def test_a_responses_stream_cut_by_its_worker_ends_with_the_responses_error_event():
    error = await _check_ends_with_responses_error(_cut_mid_stream)
    assert error.type == "error" and error.code == "upstream_error" and error.param is None
    assert "mid-stream" in error.message


async def test_a_responses_stream_whose_worker_goes_silent_ends_with_the_responses_error_event():
    error = await _check_ends_with_responses_error(
        _silent_mid_stream, ("--idle-stream-timeout-ms", "500"))
    assert error.code == "upstream_error" and "idle_timeout" in error.message


async def _endless(request: web.Request) -> web.StreamResponse:
    """A long answer: a delta every 50 ms until the gateway hangs up."""
    resp = await _answer_opening(request)
    for seq in itertools.count(2 + DELTAS):
        await asyncio.sleep(0.05)
        await resp.write(_event("response.output_text.delta", seq, item_id="msg_1", output_index=0,
                                content_index=0, delta=" tok"))
    return resp


async def test_a_responses_stream_cut_by_a_stopping_gateway_ends_with_the_responses_error_event():
    runner, url = await serve_stand_in([("POST", "/v1/responses", _endless)], handler_cancellation=True)
    try:
        gateway_proc, gateway = await asyncio.to_thread(
            start_gateway, "--workers", url, "--shutdown-timeout", "1")
        try:
            stream = asyncio.ensure_future(asyncio.to_thread(_read_stream, gateway))
            await asyncio.sleep(1.0)  # well into the answer
            gateway_proc.p.send_signal(signal.SIGTERM)
            text = await asyncio.wait_for(stream, 30)
        finally:
            gateway_proc.stop()
    finally:
        await runner.cleanup()
    assert "[DONE]" not in text, text[-300:]
    events = _events(text)
    assert len(events) > 2 + DELTAS
    name, last = events[-1]
    assert name == "error"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert ResponseErrorEvent.model_validate(last).code == "shutting_down"
