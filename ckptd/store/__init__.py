"""The checkpoint store core: sessions and commit, reads, verification.

The service's HTTP handlers and the CLI (with ``--root``) both call this
layer; nothing here knows about HTTP.
"""

from .reader import CheckpointReader
from .sessions import FileSink, SessionStore

__all__ = ["CheckpointReader", "FileSink", "SessionStore"]
