"""Walk a nested state dict into named leaves that can be written back in place.

One walk (:func:`flatten`) gives a save everything it reads of the state dict's structure: the
leaves and the optimizers' ``param_groups``; load walks with it too (its ``leaves``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .flat import FlatShard

__all__ = ["Flattened", "Leaf", "flatten"]

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


@dataclass
class Flattened:
    leaves: list[Leaf]
    param_groups: list[tuple[str, list[dict]]] = field(default_factory=list)  # (name of the dict holding it, groups)


def flatten(sd: Any) -> Flattened:
    """Leaves of ``sd`` in insertion order, named as ``torch.distributed.checkpoint`` names them
    (``optim.param_groups.0.lr``), so checkpoints move between ckptd's client and DCP; and every
    optimizer ``param_groups`` list (a list of dicts under that key, reached through dicts only).

    Dicts are walked; lists are walked only when they hold tensors or containers;
    tensors, DTensors and FlatShards are tensor leaves; anything else (tuples
    included) is an object leaf.
    """
    out: list[Leaf] = []
    groups: list[tuple[str, list[dict]]] = []
    if not isinstance(sd, dict):
        raise TypeError(f"state_dict must be a dict, got {type(sd).__name__}")

    def walk(container: Any, key: Any, value: Any, path: str, dicts: bool) -> None:
        if isinstance(value, (torch.Tensor, FlatShard)):
            out.append(Leaf(path, container, key, value, "tensor"))
        elif isinstance(value, dict):
            for k, v in value.items():
                if dicts and k == PARAM_GROUPS and isinstance(v, list) and all(isinstance(g, dict) for g in v):
                    groups.append((path, v))
                walk(value, k, v, f"{path}.{k}" if path else str(k), dicts)
        elif isinstance(value, list) and not _is_leaf_list(value):
            for i, v in enumerate(value):
                walk(value, i, v, f"{path}.{i}", False)
        else:
            out.append(Leaf(path, container, key, value, "object"))

    walk(None, None, sd, "", True)
    names = [leaf.fqn for leaf in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"state_dict has keys that flatten to the same name: {dup[:5]}")
    return Flattened(out, groups)
