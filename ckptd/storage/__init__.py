"""Storage backends behind one interface (:class:`Storage`)."""

from __future__ import annotations

from .base import Presigned, Storage, Writer, check_key
from .local import LocalStorage

__all__ = ["LocalStorage", "Presigned", "Storage", "Writer", "check_key", "open_storage"]


def open_storage(root: str, **options: object) -> Storage:
    """A plain path opens :class:`LocalStorage`; ``s3://`` (``s3a://``) :class:`~ckptd.storage.s3.S3Storage`;
    any other ``scheme://`` URL :class:`~ckptd.storage.fsspec.FsspecStorage`. (A service's root with a
    durable tier, ``tiered:FAST|DURABLE``, is the store's: :func:`ckptd.store.tiers.open_root`.)"""
    if root.startswith(("s3://", "s3a://")):
        from .s3 import S3Storage

        return S3Storage(root, **options)
    if "://" in root:
        from .fsspec import FsspecStorage

        return FsspecStorage(root, **options)
    return LocalStorage(root, **options)  # type: ignore[arg-type]
