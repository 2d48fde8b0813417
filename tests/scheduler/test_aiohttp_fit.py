"""The request handlers against the aiohttp installed: HeadTimedRequestHandler
(scheduler/receive_timeout.py), CappedRequestHandler (scheduler/connection_limit.py), their
worker twins and the services' OpenAIErrorRequestHandler use aiohttp's private RequestHandler
attributes. Their lists of them are whole, the installed aiohttp has them all, and one that
lacks one (a stand-in: the installed handler less a name, as aiohttp 3.13 lacks `_upgraded`) is
refused at start-up, each service exiting with one line that names the aiohttp and the name,
not failing per connection."""

from __future__ import annotations

import ast
import asyncio
import inspect
import itertools
import logging
import subprocess
import sys
import textwrap
import tomllib
import zlib

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from inference_worker.server import connection_limit as worker_connection_limit
from inference_worker.server import http_errors as worker_http_errors
from inference_worker.server import receive_timeout as worker_receive_timeout
from scheduler import connection_limit as scheduler_connection_limit
from scheduler import http_errors as scheduler_http_errors
from scheduler import receive_timeout as scheduler_receive_timeout
from scheduler.app import connection_error
from tests.router.procs import REPO, free_port

# (receive_timeout, connection_limit, http_errors) of each twin
TWINS = [(scheduler_receive_timeout, scheduler_connection_limit, scheduler_http_errors),
         (worker_receive_timeout, worker_connection_limit, worker_http_errors)]
twins = pytest.mark.parametrize(("timeout_mod", "limit_mod", "errors_mod"), TWINS,
                                ids=["scheduler", "worker"])
HANDLERS = [cls for mods in TWINS for cls in (mods[0].HeadTimedRequestHandler, mods[1].CappedRequestHandler,
                                               mods[2].OpenAIErrorRequestHandler)]
handlers = pytest.mark.parametrize("handler", HANDLERS, ids=lambda c: f"{c.__module__}.{c.__name__}")


def handler_without(*gone: str) -> type:
    """A stand-in for aiohttp's RequestHandler: the installed one's attributes and methods but
    `gone` (those only asyncio.Protocol also defines then fall back to its no-ops)."""
    namespace = {name: getattr(RequestHandler, name) for name in dir(RequestHandler)
                 if not name.startswith("__") and name not in gone}
    return type("RequestHandler", (asyncio.Protocol,), namespace)


def _self_names(cls: type) -> set[str]:
    """The names `cls`'s own code reads or writes on `self`, or calls on `super()`."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"):
            names.add(node.attr)
    return names


def _project_names(cls: type) -> set[str]:
    """What this project's classes of `cls` define: their slots, methods and class attributes."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("scheduler", "inference_worker"):
            names.update(klass.__dict__, inspect.get_annotations(klass))
    return names


@handlers
def test_each_handler_lists_all_it_uses_of_aiohttp(handler):
    """Whatever a handler's code uses on self that is not the project's own is in its lists
    (the start-up check reads only those): a name added to the code must be added there."""
    listed = set(handler.AIOHTTP_ATTRIBUTES) | set(handler.AIOHTTP_METHODS)
    for cls in handler.__mro__:
        if cls.__module__.split(".")[0] not in ("scheduler", "inference_worker"):
            continue
        used = _self_names(cls) - _project_names(cls) | {
            name for name, value in cls.__dict__.items()
            if inspect.isfunction(value) and hasattr(RequestHandler, name)}  # overrides
        assert used <= listed, f"{cls.__name__} uses {sorted(used - listed)} of aiohttp, not listed"


@handlers
def test_the_installed_aiohttp_has_all_the_handlers_use(handler):
    assert scheduler_receive_timeout.aiohttp_mismatch(handler) == []
    scheduler_receive_timeout.require_aiohttp_handler(handler)  # no SystemExit


