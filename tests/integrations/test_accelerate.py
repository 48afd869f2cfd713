"""Hugging Face Accelerate through ckptd: ``save_state`` / ``load_state`` with a real ``Accelerator``.

Two gloo ranks (Accelerate's ``MULTI_CPU``: the model wrapped in DDP) train a float64 MLP with AdamW
and a StepLR schedule, save after two steps, and train two more. Three ranks resume from the
checkpoint: their next two global losses equal the uninterrupted run's (the tolerance is summation
order: three ranks' means of two samples averaged against two ranks' means of three), the step comes
back, ranks 0 and 1 draw the same python, numpy and torch random numbers as the saving ranks did,
and rank 2, which the saving job did not have, keeps its own RNG. A single process resumes too (not
slow), and ``examples/accelerate_ckptd.py`` runs as the README shows it.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from support import REPO, assert_quoted, run_example, run_ranks

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

from ckptd_client import CheckpointClient, StateDictMismatch  # noqa: E402
from ckptd_client.integrations.accelerate import load_state, save_state  # noqa: E402

N, GLOBAL_BATCH, SAVE_AT, STEPS = 24, 6, 2, 4  # a global batch every world size of 1, 2, 3 splits evenly


def _batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of each step's six samples, the same samples at every world size."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.sin(x).sum(1, keepdim=True)
    return [(x[s + rank:s + GLOBAL_BATCH:world], y[s + rank:s + GLOBAL_BATCH:world]) for s in range(0, N, GLOBAL_BATCH)]


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1, dtype=torch.float64).item()


def train(rank: int, world: int, url: str, start_from: str | None, save_to: str | None, steps: int) -> dict:
    if world > 1:  # what accelerate launch / torchrun would set; run_ranks has made the gloo group
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)  # one schedule step per step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05 if start_from is None else 0.7)  # the checkpoint's wins
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.6)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    random.seed(100 + rank), np.random.seed(100 + rank), torch.manual_seed(100 + rank)  # per-rank RNG streams
    out: dict = {"losses": {}, "world": accelerator.num_processes}
    client = CheckpointClient(url)
    if start_from is not None:
        loaded = load_state(accelerator, client, start_from)
        out.update(step=accelerator.step, restored_rng=loaded.restored_rng, draws=_draws(),
                   lr=opt.param_groups[0]["lr"], ref=loaded.report.ref)
    batches = _batches(rank, world)
    while accelerator.step < steps:
        step = accelerator.step
        x, y = batches[step]
        with accelerator.accumulate(model):  # counts accelerator.step
            loss = (model(x) - y).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        out["losses"][step] = accelerator.reduce(loss.detach(), reduction="mean").item()
        if save_to is not None and accelerator.step == SAVE_AT:
            save_state(accelerator, client, f"{save_to}/{accelerator.step}").wait()
            out["draws"] = _draws()
    client.close()
    return out


@pytest.mark.slow
def test_two_ranks_save_three_resume_with_the_same_losses_step_and_rng(server, tmp_path):
    first = [r["result"] for r in run_ranks(train, 2, server.url, None, "acc", STEPS, tmp=tmp_path)]
    assert first[0]["world"] == 2 and sorted(first[0]["losses"]) == list(range(STEPS))
    manifest = CheckpointClient(server.url).manifest("acc/latest")
    assert manifest.step == SAVE_AT and manifest.topology.world_size == 2
    assert {o.name for o in manifest.objects if o.name.startswith("rng.")} >= {"rng.0.python", "rng.1.numpy"}

    resumed = [r["result"] for r in run_ranks(train, 3, server.url, "acc/latest", None, STEPS, tmp=tmp_path)]
    assert resumed[0]["world"] == 3 and resumed[0]["ref"] == "acc/2"
    for r, got in enumerate(resumed):
        assert got["step"] == SAVE_AT
        assert got["lr"] == pytest.approx(0.05 * 0.6 ** SAVE_AT, rel=1e-15)  # the schedule, not 0.7
        assert sorted(got["losses"]) == list(range(SAVE_AT, STEPS))
        for step, loss in got["losses"].items():
            # float64: only the order of the sums differs; one wrong weight, Adam moment or lr is far above 1e-12
            assert loss == pytest.approx(first[0]["losses"][step], rel=1e-12, abs=0), (r, step)
    for r in (0, 1):
        assert resumed[r]["restored_rng"] is True and resumed[r]["draws"] == first[r]["draws"], r
    assert resumed[2]["restored_rng"] is False and resumed[2]["draws"] != first[0]["draws"]


def test_one_process_saves_and_resumes(server, tmp_path):
    first = train(0, 1, server.url, None, "one", STEPS)
    got = train(0, 1, server.url, "one/latest", None, STEPS)
    assert got["step"] == SAVE_AT and got["restored_rng"] is True and got["draws"] == first["draws"]
    assert got["losses"] == {s: first["losses"][s] for s in range(SAVE_AT, STEPS)}  # one process: exactly
    with pytest.raises(StateDictMismatch, match="optimizer_1"):  # an accelerator holding more than was saved
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 1).double()
        a, b = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        model, a, b = accelerator.prepare(model, a, b)
        with CheckpointClient(server.url) as client:
            load_state(accelerator, client, "one/latest")


def test_the_docs_quote_the_example():
    assert_quoted(REPO / "examples" / "accelerate_ckptd.py")


@pytest.mark.slow
def test_the_accelerate_example_saves_on_two_ranks_and_resumes_on_one(server, tmp_path):
    example = REPO / "examples" / "accelerate_ckptd.py"
    run_example(example, "--save", "hf/8", "--steps", "8", url=server.url, ranks=2,
                expect="saved hf/8 at step 8 from 2 ranks")
    resumed = run_example(example, "--load", "hf/latest", "--steps", "12", url=server.url,
                          expect="resumed hf/8 at step 8 on 1 rank")
    assert "finished at step 12" in resumed.stdout, resumed.stdout[-2000:]
