"""The API's own description (:mod:`ckptd.service.docs`) over a small app of its own, in process.

* an operation that is not open (a rule says so, or it has none) requires the bearer scheme and lists
  every error status in the one error body; an open one requires nothing and lists only 500 and 503,
  plus 422 when a query of its own can be refused; the document is built once;
* ``/docs`` takes its script and style sheet from ``/docs/assets/`` (served here, cached a day),
  never from another host; the four routes carry their own names;
* without the ``fastapi-offline`` package, ``/docs`` says how to get it and where the description
  is, and an asset is a typed 404 naming it.

The whole service's document, rendered in a browser, is tests/ckptd/service/test_docs_offline.py.
"""

from __future__ import annotations

import asyncio
import re
import sys

import httpx
import pytest
from fastapi import FastAPI

from ckptd.service.auth import OPEN, Rule, iter_routes
from ckptd.service.docs import ERROR_RESPONSES, install_docs
from ckptd.service.errors import install_error_handlers
from ckptd_schemas import NotFound, error_from_body

RULES = {"probe": OPEN, "search": OPEN, "runs": Rule("read"), "openapi": OPEN, "swagger_ui_html": OPEN,
         "swagger_ui_redirect": OPEN, "docs_asset": OPEN}


def _app() -> FastAPI:
    app = FastAPI(title="ckptd", version="0", openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.get("/probe", name="probe")
    async def probe() -> dict:
        return {}

    @app.get("/search", name="search")
    async def search(q: int = 0) -> dict:
        return {"q": q}

    @app.get("/v1/runs/{run}", name="runs")
    async def runs(run: str) -> dict:
        return {"run": run}

    @app.get("/v1/unlisted", name="unlisted")  # no rule (check_routes refuses such an app): not taken as open
    async def unlisted() -> dict:
        return {}

    install_docs(app, RULES)
    return app


def _call(app: FastAPI, method: str, url: str) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url)
    return asyncio.run(go())


def test_each_operation_lists_its_errors_and_whether_it_needs_a_token():
    app = _app()
    doc = _call(app, "GET", "/openapi.json").json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["components"]["schemas"]["ErrorBody"]["required"] == ["error"]
    runs = doc["paths"]["/v1/runs/{run}"]["get"]
    assert runs["security"] == [{"bearer": []}]
    assert sorted(int(s) for s in runs["responses"] if s != "200") == sorted(ERROR_RESPONSES)
    for status in ERROR_RESPONSES:
        entry = runs["responses"][str(status)]
        assert entry["description"] == ERROR_RESPONSES[status]
        assert entry["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert doc["paths"]["/v1/unlisted"]["get"]["security"] == [{"bearer": []}]
    probe = doc["paths"]["/probe"]["get"]
    assert "security" not in probe and sorted(probe["responses"]) == ["200", "500", "503"]
    search = doc["paths"]["/search"]["get"]  # open, with a query that can be refused
    assert "security" not in search and sorted(search["responses"]) == ["200", "422", "500", "503"]
    assert search["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert app.openapi() is app.openapi()  # built once
    assert not any(p.startswith("/docs") or p == "/openapi.json" for p in doc["paths"])  # not in the document


def test_docs_take_their_assets_from_the_service_itself():
    pytest.importorskip("fastapi_offline")
    app = _app()
    assert {r.name for r in iter_routes(app.router) if r.path.startswith(("/docs", "/openapi"))} == {
        "openapi", "swagger_ui_html", "swagger_ui_redirect", "docs_asset"}
    page = _call(app, "GET", "/docs")
    assert page.status_code == 200
    assert sorted(re.findall(r'(?:src|href)="([^"]+)"', page.text)) == [
        "/docs/assets/favicon.png", "/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"]
    assert not re.search(r"https?://", page.text)  # nothing from another host
    for asset, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "text/css"),
                        ("favicon.png", "image/png")):
        r = _call(app, "GET", f"/docs/assets/{asset}")
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 100
        assert r.headers["cache-control"] == "max-age=86400"
    assert _call(app, "GET", "/docs/assets/other.js").status_code == 404  # only the three files
    assert _call(app, "GET", "/docs/oauth2-redirect").status_code == 200


def test_without_the_offline_assets_docs_say_where_to_look(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi_offline", None)  # not installed: its import fails
    app = _app()
    page = _call(app, "GET", "/docs")
    assert page.status_code == 200 and "fastapi-offline" in page.text and "/openapi.json" in page.text
    r = _call(app, "GET", "/docs/assets/swagger-ui.css")
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 404 and type(err) is NotFound and err.details == {"asset": "swagger-ui.css"}
    assert _call(app, "GET", "/openapi.json").status_code == 200  # the description needs nothing more
