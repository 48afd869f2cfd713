"""``ckptd_schemas.dtypes``: the manifest's dtype names are torch's, with torch's element sizes, and
every whole-byte dtype torch has is one of them (a sub-byte or quantized one is not, as the module says).

The element size decides every raw chunk's byte length (``numel * itemsize``), so one wrong entry
makes the commit refuse, or a load misread, every tensor of that dtype. Pure: torch is only asked.
"""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch

from ckptd_schemas.dtypes import FLOATING, ITEMSIZE, DType, itemsize

SUB_BYTE = re.compile(r"^u?int[1-7]$")


def _torch_dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by their own name (``str(dtype)`` without ``torch.``; aliases such as ``half`` folded)."""
    out = {}
    for v in vars(torch).values():
        if isinstance(v, torch.dtype):
            out[str(v).removeprefix("torch.")] = v
    return out


@pytest.mark.parametrize("name", sorted(ITEMSIZE))
def test_each_name_is_a_torch_dtype_of_that_size(name):
    dt = _torch_dtypes().get(name)
    assert dt is not None, f"{name} is not a torch dtype"
    assert itemsize(name) == ITEMSIZE[name] == dt.itemsize
    assert not dt.is_complex or ITEMSIZE[name] % 2 == 0


def test_the_literal_and_the_size_table_list_the_same_names():
    assert set(get_args(DType)) == set(ITEMSIZE)
    assert len(get_args(DType)) == len(ITEMSIZE)


def test_every_whole_byte_dtype_of_torch_is_listed_and_sub_byte_or_quantized_ones_are_not():
    for name, dt in _torch_dtypes().items():
        if name.startswith("bits"):  # opaque bit containers with no element type: not state-dict tensors
            continue
        refused = SUB_BYTE.match(name) is not None or name.startswith(("qint", "quint"))
        if refused:
            assert name not in ITEMSIZE, f"{name} is sub-byte or quantized: a save refuses it"
        else:
            assert name in ITEMSIZE, f"torch dtype {name} ({dt.itemsize} bytes) is not in the manifest's dtypes"


def test_floating_is_the_cast_targets_only():
    """``--dtype`` casts between the ordinary floating dtypes; float8/float4 are storage formats, not casts."""
    assert FLOATING <= set(ITEMSIZE)
    for name in FLOATING:
        dt = _torch_dtypes()[name]
        assert dt.is_floating_point and dt.itemsize >= 2
    assert FLOATING == {"float64", "float32", "float16", "bfloat16"}
    assert not any(n.startswith(("float8", "float4")) for n in FLOATING)


@pytest.mark.parametrize("bad", ["float128", "torch.float32", "half", "int4", "qint8", ""])
def test_an_unknown_name_has_no_size(bad):
    with pytest.raises(KeyError):
        itemsize(bad)
