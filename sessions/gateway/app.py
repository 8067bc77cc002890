"""The gateway's HTTP routes (a Starlette app): the OpenAI paths agents call, and the training
side's paths that create, reward and end sessions.

Agents: `POST /sessions/{id}/v1/chat/completions` and `/v1/completions`, or the same without the
`/sessions/{id}` prefix (the session is the key's). Every call needs `Authorization: Bearer
<the session's key>`; a key that is not this gateway's, or is another session's, is refused
before anything is read or written. The training side: `POST /sessions` (create),
`POST /sessions/{id}/reward`, `POST /sessions/{id}/end`, with the gateway's own key.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sessions.errors import LedgerError
from sessions.gateway import wire
from sessions.gateway.forward import model_call
from sessions.gateway.refusals import Refusal, error_body

if TYPE_CHECKING:
    from sessions.gateway.gateway import Gateway

__all__ = ["build_app"]

_BEARER = "bearer "
#: The training side's request bodies are small: a session's identity, a reward, an outcome.
_ADMIN_BODY_BYTES = 64 * 1024


def build_app(gateway: Gateway) -> Starlette:
    """The app that serves `gateway`."""

    def model_route(endpoint: wire.Endpoint, prefixed: bool) -> Any:
        async def route(request: Request) -> Response:
            session_id = _session_of_key(gateway, request)
            if prefixed and request.path_params["session_id"] != session_id:
                raise Refusal(
                    403,
                    "wrong_session",
                    "this key belongs to another session; use the base URL and key given together",
                )
            live = await gateway.live(session_id)
            raw = await _body(request, gateway.settings.max_body_bytes)
            return await model_call(gateway, live, endpoint, raw, request.headers)

        return route

    async def create(request: Request) -> Response:
        _require_admin(gateway, request)
        body = await _json_body(request)
        session_id = body.pop("session_id", None)
        if not isinstance(session_id, str):
            raise Refusal(400, "invalid_request", "session_id (a string) is required")
        try:
            await gateway.create(session_id, **body)
        except TypeError as error:
            raise Refusal(400, "invalid_request", f"not a session's identity: {error}") from None
        return JSONResponse(
            {
                "session_id": session_id,
                "base_url": gateway.session_base_url(session_id),
                "api_key": gateway.keys.key_for(session_id),
            },
            status_code=201,
        )

    async def reward(request: Request) -> Response:
        _require_admin(gateway, request)
        body = await _json_body(request)
        live = await gateway.live(request.path_params["session_id"])
        info = body.get("info") or {}
        if not isinstance(info, dict):
            raise Refusal(400, "invalid_request", "info must be a JSON object")
        await live.handle.post_reward(body.get("reward"), **info)
        return JSONResponse({"session_id": live.session_id, "state": live.handle.state})

    async def end(request: Request) -> Response:
        _require_admin(gateway, request)
        body = await _json_body(request)
        session_id = request.path_params["session_id"]
        reason = body.get("fail_reason")
        if reason is not None and not isinstance(reason, str):
            raise Refusal(400, "invalid_request", "fail_reason must be a failure reason (a string)")
        state = await gateway.end(
            session_id, fail_reason=reason, message=str(body.get("message") or "")
        )
        return JSONResponse({"session_id": session_id, "state": state})

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [
        Route("/v1/chat/completions", model_route("chat", False), methods=["POST"]),
        Route("/v1/completions", model_route("completion", False), methods=["POST"]),
        Route(
            "/sessions/{session_id:path}/v1/chat/completions",
            model_route("chat", True),
            methods=["POST"],
        ),
        Route(
            "/sessions/{session_id:path}/v1/completions",
            model_route("completion", True),
            methods=["POST"],
        ),
        Route("/sessions", create, methods=["POST"]),
        Route("/sessions/{session_id:path}/reward", reward, methods=["POST"]),
        Route("/sessions/{session_id:path}/end", end, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={
            Refusal: _refused,
            HTTPException: _http_error,
            LedgerError: _ledger_error,
        },
    )


async def _refused(request: Request, refusal: Exception) -> Response:
    assert isinstance(refusal, Refusal)
    return JSONResponse(refusal.body(), status_code=refusal.status)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    what = "no such path" if error.status_code == 404 else error.detail
    return JSONResponse(
        error_body(f"{request.method} {request.url.path[:200]}: {what}", "invalid_request"),
        status_code=error.status_code,
    )


async def _ledger_error(request: Request, error: Exception) -> Response:
    """A refusal of the ledger's (bad identity, bad reward, a session in the wrong state)."""
    return JSONResponse(error_body(str(error), type(error).__name__), status_code=400)


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    if not header[: len(_BEARER)].lower() == _BEARER:
        raise Refusal(
            401,
            "invalid_api_key",
            "no API key: send the session's key as 'Authorization: Bearer <key>'",
        )
    return header[len(_BEARER) :].strip()


def _session_of_key(gateway: Gateway, request: Request) -> str:
    session_id = gateway.keys.session_of(_bearer(request))
    if session_id is None:
        raise Refusal(401, "invalid_api_key", "the API key is not a session key of this gateway")
    return session_id


def _require_admin(gateway: Gateway, request: Request) -> None:
    if not gateway.keys.is_admin(_bearer(request)):
        raise Refusal(
            401, "invalid_api_key", "this path needs the gateway's own key, not a session's"
        )


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refusal(413, "request_too_large", f"the body is {declared} bytes; at most {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refusal(413, "request_too_large", f"the body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await _body(request, _ADMIN_BODY_BYTES)
    try:
        body = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise Refusal(400, "invalid_request", f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise Refusal(400, "invalid_request", "the body must be a JSON object")
    return body
