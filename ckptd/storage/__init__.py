"""Storage backends behind one interface (:class:`Storage`)."""

from __future__ import annotations

from .base import Presigned, Storage, Writer, check_key
from .local import LocalStorage

__all__ = ["LocalStorage", "Presigned", "Storage", "Writer", "check_key", "open_storage"]


def open_storage(root: str, **options: object) -> Storage:
    """A plain path opens :class:`LocalStorage`; ``s3://`` (``s3a://``) :class:`~ckptd.storage.s3.S3Storage`;
    any other ``scheme://`` URL :class:`~ckptd.storage.fsspec.FsspecStorage`; ``tiered:FAST|DURABLE`` a
    :class:`~ckptd.storage.tiered.TieredStorage` over the two (``ckptd serve --durable``)."""
    if root.startswith("tiered:"):
        from .tiered import TieredStorage, split_tiered

        fast, durable = split_tiered(root)
        return TieredStorage(open_storage(fast, **options), open_storage(durable))
    if root.startswith(("s3://", "s3a://")):
        from .s3 import S3Storage

        return S3Storage(root, **options)
    if "://" in root:
        from .fsspec import FsspecStorage

        return FsspecStorage(root, **options)
    return LocalStorage(root, **options)  # type: ignore[arg-type]
