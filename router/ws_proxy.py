"""WebSocket proxy: GET /v1/ws on the gateway <-> GET /v1/ws on one worker.

The worker's protocol: each client text message is a completions or chat body; the
worker answers with chunk objects and a final end message. The gateway places the
connection when the first message arrives (it names the model; a request it cannot place,
for an unknown model, no worker or a full queue, gets its error and the socket waits,
unplaced, for the next), connects to that worker, and from then on copies messages both ways
untouched (router/ws_relay.py, which also moves the socket to another worker when its worker
stops). Each request on it holds a lease on that worker while it is answered (the first
one's places the socket; ws_relay.py). A worker that cannot be connected to is excluded and the
placement retried, like an HTTP request before its first byte. A stopping gateway
sends its sockets away once their answers are out (router/ws_sessions.py).
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import WSCloseCode, web

from router.access_log import RequestRecord, trace_id_of
from router.default_model import NoDefaultModel, default_model
from router.errors import error_response
from router.lax_fields import lax_int_or_none
from router.proxy import Proxy
from router.request_checks import is_name
from router.ws_leases import WsTurn
from router.ws_relay import KEY_REVOKED, WsRelay, is_cancel
from router.ws_sessions import GOING_AWAY_MESSAGE, SHUTTING_DOWN, WsSession, WsSessions, ws_error
from scheduler.clip import MAX_SHOWN_CHARS, clip

# Browsers cannot set headers on a WebSocket, only subprotocols: a page passes its API key as
# the subprotocol `openai-insecure-api-key.<key>` (OpenAI's convention for its Realtime API).
KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."


def _offered_protocols(request: web.Request) -> list[str]:
    header = request.headers.get("Sec-WebSocket-Protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def _authorization(request: web.Request, offered: list[str]) -> str | None:
    header = request.headers.get("Authorization")
    if header is not None:
        return header
    for protocol in offered:
        if protocol.startswith(KEY_PROTOCOL_PREFIX):
            return "Bearer " + protocol[len(KEY_PROTOCOL_PREFIX) :]
    return None


async def _first_request(proxy: Proxy, client: web.WebSocketResponse, rec: RequestRecord
                         ) -> tuple[str, dict, str] | None:
    """The socket's first request (it places the socket: its model, or the pool's one model
    where it names none, router/default_model.py), and its body and model; None if the socket
    closes first. What comes before it is answered as the worker
    answers it once the socket is placed, and the socket stays open for the next message: a
    message that is no request (binary, not JSON, no 'model') gets an error, and a cancel with
    no request to cancel is dropped. (Both used to close the socket, a cancel with an error
    saying it named no model.)"""
    while True:
        msg = await client.receive()
        if msg.type == aiohttp.WSMsgType.BINARY:
            await client.send_str(ws_error("first message must be a JSON text message with a 'model'", 400))
            rec.status = 400
            continue
        if msg.type != aiohttp.WSMsgType.TEXT:
            return None
        if is_cancel(msg.data):
            continue
        try:
            body = json.loads(msg.data)
            model = body.get("model")
            if model is None or model == "":  # the pool's one model, as over HTTP
                model = default_model(await proxy.sched.models(proxy.cfg.models_cache_ms / 1000))
            elif not is_name(model):
                raise TypeError
        except NoDefaultModel as exc:
            await client.send_str(ws_error(str(exc), 400))
            rec.status = 400
            continue
        except (ValueError, AttributeError, TypeError, RecursionError):  # the last: nested too deeply
            await client.send_str(ws_error("first message must be a JSON body with a 'model'", 400))
            rec.status = 400
            continue
        return msg.data, body, model


async def handle_ws(proxy: Proxy, request: web.Request, sessions: WsSessions) -> web.StreamResponse:
    offered = _offered_protocols(request)
    authorization = _authorization(request, offered)
    if not proxy.keys.allows(authorization):
        return error_response(
            401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
        )
    # A browser fails the handshake unless one offered subprotocol is accepted: accept another
    # than the key's if the page offered one, else the key's (the page's own string, echoed).
    chosen = sorted(offered, key=lambda p: p.startswith(KEY_PROTOCOL_PREFIX))[:1]
    client = web.WebSocketResponse(
        max_msg_size=proxy.cfg.max_body_bytes, autoping=True, heartbeat=proxy.cfg.ws_heartbeat_s,
        protocols=chosen,
    )
    try:
        await client.prepare(request)
    except web.HTTPException as exc:  # not a WebSocket handshake: aiohttp's answer is plain text
        # aiohttp's words quote the client's header whole (Upgrade, Sec-WebSocket-Key or
        # -Version, up to 32 KiB): cut, as other echoes are (scheduler/clip.py).
        words = clip(" ".join((exc.text or "").split()), 4 * MAX_SHOWN_CHARS)
        return error_response(
            exc.status, f"/v1/ws takes a WebSocket handshake: {words}",
            code="invalid_websocket_handshake",
        )
    rec = RequestRecord(proxy.request_id(request, "ws"), "WS", "/v1/ws")
    rec.trace = trace_id_of(request.headers.get("traceparent"))
    if proxy.tracing is not None:
        proxy.begin_trace(request, rec)  # one span for the socket, one per answer under it
    rec.flow = proxy.flow_of(request)
    proxy.metrics.in_flight.inc()
    session = WsSession(client, authorization)
    sessions.add(session)
    relay: WsRelay | None = None
    try:
        if sessions.closing:
            await session.going_away_if_idle()
            return client
        answers = 0  # refused placements, each an answer with its own access-log line
        while True:
            first = await _first_request(proxy, client, rec)
            if first is None:
                return client  # closed before asking anything (or anything placeable)
            data, body, model = first
            if sessions.closing:  # the gateway began to stop while this socket said nothing
                await client.send_str(SHUTTING_DOWN)
                await client.close(code=WSCloseCode.GOING_AWAY, message=GOING_AWAY_MESSAGE)
                return client
            if not proxy.keys.allows(session.authorization):
                # Revoked while the socket waited unplaced: refused as on a placed socket.
                await client.send_str(KEY_REVOKED)
                continue
            unplaced = rec.status  # what the socket's line says if it is never placed
            rec.model = model
            sched_body = await proxy.schedule_body_off_loop(rec, model, body)
            proxy.note_session(sched_body, request.headers, body)
            # From here the socket is busy: placing it, then its answer.
            turn = WsTurn(data, sched_body, rec.prompt_tokens * rec.choices, rec.sequences)
            session.pending.append(turn)
            # The first request's, as the connection is placed once; read as the engine reads
            # it (router/lax_fields.py). The worker answers a malformed one itself.
            priority = lax_int_or_none(body.get("priority")) or 0
            relay = WsRelay(proxy, request, rec, session, sessions, sched_body, priority, answers)
            failed = await relay.place([])
            if failed is None:
                break
            # Not placeable now (unknown model, no worker, full queue, ...): the client gets
            # the error, as before, and the socket stays open, unplaced, as after a message that
            # is no request (the worker keeps its socket after any refusal). The refusal is one
            # answer (its line, its status counted once); the next request places the socket
            # as a first request does: nothing of this one is left to it (no turn owed, no
            # lease, none of its model, tokens or wait in the socket's record).
            await client.send_str(failed)
            relay.refused(turn, failed)
            answers = relay.answers
            await relay.close()  # ends the turn's lease (it holds none: no worker took it)
            session.pending.clear()
            relay = None
            # The socket's record as before that request: its line (at its close) tells of the
            # socket, and the next first request starts it afresh.
            rec.forget_placement()
            rec.status = unplaced
            if sessions.closing:  # the gateway began to stop while it was being placed
                await session.going_away_if_idle()
                return client
        rec.status = 101
        if await relay.send_upstream(data):
            await relay.run()
        return client
    finally:
        sessions.remove(session)
        try:
            if relay is not None:
                await relay.close()
            if not client.closed:
                await client.close()
        finally:
            # Also when the closes above are cancelled: a client that drops the connection
            # instead of answering our close frame cancels this handler right there, and the
            # gauge and the request's accounting must not wait for what never comes.
            proxy.metrics.in_flight.dec()
            proxy._finish(rec)
