"""A data file's chunks, declared by its writer with its bytes, so the service checks each as it arrives.

A rank packs and hashes a whole file before it sends it, so it knows every piece the file holds (each
chunk and stored object: where, how long, its XXH3-64, its codec and decoded length) before the first
byte goes out. Sent ahead of the bytes, that declaration lets the service run the one checker over the
bytes as they pass (``ckptd.store.checker.arrival_check``): a false digest, a frame that does not
decode to its length, is refused with the upload, and the commit later confirms the file by its stored
identity instead of reading it again, when the merged manifest's rows of the file are exactly the ones
checked (:func:`rows_digest` of both). Anything else (no declaration, other rows, a replica to
compare, a file changed since) is read back at the commit as before.

Wire: the declaration is ``encode(rows)``, JSON, ``N`` bytes, sent first: over HTTP the body of
``PUT .../files/{file}`` starts with it, its length in the :data:`CHUNKS_HEADER` header (the body is
then ``N`` + the file's size, ``X-Ckptd-Xxh3`` the digest of the file's bytes alone); through the
co-located socket the memory file starts with it, ``chunks: N`` in the header. A service offers this
in the session's answer (``SessionInfo.arrival_checks``); a client sends it only where offered.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, NamedTuple

from .errors import InvalidRequest
from .filedigest import xxh3_hex

__all__ = ["CHUNKS_HEADER", "MAX_BYTES", "Declared", "encode", "parse", "rows_digest"]

CHUNKS_HEADER = "X-Ckptd-Chunks"
#: The longest declaration a service takes (about 150,000 rows); a writer with more declares nothing,
#: and its file is read back at the commit.
MAX_BYTES = 16 << 20
_HEX = re.compile(r"[0-9a-f]{16}")
_CODECS = ("raw", "zstd", "blosc2")
_KINDS = ("tensor", "object")


class Declared(NamedTuple):
    """One piece of a file: bytes ``[offset, offset + length)``, their XXH3-64, the codec they are in and
    the length they decode to (``length`` when raw), and what they are (``kind``, ``name``)."""

    offset: int
    length: int
    xxh3: str
    codec: str
    raw_length: int
    kind: str
    name: str


def encode(rows: Iterable[Declared]) -> bytes:
    """The declaration's bytes: a JSON list of rows, each a list in :class:`Declared`'s order."""
    return json.dumps([list(r) for r in rows], separators=(",", ":")).encode()


def parse(raw: bytes, file: str) -> list[Declared]:
    """The rows of a declaration of ``file``; :class:`InvalidRequest` naming the file and the row where
    it is not one (the upload is refused before a byte of the file is stored)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidRequest(f"file {file!r}: its chunk declaration is not JSON", file=file) from None
    if not isinstance(data, list):
        raise InvalidRequest(f"file {file!r}: its chunk declaration is not a list of rows", file=file)
    out = []
    for i, row in enumerate(data):
        if not (isinstance(row, list) and len(row) == 7):
            raise InvalidRequest(f"file {file!r}: chunk declaration row {i} is not 7 fields", file=file, row=i)
        off, n, digest, codec, raw_length, kind, name = row
        ints = all(type(v) is int and 0 <= v < 1 << 62 for v in (off, n, raw_length))
        if not (ints and isinstance(digest, str) and _HEX.fullmatch(digest) and codec in _CODECS and kind in _KINDS
                and isinstance(name, str) and len(name) <= 4096 and (codec != "raw" or raw_length == n)):
            raise InvalidRequest(f"file {file!r}: chunk declaration row {i} is not (offset, length, xxh3, codec, "
                                 f"raw length, kind, name)", file=file, row=i)
        out.append(Declared(off, n, digest, codec, raw_length, kind, name))
    return out


def rows_digest(rows: Iterable[tuple[int, int, str, str, int]]) -> str:
    """The digest of a set of rows ``(offset, length, xxh3, codec, raw length)``, in any order, repeats
    once: what an arrival check covered, compared at the commit with the manifest's rows of the file."""
    return xxh3_hex(json.dumps(sorted(set(rows)), separators=(",", ":")).encode())
