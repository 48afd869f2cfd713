"""Exceptions become HTTP answers in one place (:mod:`ckptd.service.errors`), over an app with only
the handlers installed and routes that raise, called in process.

* a typed error answers its own status with its body, rebuilt by the client as the same type with
  the same message and details; the request's id is in it when the request has one;
* a storage error is counted by operation (the route's name), an integrity refusal by code, and one
  already counted where it was refused is not counted again; 5xx answers are logged;
* 403 names the bearer realm, 429 says when to retry (and is counted as the uploads limit), and 413
  closes the connection;
* a request that does not validate is 400-family ``invalid_request`` (422) naming where, with every
  error listed; a path no route has is the typed 404, a method the route lacks 405, both typed;
* a client that went away before its body was complete is 499, counted by route, never a 500, also
  when FastAPI met it reading a JSON body;
* anything else is a typed 500 naming the exception, and the traceback is logged.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from ckptd.service.errors import CLIENT_CLOSED, install_error_handlers
from ckptd.service.metrics import Metrics
from ckptd_schemas import (
    ChecksumMismatch, CkptdError, Forbidden, InvalidRequest, NotFound, PayloadTooLarge, StorageError,
    TooManyRequests, error_from_body,
)


class Body(BaseModel):
    n: int


def _app() -> FastAPI:
    app = FastAPI()
    app.state.metrics = Metrics()
    install_error_handlers(app)

    @app.middleware("http")
    async def request_id(request: Request, call_next):  # as logs.RequestContextMiddleware names requests
        if "x-request-id" in request.headers:
            request.scope.setdefault("state", {})["request_id"] = request.headers["x-request-id"]
        return await call_next(request)

    raises = {
        "not_found": NotFound("checkpoint r/1 has no file f.bin", ref="r/1", file="f.bin"),
        "storage": StorageError("storage get of 'runs/r' failed: injected", key="runs/r"),
        "checksum": ChecksumMismatch("file f.bin: bytes differ from their digest", file="f.bin"),
        "forbidden": Forbidden("token 't' may not write run r", needs="write:r"),
        "busy": TooManyRequests("token 't' has 8 uploads in progress", limit=8, limit_name="uploads"),
        "too_large": PayloadTooLarge("index of rank 0 over 1024 bytes", limit=1024),
        "boom": ValueError("boom"),
        "gone": ClientDisconnect(),
    }
    def raiser(exc: BaseException):
        def route() -> None:
            raise exc
        return route

    for name, exc in raises.items():
        app.add_api_route(f"/raise/{name}", raiser(exc), methods=["GET"], name=f"raise_{name}")

    @app.get("/counted", name="counted")
    async def counted() -> None:
        err = ChecksumMismatch("counted where it was refused")
        err._ckptd_metered = True  # as Metrics.refused marks a commit refusal it counted
        raise err

    @app.get("/query", name="query")
    async def query(n: int, m: int) -> dict:
        return {"n": n, "m": m}

    @app.post("/json", name="json_body")
    async def json_body(body: Body) -> dict:
        return {"n": body.n}

    @app.get("/cut-json", name="cut_json")
    async def cut_json() -> None:
        raise HTTPException(400, "There was an error parsing the body") from ClientDisconnect()

    return app


def _call(app: FastAPI, method: str, url: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, url, **kw)
    return asyncio.run(go())


def _sample(app: FastAPI, name: str, **labels: str) -> float:
    return app.state.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def app() -> FastAPI:
    return _app()


def test_a_typed_error_answers_its_status_and_comes_back_as_itself(app):
    r = _call(app, "GET", "/raise/not_found", headers={"X-Request-Id": "req-7"})
    assert r.status_code == 404
    err = error_from_body(r.json(), r.status_code)
    assert type(err) is NotFound and err.message == "checkpoint r/1 has no file f.bin"
    assert err.details == {"ref": "r/1", "file": "f.bin"} and err.request_id == "req-7"
    assert "request_id" not in _call(app, "GET", "/raise/not_found").json()["error"]  # none given, none made up


def test_storage_errors_by_route_and_integrity_refusals_by_code_counted_once(app, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptd.service"):
        r = _call(app, "GET", "/raise/storage")
    assert r.status_code == 503 and type(error_from_body(r.json(), 503)) is StorageError
    assert _sample(app, "ckptd_storage_errors_total", op="raise_storage") == 1
    assert any("raise_storage answered 503" in rec.getMessage() for rec in caplog.records)
    r = _call(app, "GET", "/raise/checksum")
    assert r.status_code == 422 and type(error_from_body(r.json(), 422)) is ChecksumMismatch
    assert _sample(app, "ckptd_verify_failures_total", code="checksum_mismatch") == 1
    assert _call(app, "GET", "/counted").status_code == 422
    assert _sample(app, "ckptd_verify_failures_total", code="checksum_mismatch") == 1  # already counted
    assert _sample(app, "ckptd_storage_errors_total", op="raise_checksum") == 0


def test_403_names_the_realm_429_says_when_to_retry_413_closes(app):
    r = _call(app, "GET", "/raise/forbidden")
    assert r.status_code == 403 and type(error_from_body(r.json(), 403)) is Forbidden
    assert r.headers["www-authenticate"] == 'Bearer realm="ckptd", error="insufficient_scope"'
    r = _call(app, "GET", "/raise/busy")
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert type(error_from_body(r.json(), 429)) is TooManyRequests
    assert _sample(app, "ckptd_limit_refusals_total", limit="uploads") == 1
    r = _call(app, "GET", "/raise/too_large")
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert error_from_body(r.json(), 413).details == {"limit": 1024}


def test_a_request_that_does_not_validate_names_where(app):
    r = _call(app, "GET", "/query", params={"n": "x"})
    assert r.status_code == 422
    err = error_from_body(r.json(), 422)
    assert type(err) is InvalidRequest and err.message.startswith("invalid request at query.n: ")
    assert [e["loc"] for e in err.details["errors"]] == [["query", "n"], ["query", "m"]]  # every one, not the first
    r = _call(app, "POST", "/json", json={"n": "not a number"})
    assert r.status_code == 422 and error_from_body(r.json(), 422).message.startswith("invalid request at body.n: ")


def test_routing_misses_are_typed(app):
    r = _call(app, "GET", "/no/such/route")
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 404 and type(err) is NotFound
    assert err.message == "no route for GET '/no/such/route' (names may not contain '/')"
    assert err.details == {"path": "/no/such/route"}
    r = _call(app, "DELETE", "/query")
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 405 and type(err) is InvalidRequest and err.message.startswith("DELETE '/query': ")
    assert "GET" in r.headers["allow"]


def test_a_client_gone_before_its_body_is_499_and_counted(app, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptd.service"):
        assert _call(app, "GET", "/raise/gone").status_code == CLIENT_CLOSED == 499
        assert _call(app, "GET", "/cut-json").status_code == 499  # FastAPI's 400 for a body cut off
    assert _sample(app, "ckptd_client_disconnects_total", route="raise_gone") == 1
    assert _sample(app, "ckptd_client_disconnects_total", route="cut_json") == 1
    assert sum("disconnected before the request body was complete" in rec.getMessage() for rec in caplog.records) == 2


def test_anything_else_is_a_typed_500_and_logged(app, caplog):
    with caplog.at_level(logging.ERROR, logger="ckptd.service"):
        r = _call(app, "GET", "/raise/boom", headers={"X-Request-Id": "req-9"})
    assert r.status_code == 500
    err = error_from_body(r.json(), 500)
    assert type(err) is CkptdError and err.message == "internal error: ValueError: boom" and err.request_id == "req-9"
    assert [rec.exc_info[0] for rec in caplog.records if rec.getMessage() == "unhandled error"] == [ValueError]
