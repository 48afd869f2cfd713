"""The layouts a drill converts to: layout specs, and ``half`` / ``double`` relative to the source. Pure, no I/O.

A drill layout is either a layout spec (``ckptd.reshard.spec``: ``full``, ``fsdp2:dp=4``, ...) or one
of two words resolved against the source checkpoint's manifest:

* ``half``   -> ``fsdp2:dp=max(1, D // 2)``
* ``double`` -> ``fsdp2:dp=2*D`` (at most the spec grammar's world size)

where D, the source's **data-parallel degree**, is read off its manifest's topology: the product
of the mesh dimensions named ``dp`` or ``dp_*`` (torchtitan's ``dp_replicate``, ``dp_shard``; the
client names a one-dimensional DTensor mesh ``dp``) when the mesh names any; otherwise the world
size divided by the product of the model-parallel dimensions (``tp``, ``pp``, ``cp``, ``ep``)
the mesh names (no mesh, or none of those: the world size, every rank a data-parallel rank). D is
at least 1. So a save by 4 ranks of FSDP2 (or of plain tensors) has D = 4: ``half`` is
``fsdp2:dp=2``, ``double`` ``fsdp2:dp=8``; a ``{"dp": 2, "tp": 2}`` save has D = 2.

``CKPTD_DRILL_LAYOUTS`` lists layouts separated by commas; since a spec's own options are
comma-separated too, a piece that starts with an option (``dp=``, ``align=``, ``max-per-rank=``,
``group=``) belongs to the spec before it: ``half,zero3:dp=8,align=16,full`` is three layouts,
``tp=2,dp=2,full`` two.
"""

from __future__ import annotations

from math import prod

from ckptd_schemas import InvalidRequest, Topology

from .spec import GRAMMAR, MAX_WORLD, LayoutSpec, parse_spec

__all__ = ["RELATIVE", "check_layout", "data_parallel_degree", "resolve_layout", "split_layouts"]

#: The words a drill layout may be besides a spec.
RELATIVE = ("half", "double")
_OPTIONS = ("dp=", "align=", "max-per-rank=", "group=")
_MODEL_PARALLEL = ("tp", "pp", "cp", "ep")


def split_layouts(text: str) -> list[str]:
    """The layouts of a comma-separated list (module docstring: an option continues the spec before it)."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if out and piece.startswith(_OPTIONS) and out[-1] not in RELATIVE:
            out[-1] = f"{out[-1]},{piece}"
        else:
            out.append(piece)
    return out


def check_layout(layout: str) -> str:
    """``layout`` normalised (a spec as ``str(parse_spec(...))``, a relative word as is); refused with the
    grammar (:class:`InvalidRequest`) before any I/O."""
    text = layout.strip() if isinstance(layout, str) else ""
    if text in RELATIVE:
        return text
    try:
        return str(parse_spec(text))
    except InvalidRequest as e:
        raise InvalidRequest(f"{e.message} (or one of {', '.join(RELATIVE)}: half or double the source's "
                             f"data-parallel degree)", spec=layout, grammar=GRAMMAR) from None


def data_parallel_degree(topology: Topology) -> int:
    """D of the module docstring."""
    mesh = topology.mesh
    dp = [n for d, n in mesh.items() if d == "dp" or d.startswith("dp_")]
    if dp:
        return max(1, prod(dp))
    return max(1, topology.world_size // max(1, prod(n for d, n in mesh.items() if d in _MODEL_PARALLEL)))


def resolve_layout(layout: str, topology: Topology) -> LayoutSpec:
    """The spec ``layout`` names for a source of ``topology``."""
    text = check_layout(layout)
    if text not in RELATIVE:
        return parse_spec(text)
    d = data_parallel_degree(topology)
    return LayoutSpec(kind="fsdp2", dp=max(1, d // 2) if text == "half" else min(MAX_WORLD, 2 * d))
