"""Layout specs: the CLI spelling of a target layout (docs/design.md §3), parsed before any I/O.

Grammar::

    replicate[:dp=N]              DDP: every rank holds every tensor (written once, balanced over N)
    full                          one rank, whole tensors
    fsdp2:dp=N                    DTensor Shard(0) over N ranks, torch.chunk semantics
    zero1:dp=N[,align=A]          weights replicated, optimizer state flat-partitioned
    zero2:dp=N[,align=A]          as zero1 (gradients, if saved, flat-partitioned too)
    zero3:dp=N[,align=A]          everything flat-partitioned
    fsdp1:dp=N[,align=A]          as zero3 (FSDP1 flat parameters)
    tp=T[,dp=N]                   tensor parallel (column Shard(0) / row Shard(1)) x dp Shard(0)
    owner:dp=N[,max-per-rank=K][,group=role]
                                  whole matrices, each owned by one rank, balanced by bytes;
                                  group=role batches same-role, same-shape matrices (MoE)
    pp=P                          pipeline stages own contiguous layer ranges
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptd_schemas import InvalidRequest

__all__ = ["GRAMMAR", "LayoutSpec", "default_out_name", "parse_spec"]

GRAMMAR = (
    "replicate[:dp=N] | full | fsdp2:dp=N | zero1:dp=N[,align=A] | zero2:dp=N[,align=A] | zero3:dp=N[,align=A] | "
    "fsdp1:dp=N[,align=A] | tp=T[,dp=N] | owner:dp=N[,max-per-rank=K][,group=role] | pp=P"
)
_ALLOWED = {
    "replicate": ({"dp"}, set()), "full": (set(), set()), "fsdp2": ({"dp"}, {"dp"}),
    "zero1": ({"dp", "align"}, {"dp"}), "zero2": ({"dp", "align"}, {"dp"}), "zero3": ({"dp", "align"}, {"dp"}),
    "fsdp1": ({"dp", "align"}, {"dp"}), "tp": ({"tp", "dp"}, {"tp"}),
    "owner": ({"dp", "max-per-rank", "group"}, {"dp"}),
    "pp": ({"pp"}, {"pp"}),
}
MAX_WORLD = 1 << 16


@dataclass(frozen=True)
class LayoutSpec:
    kind: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    align: int = 1
    max_per_rank: int | None = None
    group: str | None = None

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "replicate":
            return "replicate" if self.dp == 1 else f"replicate:dp={self.dp}"
        if self.kind == "tp":
            return f"tp={self.tp}" + (f",dp={self.dp}" if self.dp != 1 else "")
        if self.kind == "pp":
            return f"pp={self.pp}"
        extra = f",align={self.align}" if self.align != 1 else ""  # only the flat kinds take one
        if self.kind == "owner":
            extra = (f",max-per-rank={self.max_per_rank}" if self.max_per_rank is not None else "") + (
                f",group={self.group}" if self.group else "")
        return f"{self.kind}:dp={self.dp}{extra}"


def _bad(spec: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"invalid layout spec {spec!r}: {why}. Grammar: {GRAMMAR}", spec=spec, grammar=GRAMMAR)


def parse_spec(spec: str) -> LayoutSpec:
    """Parse and validate; raise InvalidRequest (showing the grammar) on anything else."""
    s = spec.strip() if isinstance(spec, str) else ""
    if not s:
        raise _bad(str(spec), "empty")
    m = re.fullmatch(r"([a-z0-9]+)(?::(.*))?", s)
    if s.startswith(("tp=", "pp=")):
        kind, rest = s[:2], s
    elif m:
        kind, rest = m.group(1), m.group(2) or ""
    else:
        raise _bad(s, "unrecognised form")
    if kind not in _ALLOWED:
        raise _bad(s, f"unknown layout {kind!r}")
    allowed, required = _ALLOWED[kind]
    params: dict[str, int] = {}
    group: str | None = None
    for part in filter(None, rest.split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            raise _bad(s, f"{kind} takes {sorted(allowed) or 'no parameters'}, not {part!r}")
        if key in params or (key == "group" and group is not None):
            raise _bad(s, f"{key} given twice")
        if key == "group":
            if value.strip() != "role":
                raise _bad(s, f"group must be 'role', not {value!r}")
            group = "role"
            continue
        if not re.fullmatch(r"[0-9]{1,6}", value.strip()):
            raise _bad(s, f"{key} must be a positive integer, not {value!r}")
        params[key] = int(value)
        if params[key] < 1:
            raise _bad(s, f"{key} must be at least 1")
    missing = required - set(params)
    if missing:
        raise _bad(s, f"{kind} needs {', '.join(sorted(missing))}")
    out = LayoutSpec(kind=kind, dp=params.get("dp", 1), tp=params.get("tp", 1), pp=params.get("pp", 1),
                     align=params.get("align", 1), max_per_rank=params.get("max-per-rank"), group=group)
    if out.world_size > MAX_WORLD:
        raise _bad(s, f"world size {out.world_size} exceeds {MAX_WORLD}")
    return out


def default_out_name(name: str, spec: str, dtype: str | None) -> str:
    """The output name a conversion of checkpoint ``name`` to ``spec`` gets when none is given."""
    slug = spec.replace(":", "-").replace("=", "").replace(",", "-")
    return f"{name}-{slug}" + (f"-{dtype}" if dtype else "")
