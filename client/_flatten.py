"""Walk a nested state dict into named leaves that can be written back in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .flat import FlatShard

__all__ = ["Leaf", "flatten_state_dict", "param_groups_of"]

PARAM_GROUPS = "param_groups"


@dataclass
class Leaf:
    fqn: str
    container: Any
    key: Any
    value: Any
    kind: str  # "tensor" | "object"

    @property
    def group(self) -> str:
        return self.fqn.split(".", 1)[0]


def _is_leaf_list(value: list | tuple) -> bool:
    """DCP's rule: a list is one value unless it holds tensors, dicts or lists."""
    return not any(isinstance(v, (torch.Tensor, FlatShard, dict, list)) for v in value)


def flatten_state_dict(sd: Any) -> list[Leaf]:
    """Leaves of ``sd`` in insertion order, named as ``torch.distributed.checkpoint`` names them
    (``optim.param_groups.0.lr``), so checkpoints move between ckptd's client and DCP.

    Dicts are walked; lists are walked only when they hold tensors or containers;
    tensors, DTensors and FlatShards are tensor leaves; anything else (tuples
    included) is an object leaf.
    """
    out: list[Leaf] = []
    if not isinstance(sd, dict):
        raise TypeError(f"state_dict must be a dict, got {type(sd).__name__}")

    def walk(container: Any, key: Any, value: Any, path: str) -> None:
        if isinstance(value, (torch.Tensor, FlatShard)):
            out.append(Leaf(path, container, key, value, "tensor"))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(value, k, v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, list) and not _is_leaf_list(value):
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


def param_groups_of(sd: Any, prefix: str = "") -> list[tuple[str, list[dict]]]:
    """Every optimizer ``param_groups`` list in ``sd``, with the name of the dict holding it."""
    found: list[tuple[str, list[dict]]] = []
    if isinstance(sd, dict):
        for k, v in sd.items():
            if k == PARAM_GROUPS and isinstance(v, list) and all(isinstance(g, dict) for g in v):
                found.append((prefix, v))
            else:
                found.extend(param_groups_of(v, f"{prefix}.{k}" if prefix else str(k)))
    return found