def test_the_supported_range_is_pyprojects_and_holds_the_installed_aiohttp():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    spec = scheduler_receive_timeout.SUPPORTED_AIOHTTP
    assert f"aiohttp{spec}" in project["dependencies"]
    assert worker_receive_timeout.SUPPORTED_AIOHTTP == spec
    version = tuple(int(n) for n in aiohttp.__version__.split(".")[:3])
    (low, high) = (tuple(int(n) for n in part.lstrip("<>=").split(".")) for part in spec.split(","))
    assert low <= version < high, (aiohttp.__version__, spec)


@twins
def test_a_handler_lacking_a_name_is_named(timeout_mod, limit_mod, errors_mod):
    capped = limit_mod.CappedRequestHandler
    assert timeout_mod.aiohttp_mismatch(capped, handler_without("_upgraded")) == ["_upgraded"]
    assert timeout_mod.aiohttp_mismatch(capped, handler_without("_request_handler", "data_received")) == [
        "_request_handler", "data_received()"]
    assert timeout_mod.aiohttp_mismatch(
        errors_mod.OpenAIErrorRequestHandler, handler_without("log_exception")) == ["log_exception()"]
    # What the head timer alone uses: not the cap's.
    assert timeout_mod.aiohttp_mismatch(timeout_mod.HeadTimedRequestHandler,
                                        handler_without("_request_handler")) == []


def _runner(errors_mod, app: web.Application | None = None) -> web.AppRunner:
    app = web.Application() if app is None else app
    if errors_mod is scheduler_http_errors:
        return errors_mod.OpenAIErrorAppRunner(app, answer=connection_error,
                                               log=logging.getLogger("test.aiohttp_fit"))
    return errors_mod.OpenAIErrorAppRunner(app)


async def _serve(errors_mod, app: web.Application) -> tuple[web.AppRunner, str]:
    runner = _runner(errors_mod, app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def _body_reader(timeout_mod, reading: asyncio.Event) -> web.Application:
    """POST /: the body read as every route reads it (read_body_within, a 30 s receive timeout),
    its size answered; a body that cannot be decoded a 400."""

    async def read(request: web.Request) -> web.Response:
        reading.set()
        try:
            body = await timeout_mod.read_body_within(request, 30.0, logging.getLogger("test.aiohttp_fit"))
        except web.RequestPayloadError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"read": len(body)})

    app = web.Application()
    app.router.add_post("/", read)
    return app


@twins
async def test_a_deflate_body_refused_at_its_end_fails_its_read_at_once(timeout_mod, limit_mod, errors_mod):
    """aiohttp refuses a deflate body that ends unfinished only at its end. When those last bytes
    came after the head (its handler already reading), it queued the refusal as the next
    request and left the read waiting for bytes that never come: the receive timeout later
    (60 s by default), a 408. The read fails at once: a 400. A deflate body sent so is read."""
    good = zlib.compress(b'{"prompt": "x"}')
    # Not deflate, and yet no error until its end (raw deflate, as aiohttp falls back to, reads
    # it as a block cut short); a deflate body.
    for body, answer in ((b'{"lease_id": 0}', b"HTTP/1.1 400"), (good, b"HTTP/1.1 200")):
        reading = asyncio.Event()
        runner, url = await _serve(errors_mod, _body_reader(timeout_mod, reading))
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            await asyncio.wait_for(reading.wait(), 10)  # the handler reads: the body comes after
            writer.write(body)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(answer), head
        finally:
            writer.close()
            await runner.cleanup()


