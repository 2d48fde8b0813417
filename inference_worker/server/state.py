"""Typed keys of what the aiohttp app holds (engine, request factory, metrics registry, drain,
stored responses, background responses, the time a request body has to arrive)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from inference_worker.engine.types import AsyncEngineClient
from inference_worker.server.background import BackgroundRuns
from inference_worker.server.drain import Drain
from inference_worker.server.prepare import GenerationFactory
from inference_worker.server.response_store import ResponseStore

ENGINE = web.AppKey("engine", AsyncEngineClient)
FACTORY = web.AppKey("generation_factory", GenerationFactory)
REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)
DRAIN = web.AppKey("drain", Drain)
RESPONSES = web.AppKey("response_store", ResponseStore)
BACKGROUND = web.AppKey("background_responses", BackgroundRuns)
RECEIVE_TIMEOUT_S = web.AppKey("request_receive_timeout_s", float)
