"""The README's "In a training script" code, executed as written.

Two gloo ranks train a small FSDP2 (``fully_shard``) model on CPU with AdamW and a StepLR schedule
that has moved the learning rate, and run the README's first block (save). Two new ranks build a
fresh model, an optimizer with another learning rate and another schedule, run the same imports and
client, then the README's second block (resume). Weights, optimizer moments and steps, every param
group's hyper-parameters (lr included), the schedule and the step must all come back exactly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from support import REPO, run_ranks

pytestmark = pytest.mark.slow

README = REPO / "README.md"
LR, GAMMA, STEPS = 1e-2, 0.5, 3


def readme_blocks(path: Path) -> tuple[str, str, str]:
    """(setup, save block, resume block): the section's two python blocks; setup is the save block's
    lines before its first ``sd =`` (imports and the client), which a resuming script runs too."""
    section = path.read_text().split("In a training script", 1)[1].split("`save` and `load` are collective", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, f"expected a save block and a resume block, found {len(blocks)}"
    save, resume = blocks
    setup = save[:save.index("\nsd = ")]
    return setup, save, resume


def _model(seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.GELU(), torch.nn.Linear(17, 4))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(v: object) -> object:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.to_local().detach().clone()
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _observed(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object) -> dict:
    """What a resumed job must find: this rank's shards, optimizer state, param groups, schedule."""
    osd = opt.state_dict()
    return {"params": {n: _local(p) for n, p in model.named_parameters()},
            "state": {i: {k: _local(v) for k, v in s.items()} for i, s in osd["state"].items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]],
            "sched": sched.state_dict()}


def save_job(rank: int, world: int, url: str, readme: str) -> dict:
    os.environ["CKPTD_URL"] = url
    _, save, _ = readme_blocks(Path(readme))
    model = _model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(5, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == LR * GAMMA ** STEPS
    ns = {"model": model, "opt": opt, "sched": sched, "step": STEPS}
    exec(compile(save, str(readme), "exec"), ns)  # noqa: S102 - the README's code, as written
    ns["client"].close()
    return _observed(model, opt, sched)


def resume_job(rank: int, world: int, url: str, readme: str, expected: list[dict]) -> dict:
    os.environ["CKPTD_URL"] = url
    setup, _, resume = readme_blocks(Path(readme))
    model = _model(seed=1 + rank)  # other weights
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.3)  # other hyper-parameters
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    ns = {"model": model, "opt": opt, "sched": sched}
    exec(compile(setup, str(readme), "exec"), ns)  # noqa: S102
    exec(compile(resume, str(readme), "exec"), ns)  # noqa: S102
    ns["client"].close()
    got, want = _observed(model, opt, sched), expected[rank]
    assert ns["step"] == STEPS
    assert got["groups"] == want["groups"], (got["groups"], want["groups"])
    assert got["groups"][0]["lr"] == LR * GAMMA ** STEPS
    assert got["sched"] == want["sched"], (got["sched"], want["sched"])
    for part in ("params", "state"):
        assert got[part].keys() == want[part].keys(), part
        for k, w in want[part].items():
            for name, t in (w.items() if isinstance(w, dict) else [(k, w)]):
                v = got[part][k][name] if isinstance(w, dict) else got[part][k]
                assert torch.equal(v.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                    f"{part} {k} {name} differs on rank {rank}"
    return {}


def test_the_readme_training_snippet_restores_model_optimizer_and_schedule(server, tmp_path):
    saved = [r["result"] for r in run_ranks(save_job, 2, server.url, str(README), tmp=tmp_path)]
    run_ranks(resume_job, 2, server.url, str(README), saved, tmp=tmp_path)
