"""A zero-delay OpenAI-compatible worker: a stand-in for "any OpenAI-compatible server".

Used by the gateway overhead benchmark (so that every millisecond measured is the
gateway's, not a model's) and by the gateway's unit-level tests. It speaks:
POST /v1/completions and /v1/chat/completions (stream and not, stream_options.include_usage),
POST /v1/embeddings (each input's embedding is [its length in characters], so a test can see
what arrived), vLLM's pooling endpoints (POST /pooling, /classify, /score, /rerank, /v1/score,
/v1/rerank, /v2/rerank: an answer that names the path it came on), POST /v1/audio/transcriptions
and /translations (a multipart form; the text names the file's size and digest),
POST /v1/messages/count_tokens (Anthropic's), SGLang's POST /generate and TGI's
/generate_stream, GET /v1/models, /health,
/metrics (the vLLM v1 gauges a scheduler scrapes), GET /v1/ws.
An answer has `max_tokens` tokens (default 16), one per SSE chunk; `--token-delay-ms`
spaces them out. With `--max-running N` a completion arriving while N are answered is refused
as TGI refuses past its --max-concurrent-requests (429, "Model is overloaded").
`python -m benchmarks.echo_worker --port 8101 --model m`
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time

from aiohttp import WSMsgType, web

# Echoed back in non-stream answers, so tests can check what the gateway passed on.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")

_dumps = json.JSONEncoder(separators=(",", ":")).encode


class EchoWorker:
    def __init__(self, model: str, token_delay_s: float, worker_name: str, max_running: int = 0) -> None:
        self.model = model
        self.token_delay_s = token_delay_s
        self.name = worker_name
        self.max_running = max_running  # 0: no limit
        self.running = 0
        self.served = 0
        self.refused = 0

    async def _parse(self, request: web.Request) -> dict | web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "invalid JSON")
        # No model named (absent, null or ""): the one served, as vLLM serves it.
        if not isinstance(body, dict) or body.get("model") not in (None, "", self.model):
            return _error(
                404, f"model {body.get('model') if isinstance(body, dict) else None!r} not found"
            )
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._parse(request)
        if isinstance(body, web.Response):
            return body
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        prompt_tokens = len(_dumps(body.get("messages") or body.get("prompt") or "")) // 4
        if self.max_running and self.running >= self.max_running:
            self.refused += 1
            return web.json_response(
                {"error": "Model is overloaded", "error_type": "overloaded"},
                status=429,
                headers={"x-echo-worker": self.name},
            )
        self.running += 1
        self.served += 1
        try:
            if body.get("stream"):
                return await self._stream(request, body, n, prompt_tokens, chat)
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s * n)
            text = " tok" * n
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            return web.Response(
                body=_dumps(
                    {
                        "id": "cmpl-echo",
                        # lets tests check what the proxy in front passed on
                        "saw_authorization": "Authorization" in request.headers,
                        "saw_trace": {h: request.headers.get(h) for h in TRACE_HEADERS},
                        "object": "chat.completion" if chat else "text_completion",
                        "created": int(time.time()),
                        "model": self.model,
                        "choices": [choice],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": n,
                            "total_tokens": prompt_tokens + n,
                        },
                    }
                ).encode(),
                content_type="application/json",
                headers={"x-echo-worker": self.name},
            )
        finally:
            self.running -= 1

    async def _stream(self, request: web.Request, body: dict, n: int, prompt_tokens: int, chat: bool):
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "x-echo-worker": self.name}
        )
        await resp.prepare(request)
        usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get(
            "include_usage"
        )
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i in range(n):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == n - 1
            if chat:
                fin = "length" if last else None
                choice = {"index": 0, "delta": {"content": " tok"}, "finish_reason": fin}
            else:
                choice = {"index": 0, "text": " tok", "finish_reason": "length" if last else None}
            chunk = {
                "id": "cmpl-echo",
                "object": obj,
                "created": created,
                "model": self.model,
                "choices": [choice],
            }
            await resp.write(b"data: " + _dumps(chunk).encode() + b"\n\n")
        if usage:
            chunk = {
                "id": "cmpl-echo",
                "object": obj,
                "created": created,
                "model": self.model,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                },
            }
            if any(h in request.headers for h in TRACE_HEADERS):
                # What the proxy in front passed on, for tests of a stream (only then: the
                # benchmarks' chunks stay as they were).
                chunk["saw_trace"] = {h: request.headers.get(h) for h in TRACE_HEADERS}
            await resp.write(b"data: " + _dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            try:
                body = json.loads(msg.data)
                n = int(body.get("max_tokens") or 16)
            except (ValueError, TypeError, AttributeError):
                await ws.send_str(
                    _dumps({"error": {"message": "invalid JSON", "type": "invalid_request_error"}})
                )
                continue
            for i in range(n):
                choice = {"index": 0, "text": " tok", "finish_reason": "length" if i == n - 1 else None}
                await ws.send_str(
                    _dumps(
                        {
                            "id": "cmpl-echo",
                            "object": "text_completion",
                            "model": self.model,
                            "choices": [choice],
                            "worker": self.name,
                        }
                    )
                )
            await ws.send_str(_dumps({"type": "done", "id": "cmpl-echo"}))
        return ws

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._parse(request)
        if isinstance(body, web.Response):
            return body
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(str(text)))]}
            for i, text in enumerate(inputs)
        ]
        tokens = sum(len(str(text)) for text in inputs) // 4
        return web.json_response(
            {"object": "list", "data": data, "model": self.model,
             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        )

    async def pooling(self, request: web.Request) -> web.Response:
        """Any of vLLM's pooling endpoints: the path it arrived on, so a test sees where the
        gateway sent it."""
        body = await self._parse(request)
        if isinstance(body, web.Response):
            return body
        return web.json_response({"object": "list", "path": request.path, "model": self.model, "data": [],
                                  "usage": {"prompt_tokens": 1, "total_tokens": 1}})

    async def audio(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /v1/audio/transcriptions and /translations: a multipart form (the file and the
        options). The text says what arrived (the file's size and digest), so a test sees that
        the gateway passed the form on untouched; `stream` "true" answers with SSE chunks."""
        if request.content_type != "multipart/form-data":
            return _error(400, "expected a multipart/form-data body")
        form = await request.post()
        model = form.get("model")
        if model not in (None, "", self.model):
            return _error(404, f"model {model!r} not found")
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            return _error(400, "the form has no file")
        audio = upload.file.read()
        text = f"{len(audio)} bytes sha256 {hashlib.sha256(audio).hexdigest()} at {request.path}"
        if form.get("stream") != "true":
            return web.json_response({"text": text, "usage": {"type": "duration", "seconds": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-echo-worker": self.name})
        await resp.prepare(request)
        for word in text.split(" "):
            chunk = {"object": "transcription.chunk", "model": self.model,
                     "choices": [{"delta": {"content": word + " "}}]}
            await resp.write(b"data: " + _dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """The native generation APIs: SGLang's /generate ({"text", "sampling_params":
        {"max_new_tokens"}, "stream"}; each streamed chunk holds the text so far and its
        meta_info) and TGI's /generate_stream ({"inputs", "parameters"}; one token an event)."""
        body = await self._parse(request)
        if isinstance(body, web.Response):
            return body
        tgi = request.path == "/generate_stream"
        params = body.get("parameters" if tgi else "sampling_params") or {}
        n = params.get("max_new_tokens") or 16
        prompt_tokens = len(str(body.get("inputs" if tgi else "text", ""))) // 4
        if not (tgi or body.get("stream")):
            meta = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
            return web.json_response({"text": " tok" * n, "meta_info": meta})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-echo-worker": self.name})
        await resp.prepare(request)
        for i in range(1, n + 1):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if tgi:
                event = {"token": {"id": i, "text": " tok"}, "generated_text": " tok" * n if i == n else None}
            else:
                meta = {"prompt_tokens": prompt_tokens, "completion_tokens": i}
                event = {"text": " tok" * i, "meta_info": meta}
            await resp.write(b"data: " + _dumps(event).encode() + b"\n\n")
        if not tgi:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The Anthropic Messages API's token count (vLLM serves it): a quarter of the
        messages' JSON length."""
        body = await self._parse(request)
        if isinstance(body, web.Response):
            return body
        tokens = len(_dumps(body.get("messages") or [])) // 4
        return web.json_response({"input_tokens": tokens}, headers={"x-echo-worker": self.name})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, _request: web.Request) -> web.Response:
        lbl = f'{{engine="0",model_name="{self.model}"}}'
        text = (
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lbl} {self.running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{lbl} 0\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{lbl} 0.0\n"
            f"# TYPE vllm:request_success counter\nvllm:request_success_total{lbl} {self.served}\n"
            f"# TYPE echo_refused counter\necho_refused_total {self.refused}\n"
        )
        return web.Response(text=text, content_type="text/plain")


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}},
        status=status,
    )


def build_app(
    model: str, token_delay_s: float = 0.0, name: str = "echo", max_running: int = 0
) -> web.Application:
    w = EchoWorker(model, token_delay_s, name, max_running)
    app = web.Application()
    app.router.add_post("/v1/completions", w.completions)
    app.router.add_post("/v1/chat/completions", w.chat)
    app.router.add_post("/v1/embeddings", w.embeddings)
    for path in ("/pooling", "/classify", "/score", "/rerank", "/v1/score", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, w.pooling)
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        app.router.add_post(path, w.audio)
    app.router.add_post("/v1/messages/count_tokens", w.count_tokens)
    for path in ("/generate", "/generate_stream"):
        app.router.add_post(path, w.generate)
    app.router.add_get("/v1/models", w.models)
    app.router.add_get("/v1/ws", w.ws)
    app.router.add_get("/health", w.health)
    app.router.add_get("/metrics", w.metrics)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8101)
    ap.add_argument("--model", default="m")
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--max-running", type=int, default=0, help="answer 429 past this many (0: no limit)")
    args = ap.parse_args()
    app = build_app(args.model, args.token_delay_ms / 1000, f"echo-{args.port}", args.max_running)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
