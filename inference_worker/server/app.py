"""The worker's aiohttp application: OpenAI API, WebSocket, health, metrics, tokenize, version.

`build_app(engine, model_name, registry, responses_store_size, receive_timeout_s)` wires the
routes; the caller owns the engine's lifetime (see `inference_worker.__main__`). Run it with
`handler_cancellation=True` (as `serve()` does) so that a client disconnect cancels
its handler and the engine aborts the request at once.
"""

from __future__ import annotations

import importlib.metadata

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from inference_worker.engine.types import AsyncEngineClient
from inference_worker.server import openai_api, responses_api
from inference_worker.server.background import BackgroundRuns
from inference_worker.server.drain import Drain
from inference_worker.server.errors import APIError, error_middleware, json_error, shutting_down
from inference_worker.server.prepare import GenerationFactory
from inference_worker.server.receive_timeout import DEFAULT_RECEIVE_TIMEOUT_S
from inference_worker.server.response_store import ResponseStore
from inference_worker.server.state import (
    BACKGROUND,
    DRAIN,
    ENGINE,
    FACTORY,
    RECEIVE_TIMEOUT_S,
    REGISTRY,
    RESPONSES,
)
from inference_worker.server.websocket import websocket_handler

# Long prompts as JSON token-id lists get large; aiohttp's 1 MiB default is too small.
MAX_BODY_BYTES = 32 * 1024 * 1024


async def health(request: web.Request) -> web.Response:
    if request.app[DRAIN].draining:  # a readiness probe: send nothing new here
        return json_error(shutting_down())
    if request.app[ENGINE].is_healthy:
        return web.Response(status=200)
    return json_error(APIError(503, "The engine is not healthy.", code="engine_unhealthy"))


async def _close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    """A stopping worker ends each kept-alive connection after its answer: the next request
    (a scrape, a router's next call) finds the listener closed and goes elsewhere."""
    if request.app[DRAIN].draining:
        response.force_close()


async def version(request: web.Request) -> web.Response:
    """vLLM's GET /version: the serving software's version (ours: this package's)."""
    try:
        number = importlib.metadata.version("llm-router")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        number = "unknown"
    return web.json_response({"version": number})


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    # `?name[]=a&name[]=b` restricts the page to those series, as vLLM's and SGLang's
    # prometheus_client endpoints do: a router that scrapes every 100 ms asks for the dozen it
    # uses, and rendering every histogram bucket would cost this process's event loop, which
    # also runs the engine, ~5 ms per scrape.
    names = request.query.getall("name[]", [])
    body = generate_latest(registry.restricted_registry(names) if names else registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# aiohttp refuses a request line or a header field over 8 KiB with a plain-text 400; vLLM
# (behind uvicorn) takes longer ones, e.g. identity tokens with many claims. 32 KiB each.
HEADER_LIMITS = {"max_line_size": 32 * 1024, "max_field_size": 32 * 1024}


async def _stop_background(app: web.Application) -> None:
    """Background answers still running when the server stops (past the drain) are cancelled."""
    await app[BACKGROUND].stop_all()


def build_app(
    engine: AsyncEngineClient,
    model_name: str,
    registry: CollectorRegistry | None = None,
    responses_store_size: int = 0,
    receive_timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S,
) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[FACTORY] = GenerationFactory(engine, model_name)
    app[DRAIN] = Drain()
    app[RESPONSES] = ResponseStore(responses_store_size)
    app[RECEIVE_TIMEOUT_S] = receive_timeout_s  # a request body's (openai_api.read_body)
    app[BACKGROUND] = BackgroundRuns()
    app.on_cleanup.append(_stop_background)
    app.on_response_prepare.append(_close_when_draining)
    app[REGISTRY] = registry if registry is not None else CollectorRegistry()
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/responses", responses_api.responses)
    app.router.add_get("/v1/responses/{response_id}", responses_api.retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", responses_api.cancel)
    app.router.add_delete("/v1/responses/{response_id}", responses_api.delete)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_post("/tokenize", openai_api.tokenize)
    app.router.add_post("/detokenize", openai_api.detokenize)
    app.router.add_get("/v1/ws", websocket_handler)
    app.router.add_get("/health", health)
    # vLLM's (and SageMaker's) liveness path: the same answer as /health.
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/", metrics)  # where routers send `?name[]=` to vLLM (see there)
    return app
