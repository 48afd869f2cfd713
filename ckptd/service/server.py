"""Run the service under uvicorn (uvloop + httptools when installed)."""

from __future__ import annotations

import importlib.util
import logging

import uvicorn

from .app import create_app
from .settings import Settings

__all__ = ["serve"]


def serve(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("ckptd.service").warning(
            "listening on %s without authentication: anyone who can reach this port can read and write "
            "checkpoints", settings.host)
    uvicorn.run(app, host=settings.host, port=settings.port, loop=loop, http=http,
                log_level=settings.log_level.lower(), timeout_keep_alive=30)
