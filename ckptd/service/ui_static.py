"""The web view's static shell: ``/ui`` and its assets, open, holding no data.

A browser cannot send an ``Authorization`` header when it navigates to a page, so the page itself
is an open, static shell (HTML, ES modules, CSS: the same bytes for everyone, no run name, no
figure). Its script asks for the token once, keeps it in ``sessionStorage`` (gone when the tab
closes; never in a cookie, so no other site's page can make the browser send it) and reads every
figure from the ``/v1/ui/...`` JSON routes (``ui_routes``) with ``Authorization: Bearer``, where
the API's scopes apply as everywhere else.

Front end: plain ES modules, no framework and no build step. The pages are tables, progress bars
and SVG, a few hundred lines; a library (Preact+htm, Alpine.js) would be a vendored file to keep
up to date for little gain, and ES modules run as shipped in every browser of the last five years.
The scripts build the DOM with ``textContent`` and ``createElement`` only (never ``innerHTML``), and
the shell is served with a Content-Security-Policy allowing scripts, styles and requests from this
origin only: a name in a checkpoint cannot become markup, and the page fetches nothing from elsewhere.

Assets ship inside the package (``ckptd/service/ui/static``); each is its own route (the access
check matches open paths exactly). Call order: :func:`install_ui` once, before ``install_docs``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

__all__ = ["STATIC", "install_ui"]

STATIC = Path(__file__).with_name("ui") / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated (ETag): a new version of the service is seen at once
}


def install_ui(app: FastAPI) -> None:
    """Serve ``/ui`` (and ``/ui/``) and every file of :data:`STATIC` at ``/ui/static/NAME``."""
    async def ui_shell() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type=_TYPES[".html"], headers=HEADERS)

    for path in ("/ui", "/ui/"):
        app.add_api_route(path, ui_shell, methods=["GET"], name="ui_shell", include_in_schema=False)

    def asset_route(file: Path) -> None:
        async def ui_asset() -> FileResponse:
            return FileResponse(file, media_type=_TYPES[file.suffix], headers=HEADERS)

        app.add_api_route(f"/ui/static/{file.name}", ui_asset, methods=["GET"], name="ui_asset",
                          include_in_schema=False)

    for file in sorted(STATIC.iterdir()):
        if file.is_file() and file.suffix in _TYPES:
            asset_route(file)
