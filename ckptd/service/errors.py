"""The one place where exceptions become HTTP responses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptd_schemas import CkptdError, InvalidRequest, NotFound

__all__ = ["install_error_handlers"]

log = logging.getLogger("ckptd.service")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(CkptdError)
    async def _ckptd(_: Request, exc: CkptdError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        err = InvalidRequest(f"invalid request at {where}: {first.get('msg', 'invalid')}",
                             errors=[{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg")}
                                     for e in errors[:20]])
        return JSONResponse(err.to_body(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing misses (404, 405) answer in the same typed body as every other error.
        path = request.url.path[:200]
        where = f"{request.method} {path!r}"
        err: CkptdError
        if exc.status_code == 404:
            err = NotFound(f"no route for {where} (names may not contain '/')", path=path)
        else:
            err = InvalidRequest(f"{where}: {exc.detail}", path=path)
        return JSONResponse(err.to_body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        err = CkptdError(f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.to_body(), status_code=500)
