"""Walk a nested state dict into named leaves that can be written back in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .flat import FlatShard

__all__ = ["Leaf", "flatten_state_dict"]

PARAM_GROUPS = "param_groups"


@dataclass
class Leaf:
    fqn: str
    container: Any
    key: Any
    value: Any
    kind: str  # "tensor" | "object" | "param_groups"

    @property
    def group(self) -> str:
        return self.fqn.split(".", 1)[0]


def flatten_state_dict(sd: Any) -> list[Leaf]:
    """Leaves of ``sd`` in insertion order. Dicts and lists are walked; tensors,
    DTensors and FlatShards are tensor leaves; an optimizer's ``param_groups``
    list is one leaf; anything else (tuples included) is an object leaf."""
    out: list[Leaf] = []
    if not isinstance(sd, dict):
        raise TypeError(f"state_dict must be a dict, got {type(sd).__name__}")

    def walk(container: Any, key: Any, value: Any, path: str) -> None:
        if isinstance(value, (torch.Tensor, FlatShard)):
            out.append(Leaf(path, container, key, value, "tensor"))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(value, k, v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, list) and key == PARAM_GROUPS and all(isinstance(g, dict) for g in value):
            out.append(Leaf(path, container, key, value, "param_groups"))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(value, i, v, f"{path}.{i}")
        else:
            out.append(Leaf(path, container, key, value, "object"))

    for k, v in sd.items():
        walk(sd, k, v, str(k))
    names = [leaf.fqn for leaf in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"state_dict has keys that flatten to the same name: {dup[:5]}")
    return out
