"""Storage backends behind one interface (:class:`Storage`)."""

from __future__ import annotations

from .base import Presigned, Storage, Writer, check_key
from .direct import open_regular
from .local import LocalStorage

__all__ = ["LocalStorage", "Presigned", "Storage", "Writer", "check_key", "check_scheme", "open_regular", "open_storage"]

#: What :func:`open_storage` opens, as an error about a root names it.
SUPPORTED = ("a directory, s3://bucket/prefix (s3a://), or the URL of a filesystem whose fsspec package is "
             "installed (memory://, file://; gs:// with gcsfs, az:// with adlfs...)")


def open_storage(root: str, **options: object) -> Storage:
    """A plain path (or ``file://`` URL) opens :class:`LocalStorage`; ``s3://`` (``s3a://``)
    :class:`~ckptd.storage.s3.S3Storage`; any other ``scheme://`` URL :class:`~ckptd.storage.fsspec.FsspecStorage`.
    (A service's root with a durable tier, ``tiered:FAST|DURABLE``, is the store's: :func:`ckptd.store.tiers.open_root`.)"""
    if root.startswith(("s3://", "s3a://")):
        from .s3 import S3Storage

        return S3Storage(root, **options)
    if root.startswith("file://"):
        root = root[len("file://"):]
    elif "://" in root:
        from .fsspec import FsspecStorage

        return FsspecStorage(root, **options)
    return LocalStorage(root, **options)  # type: ignore[arg-type]


def check_scheme(root: str) -> None:
    """Raise ``ValueError`` naming the supported roots when :func:`open_storage` has no backend for
    ``root``'s scheme here (an unknown protocol, or an fsspec filesystem whose package is not
    installed); called before a root is opened (``ckptd serve``'s settings, a command's ``--root``),
    so the mistake is one line, not a failure at start-up."""
    if "://" not in root or root.startswith(("s3://", "s3a://", "file://")):
        return
    scheme = root.split("://", 1)[0]
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as e:  # fsspec: "Please install gcsfs...", "Protocol not known: x"
        raise ValueError(f"no storage backend for {scheme}:// here ({e}); a root is {SUPPORTED}") from None
