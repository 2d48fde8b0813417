"""A minimal OTLP/HTTP trace collector for benchmarks: takes POST /v1/traces, counts the spans
(decoded with opentelemetry-proto) and answers at once; GET /stats says how many came.

    .venv/bin/python -m benchmarks.otlp_sink --port 4318

A separate process, so that receiving the gateway's spans costs neither the gateway nor the
load client anything but what a real collector on the same host would.
"""

from __future__ import annotations

import argparse
import gzip

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_OK = ExportTraceServiceResponse().SerializeToString()


class Sink:
    def __init__(self) -> None:
        self.posts = 0
        self.spans = 0
        self.bytes = 0

    async def traces(self, request: web.Request) -> web.Response:
        data = await request.read()
        self.bytes += len(data)
        if request.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(data)
        self.posts += 1
        self.spans += sum(len(ss.spans) for rs in msg.resource_spans for ss in rs.scope_spans)
        return web.Response(body=_OK, content_type="application/x-protobuf")

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response({"posts": self.posts, "spans": self.spans, "bytes": self.bytes})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=4318)
    args = ap.parse_args()
    sink = Sink()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", sink.traces)
    app.router.add_get("/stats", sink.stats)
    app.router.add_get("/health", sink.stats)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
