"""Browser apps on another origin calling the gateway (CORS): the headers, and a real headless
Chromium page that streams a chat completion through the gateway (Debian's chromium package;
the browser test skips with a reason without it, .ci/run installs it)."""

from __future__ import annotations

import http.server
import json
import queue
import shutil
import subprocess
import tempfile
import threading

import aiohttp
import httpx
import pytest

from tests.router.procs import free_port, start_echo_worker, start_gateway

KEY = "sekret"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def stack():
    page_port = free_port()
    page_origin = f"http://127.0.0.1:{page_port}"
    w, wu = start_echo_worker()
    open_gw, open_u = start_gateway("--workers", wu, "--api-keys", KEY, "--cors-allowed-origins", page_origin)
    any_gw, any_u = start_gateway("--workers", wu, "--cors-allowed-origins", "*")
    closed_gw, closed_u = start_gateway("--workers", wu, "--api-keys", KEY)
    yield {"origin": page_origin, "page_port": page_port, "open": open_u, "any": any_u, "closed": closed_u,
           "worker_proc": w}
    for p in (open_gw, any_gw, closed_gw, w):
        p.stop()


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    })


def test_preflight_from_a_listed_origin_is_answered_without_credentials(stack):
    r = preflight(stack["open"], stack["origin"])
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == stack["origin"]
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization,content-type"
    assert r.headers["vary"] == "Origin"


def test_preflight_from_another_origin_is_refused_in_the_openai_shape(stack):
    r = preflight(stack["open"], "http://evil.example")
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert r.json()["error"]["code"] == "cors_origin_not_allowed"


