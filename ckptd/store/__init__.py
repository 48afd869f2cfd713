"""The checkpoint store core: sessions and commit, reads, verification.

The service's HTTP handlers and the CLI (with ``--root``) both call this
layer; nothing here knows about HTTP.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reader import CheckpointReader
    from .sessions import FileSink, SessionStore

__all__ = ["CheckpointReader", "FileSink", "SessionStore"]

_WHERE = {"CheckpointReader": "reader", "FileSink": "sessions", "SessionStore": "sessions"}


def __getattr__(name: str) -> Any:
    """Imported when first named: ``ckptd verify`` needs neither the write side nor the reader."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd.store' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
