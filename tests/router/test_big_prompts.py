"""A prompt of megabytes through a gateway that counts prompt tokens with a tokenizer
(--tokenizer), with real processes on 127.0.0.1: an echo worker that spaces its tokens 50 ms
apart, and the gateway in front. Counting that prompt takes the tokenizer seconds; meanwhile
the gateway must go on relaying the other streams it carries."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.router.procs import start_echo_worker, start_gateway

WORDS = "the cat sat on the mat "


def _tokenizer(folder) -> str:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([WORDS], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def _stream_until(gateway: str, stop: threading.Event, arrivals: list[float]) -> None:
    """A long stream, each chunk's arrival noted, until `stop` is set (or it ends: 20 s)."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            arrivals.append(time.monotonic())
            if stop.is_set():
                return


def _pauses_during(tmp_path, action: Callable[[str], object]) -> tuple[object, float, float]:
    """Run `action(gateway URL)` while a stream flows through the same gateway: (what it
    returned, how long it took, the stream's longest pause meanwhile)."""
    worker, wu = start_echo_worker(token_delay_ms=50)
    gateway, gu = start_gateway("--workers", wu, "--tokenizer", _tokenizer(tmp_path),
                                "--max-body-bytes", str(16 << 20))
    stop = threading.Event()
    arrivals: list[float] = []
    try:
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream_until, gu, stop, arrivals)
            deadline = time.monotonic() + 30
            while len(arrivals) < 6:  # the stream is flowing
                assert time.monotonic() < deadline and not stream.done()
                time.sleep(0.02)
            t0 = time.monotonic()
            result = action(gu)
            took = time.monotonic() - t0
            time.sleep(0.3)  # a chunk or more after it
            stop.set()
            stream.result(timeout=60)
    finally:
        gateway.stop()
        worker.stop()
    during = [t for t in arrivals if t0 <= t <= t0 + took + 0.3]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert gaps, arrivals
    return result, took, max(gaps)


def test_a_huge_prompt_being_counted_does_not_pause_the_other_streams(tmp_path):
    huge = {"model": "m", "prompt": WORDS * 350_000, "max_tokens": 1}  # 8 MB, ~2 M tokens
    r, took, pause = _pauses_during(
        tmp_path, lambda gu: httpx.post(gu + "/v1/completions", json=huge, timeout=120))
    assert r.status_code < 500, r.text
    # Counting took most of the huge request's time; the stream went on meanwhile: its longest
    # pause is a small part of that (on the loop, it was all of it).
    assert pause < took / 4, (pause, took)


async def _two_huge_ws_requests(gateway: str) -> list[dict]:
    """The huge prompt as a socket's first request (placed with it) and as its next one."""
    # 3 MB: under the echo worker's 4 MiB message bound (aiohttp's default).
    huge = json.dumps({"model": "m", "prompt": WORDS * 130_000, "max_tokens": 1})
    ends = []
    async with aiohttp.ClientSession() as s, s.ws_connect(gateway + "/v1/ws", max_msg_size=0) as ws:
        for _ in range(2):
            await ws.send_str(huge)
            for _ in range(10):  # bounded: a token and `done`
                msg = json.loads((await ws.receive(timeout=120)).data)
                if msg.get("type") == "done" or "error" in msg:
                    ends.append(msg)
                    break
    return ends


def test_a_huge_prompt_over_a_websocket_does_not_pause_the_other_streams(tmp_path):
    """The same over the gateway's WebSocket: the socket's first request and its next ones
    were counted on the loop."""
    ends, took, pause = _pauses_during(tmp_path, lambda gu: asyncio.run(_two_huge_ws_requests(gu)))
    assert [e.get("type") for e in ends] == ["done", "done"], ends
    assert pause < took / 4, (pause, took)


async def test_a_lone_surrogate_in_a_counted_prompt_is_not_a_500(tmp_path):
    """A lone surrogate escape ("\\ud800") in a prompt is a str that is no Unicode text: the
    tokenizer refuses it with a TypeError, which was a 500 (and, as a WebSocket's first message,
    a closed socket) whenever the gateway counted tokens with --tokenizer, short prompts on the
    loop and long ones in a thread alike. It goes on to the worker, as without --tokenizer."""
    worker, wu = start_echo_worker()
    gateway, gu = start_gateway("--workers", wu, "--tokenizer", _tokenizer(tmp_path))
    try:
        long = "the cat " * 2000  # past THREAD_TOKENIZE_CHARS: counted in a thread
        async with httpx.AsyncClient(timeout=30) as client:
            for path, body in (
                ("/v1/completions", '{"model": "m", "prompt": "a\\ud800b", "max_tokens": 2}'),
                ("/v1/completions", '{"model": "m", "prompt": "' + long + '\\udc00", "max_tokens": 2}'),
                ("/v1/chat/completions",
                 '{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
            ):
                r = await client.post(gu + path, content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == 200, (path, r.text)
        async with aiohttp.ClientSession() as s, s.ws_connect(gu + "/v1/ws") as ws:
            await ws.send_str('{"model": "m", "prompt": "a\\ud800", "max_tokens": 2}')
            msg = await ws.receive(timeout=30)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg  # the socket was closed, 1000
        log = gateway.output()
    finally:
        gateway.stop()
        worker.stop()
    assert "Traceback" not in log and "ERROR" not in log, log
