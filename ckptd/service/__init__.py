"""The HTTP service (FastAPI). Requires the ``server`` extra."""

from .app import create_app
from .settings import Settings

__all__ = ["Settings", "create_app"]
