"""The API's own description, served with no internet access: ``/openapi.json`` and ``/docs``.

Clusters are often air-gapped, so ``/docs`` (Swagger UI 5, which renders OpenAPI 3.1) takes its
script and style sheet from the ``fastapi-offline`` package installed beside the service (its
``static`` files, served at ``/docs/assets/NAME``), never from a CDN. The OpenAPI document says, for every operation, which errors it can answer (the one
error body of :mod:`ckptd_schemas.errors`, by status) and whether it needs a bearer token
(``components.securitySchemes.bearer``; probes, metrics and these documents are open).

All four routes are FastAPI routes with names of their own (``openapi``, ``swagger_ui_html``,
``swagger_ui_redirect``, ``docs_asset``), so ``/metrics`` labels their requests by name.
Call order: :func:`install_docs` once, after every other route is registered.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from ckptd_schemas import NotFound, errors

from .auth import iter_routes

__all__ = ["ERROR_RESPONSES", "install_docs"]

_ASSETS = {"swagger-ui-bundle.js": "application/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}

ERROR_BODY = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["code", "message", "details"],
        "properties": {
            "code": {"type": "string", "description": "machine-readable error code (the error tree of "
                                                      "ckptd_schemas.errors), e.g. checkpoint_not_found"},
            "message": {"type": "string", "description": "a sentence naming the tensor, rank, file or field"},
            "details": {"type": "object", "description": "machine-readable context"},
            "request_id": {"type": "string", "description": "the request's id, also in X-Request-Id"},
        }}},
}

_NOTES = {422: " (and a request that fails validation)", 429: " (retried after Retry-After)",
          503: " (retried); /readyz: not ready, the body says why", 507: " (not retried)"}


def _error_responses() -> dict[int, str]:
    """Status -> the codes an operation may answer with it, read off the error tree (``ckptd_schemas.errors``)."""
    codes: dict[int, list[str]] = {}
    for cls in (getattr(errors, n) for n in errors.__all__):
        if isinstance(cls, type) and cls is not errors.Unreachable:  # raised by the client, never answered
            codes.setdefault(cls.status, []).append(cls.code)
    return {status: ", ".join(c) + _NOTES.get(status, "") for status, c in sorted(codes.items())}


ERROR_RESPONSES = _error_responses()
_OPEN_ERRORS = (500, 503)


def _assets_dir() -> Path | None:
    try:
        import fastapi_offline
    except ImportError:
        return None
    return Path(fastapi_offline.__file__).parent / "static"


def _document(app: FastAPI, rules: dict[str, Any]) -> dict:
    """The OpenAPI document with the bearer scheme and every operation's error responses."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes,
                      tags=app.openapi_tags)
    components = doc.setdefault("components", {})
    components.setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer",
        "description": "a token from the service's tokens file; its scopes (read:RUN, write:RUN, admin) decide "
                       "what it may do"}
    components.setdefault("schemas", {})["ErrorBody"] = ERROR_BODY
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    by_path = {(r.path, m.lower()): r.name for r in iter_routes(app.router) for m in (getattr(r, "methods", None) or ())}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            name = by_path.get((path, method))
            rule = rules.get(name) if name else None
            is_open = rule is not None and rule.access == "open"
            if not is_open:
                op["security"] = [{"bearer": []}]
            responses = op.setdefault("responses", {})
            statuses = set(_OPEN_ERRORS if is_open else ERROR_RESPONSES)
            if "422" in responses:  # an open route's query refused: the same error body (errors._validation)
                statuses.add(422)
            for status in sorted(statuses):
                entry = responses.setdefault(str(status), {})
                entry["description"] = ERROR_RESPONSES[status]
                entry["content"] = {"application/json": {"schema": ref}}
    return doc


def install_docs(app: FastAPI, rules: dict[str, Any]) -> None:
    """Serve ``/openapi.json`` and ``/docs`` (create the app with ``openapi_url=None, docs_url=None,
    redoc_url=None``). ``rules``: route name -> its access rule (``ckptd.service.auth.ROUTE_RULES``)."""
    @functools.cache
    def openapi_document() -> dict:
        return _document(app, rules)

    app.openapi = openapi_document  # type: ignore[method-assign]
    assets = _assets_dir()

    @app.get("/openapi.json", name="openapi", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(openapi_document())

    @app.get("/docs", name="swagger_ui_html", include_in_schema=False)
    async def swagger_ui_html() -> HTMLResponse:
        if assets is None:
            return HTMLResponse("<h1>ckptd API</h1><p>Interactive docs need the fastapi-offline package "
                                "(pip install 'ckptd[server]'); the description is at "
                                "<a href='/openapi.json'>/openapi.json</a>.</p>")
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API",
                                   swagger_js_url="/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/assets/swagger-ui.css",
                                   swagger_favicon_url="/docs/assets/favicon.png",
                                   oauth2_redirect_url="/docs/oauth2-redirect")

    @app.get("/docs/oauth2-redirect", name="swagger_ui_redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    def asset_route(name: str, media_type: str) -> None:
        async def docs_asset() -> FileResponse:
            if assets is None or not (assets / name).is_file():
                raise NotFound(f"no docs asset {name!r}: install fastapi-offline", asset=name)
            return FileResponse(assets / name, media_type=media_type, headers={"Cache-Control": "max-age=86400"})

        # one concrete path per file (the access check matches open paths exactly)
        app.add_api_route(f"/docs/assets/{name}", docs_asset, methods=["GET"], name="docs_asset",
                          include_in_schema=False)

    for name, media_type in _ASSETS.items():
        asset_route(name, media_type)
