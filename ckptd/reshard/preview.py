"""What a target layout costs per rank, next to the ZeRO estimates (the seed's formulas).

With weights, gradients and optimizer state of b_p, b_g, b_o bytes per
parameter, N parameters and P data-parallel ranks, per-rank static state is
about M_S2 = N*b_p + N*(b_g + b_o)/P (ZeRO-2) and M_S3 = N*(b_p + b_g + b_o)/P
(ZeRO-3). The preview reports the bytes each target rank actually holds, per
kind, the imbalance of the assignment, and the bytes each work unit reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from .planner import ReshardOutline, ReshardPlan

__all__ = ["Preview", "plan_summary", "preview"]

KIND = {"model": "weights", "grad": "gradients", "grads": "gradients", "optim": "optimizer"}


@dataclass
class Preview:
    spec: str
    world_size: int
    per_rank: list[dict[str, int]]       # kind -> bytes
    totals: dict[str, int]
    imbalance: float                     # max / mean - 1
    m_s2: float
    m_s3: float
    grads_estimated: bool
    unit_reads: list[tuple[int, int, str, int]]  # (unit, rank, file, bytes to read)


def preview(plan: ReshardPlan) -> Preview:
    per_rank: list[dict[str, int]] = []
    for groups in plan.rank_bytes:
        kinds: dict[str, int] = {}
        for g, n in groups.items():
            k = KIND.get(g, "other")
            kinds[k] = kinds.get(k, 0) + n
        per_rank.append(kinds)
    totals: dict[str, int] = {}
    for kinds in per_rank:
        for k, n in kinds.items():
            totals[k] = totals.get(k, 0) + n
    loads = [sum(k.values()) for k in per_rank]
    total, peak = sum(loads), max(loads) if loads else 0
    mean = total / len(loads) if loads else 0
    P = plan.mesh.get("dp", 1)
    w = totals.get("weights", 0)
    grads_estimated = "gradients" not in totals
    g = totals.get("gradients", w)
    o = totals.get("optimizer", 0)
    return Preview(
        spec=plan.target_spec, world_size=plan.world_size, per_rank=per_rank, totals=totals,
        imbalance=(peak / mean - 1) if mean else 0.0,
        m_s2=w + (g + o) / P, m_s3=(w + g + o) / P, grads_estimated=grads_estimated,
        unit_reads=[(u.index, u.rank, u.file, u.bytes_to_read) for u in plan.units])


def plan_summary(outline: ReshardOutline) -> dict:
    """What the web view shows of a job's plan: target layout, bytes, per-rank loads and every work
    unit, from its outline (no read planned; recorded with the job: ``models.put_plan_summary``)."""
    p = preview(outline.plan(reads=False))
    h = outline.header
    return {"source": h["source"], "source_session": h["source_session"], "spec": h["target_spec"],
            "world_size": h["world_size"], "mesh": h["mesh"], "group_layouts": h["group_layouts"],
            "bytes_to_write": outline.bytes_to_write, "per_rank": p.per_rank, "imbalance": p.imbalance,
            "units_total": len(outline.cuts),
            "units": [{"index": c.index, "rank": c.rank, "file": c.file, "size": c.size, "chunks": len(c.chunks)}
                      for c in outline.cuts]}