@twins
async def test_an_expect_header_other_than_100_continue_is_a_417_in_the_openai_shape(
        timeout_mod, limit_mod, errors_mod, caplog):
    """aiohttp checks Expect before any middleware or route runs: its 417 was plain text, and a
    value that is not UTF-8 failed to encode, a 500 logged with a traceback. On a route and on
    a path no route serves (the worker has no catch-all); 100-continue still goes on."""
    runner, url = await _serve(errors_mod, _body_reader(timeout_mod, asyncio.Event()))
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            for path, expect in itertools.product(("/", "/nowhere"), ("junk", b"\xff\xfe", "x" * 5000)):
                r = await client.post(url + path, headers={"Expect": expect}, content=b"{}")
                assert r.status_code == 417, (path, expect, r.text)
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, error
                assert error["type"] == "invalid_request_error" and len(error["message"]) < 400, error
            r = await client.post(url + "/", headers={"Expect": "100-Continue"}, content=b"{}")
            assert (r.status_code, r.json()) == (200, {"read": 2})
    finally:
        await runner.cleanup()
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


def _assert_the_one_line(message: str, *names: str) -> None:
    assert message.startswith(f"error: aiohttp {aiohttp.__version__} is not one this service runs on: ")
    assert "\n" not in message, message
    for name in names:
        assert name in message, message
    assert f"pip install 'aiohttp{scheduler_receive_timeout.SUPPORTED_AIOHTTP}'" in message


@twins
def test_on_an_aiohttp_lacking_a_name_start_up_and_the_runner_are_refused(
        timeout_mod, limit_mod, errors_mod, monkeypatch):
    monkeypatch.setattr(timeout_mod, "RequestHandler", handler_without("_upgraded", "_request_handler"))
    with pytest.raises(SystemExit) as budget:  # first at start-up, before anything loads
        limit_mod.connection_budget(None, 1)
    _assert_the_one_line(str(budget.value), "_upgraded, _request_handler")
    with pytest.raises(SystemExit) as runner:  # and for whoever builds a runner
        _runner(errors_mod)
    _assert_the_one_line(str(runner.value), "_upgraded, _request_handler")



@twins
def test_an_aiohttp_runner_that_builds_its_server_elsewhere_is_refused(
        timeout_mod, limit_mod, errors_mod, monkeypatch):
    """OpenAIErrorAppRunner serves through its handlers by overriding AppRunner._make_server:
    an aiohttp that renamed it would serve every connection with its plain handler, silently.
    The installed one has it; a stand-in without it stops the runner with the one line."""
    timeout_mod.require_aiohttp_runner()
    monkeypatch.setattr(timeout_mod.web, "AppRunner", type("AppRunner", (), {}))
    with pytest.raises(SystemExit) as runner:
        _runner(errors_mod)
    _assert_the_one_line(str(runner.value), "AppRunner lacks _make_server()")

SERVICES = {
    "gateway": ("scheduler.receive_timeout", "router.__main__", ["--workers", "http://127.0.0.1:9"]),
    "scheduler": ("scheduler.receive_timeout", "scheduler.__main__", ["--workers", "http://127.0.0.1:9"]),
    "worker": ("inference_worker.server.receive_timeout", "inference_worker.__main__",
               ["--backend", "sim", "--sim-profile", "tiny", "--served-model-name", "m"]),
}


@pytest.mark.parametrize("older", [False, True], ids=["", "before-3.11.18"])
@pytest.mark.parametrize("service", list(SERVICES))
def test_a_service_on_an_aiohttp_lacking_a_name_exits_with_one_line(service, older):
    """The real start-up, in a child whose check reads the stand-in: exit 1 and the one line,
    no traceback, nothing served. `older`: aiohttp.http_exceptions also lacks BadHttpMethod, as
    before 3.11.18, whose import by name ended start-up in an ImportError traceback."""
    check_mod, main_mod, argv = SERVICES[service]
    code = textwrap.dedent(f"""\
        import aiohttp.web  # aiohttp's own modules, before the name goes
        if {older}:
            del aiohttp.http_exceptions.BadHttpMethod
        import {check_mod} as check
        from tests.scheduler.test_aiohttp_fit import handler_without
        check.RequestHandler = handler_without("_upgraded")
        from {main_mod} import main
        main({[*argv, "--port", str(free_port())]!r})
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) == 1, lines
    _assert_the_one_line(lines[0], "lacks _upgraded, which")
