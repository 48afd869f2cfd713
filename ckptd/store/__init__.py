"""The checkpoint store core: sessions (intake, commit, sweep), reads, verification.

The service's HTTP handlers and the CLI (with ``--root``) both call this
layer; nothing here knows about HTTP.
"""

from typing import TYPE_CHECKING

from ckptd_schemas.lazy import lazy_exports

if TYPE_CHECKING:
    from .reader import CheckpointReader
    from .sessions import SessionStore

__all__ = ["CheckpointReader", "SessionStore"]

# Imported when first named: ``ckptd verify`` needs neither the write side nor the reader.
__getattr__ = lazy_exports(__name__, {"CheckpointReader": ".reader", "SessionStore": ".sessions"}, globals())
