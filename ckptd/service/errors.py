"""The one place where exceptions become HTTP responses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ckptd_schemas import CkptdError, InvalidRequest

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

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        err = CkptdError(f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.to_body(), status_code=500)
