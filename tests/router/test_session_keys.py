"""The gateway's session keys (router/sessions.py): off unless a header is named, the header's
value else the body's prompt_cache_key, sent to the scheduler as a stable 63-bit digest."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from router.config import load_router_config
from router.proxy import Proxy
from router.sessions import session_key, session_of

H = "x-session-id"


def test_sessions_are_off_unless_a_header_is_named():
    assert session_of({H: "abc"}, {"prompt_cache_key": "abc"}, "") is None


def test_the_header_names_the_session_else_the_bodys_prompt_cache_key():
    key = session_key("abc")
    assert session_of({H: "abc"}, {}, H) == key
    assert session_of({}, {"prompt_cache_key": "abc"}, H) == key
    assert session_of({H: "abc"}, {"prompt_cache_key": "other"}, H) == key  # the header wins
    assert session_of({H: ""}, {"prompt_cache_key": "abc"}, H) == key
    for body in ({}, {"prompt_cache_key": 7}, {"prompt_cache_key": ""}, {"prompt_cache_key": None},
                 {"prompt_cache_key": "x" * 8193}):
        assert session_of({}, body, H) is None


def test_the_key_is_a_stable_63_bit_digest_never_the_value():
    # The same in every process and replica (Python's own hash() is salted per process).
    assert session_key("conversation-42") == 6095220504890336742
    code = "from router.sessions import session_key; print(session_key('conversation-42'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"})
    assert int(other.stdout) == 6095220504890336742
    keys = {session_key(f"user-{i}") for i in range(1000)}
    assert len(keys) == 1000 and all(0 <= k < 1 << 63 for k in keys)
    # A header that was not UTF-8 (aiohttp hands its bytes on as lone surrogates) and a JSON
    # string's lone surrogate still have keys.
    assert session_key("caf\udce9") != session_key("caf\ud800")


def test_the_schedule_body_gets_the_key_only_when_the_request_has_a_session():
    proxy = SimpleNamespace(cfg=SimpleNamespace(session_header=H))
    body: dict = {"model": "m"}
    Proxy.note_session(proxy, body, {H: "abc"}, {})  # type: ignore[arg-type]
    assert body == {"model": "m", "session": session_key("abc")}
    body = {"model": "m"}
    Proxy.note_session(proxy, body, {}, {"model": "m"})  # type: ignore[arg-type]
    assert body == {"model": "m"}


def test_the_header_flag_env_and_check(monkeypatch):
    base = ["--scheduler", "http://127.0.0.1:8090"]
    assert load_router_config(base).session_header == ""
    assert load_router_config([*base, "--session-header", H]).session_header == H
    monkeypatch.setenv("ROUTER_SESSION_HEADER", "x-conversation")
    assert load_router_config(base).session_header == "x-conversation"
    with pytest.raises((ValidationError, SystemExit)):
        load_router_config([*base, "--session-header", "x session"])
