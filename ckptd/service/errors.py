"""The one place where exceptions raised while handling a request become HTTP responses.

Their bodies, like those the access middleware and the HTTP protocol send, come from
:mod:`ckptd.service.error_body`.

Every error body carries the request's id (``error.request_id``, also in the
``X-Request-Id`` header), and storage and integrity failures are counted in the
app's metrics here. A client that goes away before its request body is
complete (``ClientDisconnect``, also when FastAPI meets it reading a JSON body
and raises its 400) is one warning line and one count of
``ckptd_client_disconnects_total``, answered 499 (to nobody), never a 500.
A 413 closes the connection (``Connection: close``): the rest of a body that
was refused for its size is never read.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ckptd_schemas import CkptdError, InvalidRequest, NotFound, PayloadTooLarge, TooManyRequests

from .bodies import invalid
from .error_body import error_body
from .limits import was_answered
from .logs import route_name

__all__ = ["install_error_handlers"]

log = logging.getLogger("ckptd.service")
CLIENT_CLOSED = 499  # the client closed the connection before the answer (no one reads it)


def _body(request: Request, err: CkptdError) -> dict:
    return error_body(err, request.scope.get("state", {}).get("request_id"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(CkptdError)
    async def _ckptd(request: Request, exc: CkptdError) -> JSONResponse:
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.observe_error(exc, route_name(request.scope))
        if exc.status >= 500:
            log.warning("%s answered %d: %s", route_name(request.scope), exc.status, exc.message)
        headers = {"WWW-Authenticate": 'Bearer realm="ckptd", error="insufficient_scope"'} if exc.status == 403 else None
        if isinstance(exc, TooManyRequests):
            headers = {"Retry-After": "1"}
            if metrics is not None:
                metrics.limit_refusals.labels(exc.details.get("limit_name") or "other").inc()
        if isinstance(exc, PayloadTooLarge):  # the rest of a refused body is not read: the connection ends here
            headers = {"Connection": "close"}
        return JSONResponse(_body(request, exc), status_code=exc.status, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        if not was_answered(request.scope):  # not a 408 or 413 the service sent itself
            metrics = getattr(request.app.state, "metrics", None)
            if metrics is not None:
                metrics.client_disconnects.labels(route_name(request.scope)).inc()
            log.warning("%s: the client disconnected before the request body was complete (%s %s)",
                        route_name(request.scope), request.method, request.url.path[:200])
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_body(request, invalid(exc.errors(), "invalid request")), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for a JSON body cut off mid-way
            return await _client_gone(request, exc.__cause__)
        # Routing misses (404, 405) answer in the same typed body as every other error.
        path = request.url.path[:200]
        where = f"{request.method} {path!r}"
        err: CkptdError
        if exc.status_code == 404:
            err = NotFound(f"no route for {where} (names may not contain '/')", path=path)
        else:
            err = InvalidRequest(f"{where}: {exc.detail}", path=path)
        return JSONResponse(_body(request, err), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        err = CkptdError(f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(_body(request, err), status_code=500)