def test_answers_to_a_listed_origin_are_marked_stream_included(stack):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    headers = {"Origin": stack["origin"], "Authorization": f"Bearer {KEY}"}
    r = httpx.post(stack["open"] + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == stack["origin"]
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    with httpx.stream("POST", stack["open"] + "/v1/chat/completions", json={**body, "stream": True},
                      headers=headers) as s:
        assert s.headers["access-control-allow-origin"] == stack["origin"]
        assert s.read().endswith(b"data: [DONE]\n\n")
    # Errors are readable by the page too (else it sees only "failed to fetch").
    r = httpx.post(stack["open"] + "/v1/chat/completions", json=body, headers={"Origin": stack["origin"]})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == stack["origin"]
    assert r.headers["vary"] == "Origin"
    # Another origin, or none: nothing marked, but each says it varies by Origin (else a shared
    # cache could serve the unmarked answer to the listed origin's page).
    r = httpx.post(stack["open"] + "/v1/chat/completions", json=body,
                   headers={**headers, "Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert r.headers["vary"] == "Origin"
    r = httpx.post(stack["open"] + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in r.headers and r.headers["vary"] == "Origin"
    r = preflight(stack["open"], "http://evil.example")  # a refused preflight too
    assert r.status_code == 403 and r.headers["vary"] == "Origin"


def test_any_origin(stack):
    r = preflight(stack["any"], "http://anything.example:8080")
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
    assert "vary" not in r.headers


def test_without_origins_configured_there_is_no_cors(stack):
    r = preflight(stack["closed"], stack["origin"])  # an ordinary request, refused as one
    assert r.status_code in (401, 405) and "access-control-allow-origin" not in r.headers


async def ws_answer(url: str, protocols: tuple[str, ...]) -> tuple[str | None, list[dict]]:
    """The accepted subprotocol and the messages of one request over the gateway's WebSocket."""
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(url + "/v1/ws", protocols=protocols) as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}))
        msgs: list[dict] = []
        while not msgs or msgs[-1].get("type") != "done":
            msgs.append(json.loads((await ws.receive(timeout=10)).data))
        return ws.protocol, msgs


async def test_a_websocket_carries_its_api_key_as_a_subprotocol(stack):
    """Browsers cannot set Authorization on a WebSocket; OpenAI's convention is a subprotocol."""
    key = f"openai-insecure-api-key.{KEY}"
    protocol, msgs = await ws_answer(stack["open"], (key,))
    assert protocol == key and len(msgs) == 4  # the only one offered is accepted, or browsers fail
    protocol, _ = await ws_answer(stack["open"], ("llm-chat", key))
    assert protocol == "llm-chat"  # another offered one is preferred to echoing the key
    # The client's handshake headers stay at the gateway: the key never reaches the worker
    # (aiohttp there logs the subprotocols it was offered and did not know).
    assert KEY not in stack["worker_proc"].output()
    for protocols in ((), ("openai-insecure-api-key.wrong",)):
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await ws_answer(stack["open"], protocols)
        assert err.value.status == 401


PAGE = """<!doctype html><html><body><script>
async function call(base) {
  try {
    const r = await fetch(base + "/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer KEY"},
      body: JSON.stringify({model: "m", stream: true, max_tokens: 4,
                            messages: [{role: "user", content: "hi"}]}),
    });
    const reader = r.body.getReader(), dec = new TextDecoder();
    let text = "";
    for (;;) { const {done, value} = await reader.read(); if (done) break; text += dec.decode(value); }
    const words = text.split("\\n\\n").filter(e => e.startsWith("data: {"))
      .map(e => JSON.parse(e.slice(6)).choices[0]?.delta?.content || "").join("");
    return {status: r.status, words, request_id: r.headers.get("x-request-id")};
  } catch (e) { return {error: String(e)}; }
}
function overWebSocket(base) {
  return new Promise(resolve => {
    const ws = new WebSocket(base.replace("http", "ws") + "/v1/ws", ["openai-insecure-api-key.KEY"]);
    let words = "";
    ws.onopen = () => ws.send(JSON.stringify({model: "m", prompt: "hi", max_tokens: 2}));
    ws.onmessage = e => {
      const m = JSON.parse(e.data);
      if (m.type === "done") { ws.close(); resolve({words}); }
      else if (m.error) { resolve({error: m.error.message}); }
      else { words += m.choices[0].text || ""; }
    };
    ws.onerror = () => resolve({error: "websocket failed"});
  });
}
(async () => {
  const out = {open: await call("OPEN"), closed: await call("CLOSED"), ws: await overWebSocket("OPEN")};
  await fetch("/result", {method: "POST", body: JSON.stringify(out)});
})();
</script></body></html>"""


class _PageSite(http.server.BaseHTTPRequestHandler):
    """Serves the page and takes the result it posts back (the page's own origin)."""

    page = b""
    results: queue.Queue[bytes]

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.page)))
        self.end_headers()
        self.wfile.write(self.page)

    def do_POST(self) -> None:
        self.results.put(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian package chromium)")
def test_a_page_on_another_origin_streams_through_the_gateway_in_chromium(stack):
    page = PAGE.replace("KEY", KEY).replace("OPEN", stack["open"]).replace("CLOSED", stack["closed"])
    handler = type("Site", (_PageSite,), {"page": page.encode(), "results": queue.Queue()})
    site = http.server.ThreadingHTTPServer(("127.0.0.1", stack["page_port"]), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as profile:
        # No --dump-dom: its virtual time does not wait for a WebSocket's answers. The browser
        # stays on the page; the page posts what it saw to its own origin.
        browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
             stack["origin"] + "/index.html"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            posted = handler.results.get(timeout=90)
        except queue.Empty:
            posted = None
        finally:
            browser.kill()
            errors = browser.communicate()[1]
            site.shutdown()
            site.server_close()
    assert posted is not None, f"the page posted no result within 90 s; chromium said: {errors[-2000:]}"
    result = json.loads(posted)
    assert result["open"]["status"] == 200 and result["open"]["words"] == " tok" * 4
    assert result["open"]["request_id"]  # exposed to the page
    assert "error" in result["closed"]  # the browser blocks a gateway without CORS
    assert result["ws"] == {"words": " tok" * 2}  # the key as a subprotocol, from a page
