"""Dtype names as stored in manifests (torch's names without the ``torch.`` prefix)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DType", "FLOATING", "ITEMSIZE", "itemsize"]

DType = Literal[
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128",
]

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "bool": 1, "complex64": 8, "complex128": 16,
}
assert set(ITEMSIZE) == set(get_args(DType))

FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})  # what --dtype casts apply to


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]
