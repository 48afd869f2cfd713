"""A small FSDP2 training job used by the end-to-end tests, the example and the benchmark.

Dimensions deliberately do not divide by 2, 3 or 4, so shards are uneven and
some ranks hold fewer rows than others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

GLOBAL_BATCH = 12
LR = 3.7e-3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 13)
        self.l1 = torch.nn.Linear(13, 29)
        self.l2 = torch.nn.Linear(29, 7)
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.l2(torch.tanh(self.l1(self.emb(x).mean(1)))))


def build(world: int, seed: int, lr: float = LR) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.l1, model.l2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g), torch.randn(GLOBAL_BATCH, 7, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    """One step on this rank's slice of a fixed global batch; returns the global mean loss."""
    x, y = batch(step)
    per = GLOBAL_BATCH // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    opt.zero_grad()
    loss_sum = ((model(xs) - ys) ** 2).sum()
    (loss_sum * world / GLOBAL_BATCH).backward()  # FSDP averages gradients over ranks
    opt.step()
    total = loss_sum.detach().clone()
    dist.all_reduce(total)
    return float(total) / GLOBAL_BATCH


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def apply(model: torch.nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def full_tensors(sd: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, gathered whole (collective)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(full_tensors(v, f"{name}."))
        elif isinstance(v, DTensor):
            out[name] = v.full_tensor().clone()
        elif isinstance(v, torch.Tensor):
            out[name] = v.clone()
    return out


def save_job(rank: int, world: int, url: str, ref: str) -> dict:
    """Train 3 steps, save through ckptd, then record the full state and the next two losses."""
    from ckptd_client import CheckpointClient

    model, opt = build(world, seed=0)
    for step in range(3):
        train_step(model, opt, step, rank, world)
    client = CheckpointClient(url)
    handle = client.save(state(model, opt), ref)
    handle.wait()
    client.close()
    saved = full_tensors(state(model, opt))
    loss_next = train_step(model, opt, 3, rank, world)
    loss_after = train_step(model, opt, 4, rank, world)
    return {"tensors": saved, "loss_next": loss_next, "loss_after": loss_after}


def load_job(rank: int, world: int, url: str, ref: str) -> dict:
    """Build the same model with wrong values, load ``ref`` through ckptd, record the full state, the
    learning rate and the next two losses (which must equal the saving job's)."""
    from ckptd_client import CheckpointClient

    model, opt = build(world, seed=123, lr=1.0)
    train_step(model, opt, 0, rank, world)  # materialise optimizer state with the wrong values
    sd = state(model, opt)
    client = CheckpointClient(url)
    report = client.load(sd, ref)
    client.close()
    apply(model, opt, sd)
    loaded = full_tensors(state(model, opt))
    lr = opt.param_groups[0]["lr"]
    loss_next = train_step(model, opt, 3, rank, world)
    loss_after = train_step(model, opt, 4, rank, world)
    return {"tensors": loaded, "lr": lr, "loss_next": loss_next, "loss_after": loss_after,
            "restored": len(report.tensors), "bytes_read": report.bytes_read}
