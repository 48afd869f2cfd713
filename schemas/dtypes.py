"""Dtype names as stored in manifests (torch's names without the ``torch.`` prefix).

Every dtype of fixed, whole-byte element size that ``torch.distributed.checkpoint`` saves is listed:
the unsigned integers wider than a byte, the float8 variants, ``complex32`` and the packed
``float4_e2m1fn_x2`` (two 4-bit values per byte). Sub-byte dtypes (``uint1`` .. ``uint7``,
``int1`` .. ``int7``) and quantized dtypes are not: a state dict holding one is refused at save.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DType", "FLOATING", "ITEMSIZE", "itemsize"]

DType = Literal[
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
    "bool", "complex32", "complex64", "complex128",
]

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1, "complex32": 4, "complex64": 8, "complex128": 16,
}
assert set(ITEMSIZE) == set(get_args(DType))

FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})  # what --dtype casts apply to


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]
