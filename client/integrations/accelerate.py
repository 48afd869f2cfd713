"""Hugging Face Accelerate: ``save_state`` / ``load_state`` of an ``Accelerator`` through ckptd.

    from ckptd_client.integrations.accelerate import load_state, save_state
    model, opt, sched = accelerator.prepare(model, opt, sched)
    load_state(accelerator, client, "run/latest")          # any world size; sets accelerator.step
    ...                                                    # train
    save_state(accelerator, client, f"run/{accelerator.step}").wait()

Both are collective (every rank calls them, as ``Accelerator.save_state`` and ``load_state``). What
is saved is what ``Accelerator.save_state`` writes to a folder: every prepared model
(``get_model_state_dict``: DDP's ``module.`` prefix dropped, FSDP2 DTensor shards as they are), every
prepared optimizer (``get_optimizer_state_dict``, keyed by parameter name, so it loads at any world
size), every prepared scheduler, the gradient scaler, the objects given to
``register_for_checkpointing``, ``accelerator.step``, and each rank's RNG states (python, numpy,
torch, and CUDA when present) under ``rng.<rank>``.

Why wrappers and not Accelerate's hooks: ``register_save_state_pre_hook`` only sees the models'
weights; optimizers, schedulers and RNG states still go to ``output_dir`` through ``torch.save``. These
two functions read the same registered objects (``accelerator._models``, ``_optimizers``,
``_schedulers``, ``_custom_objects``, ``scaler``, ``step``) as ``save_state`` does.

At another world size, rank ``r`` restores the RNG states rank ``r`` saved; a rank the saving job did
not have keeps its own, as Accelerate does for a missing ``random_states_<r>.pkl``
(``LoadedState.restored_rng`` says which). Optimizer ``i`` is taken to belong to model ``i`` (or to the only
model), as Accelerate's FSDP path takes it. Dataloader and sampler positions are not saved.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from ckptd_schemas import InvalidRequest, StateDictMismatch

from .._dist import rank_and_world
from .._load import LoadReport
from .._save import SaveHandle
from ..client import CheckpointClient

__all__ = ["LoadedState", "load_state", "save_state", "state_of"]

RNG = "rng"


@dataclass
class LoadedState:
    """What ``load_state`` restored: the client's report, the step, and whether this rank's RNG
    states were in the checkpoint (a rank the saving job did not have keeps its own)."""

    report: LoadReport
    step: int
    restored_rng: bool


def _name(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch one


def _owner(models: list, i: int, what: str) -> torch.nn.Module:
    if len(models) == 1:
        return models[0]
    if i < len(models):
        return models[i]
    raise InvalidRequest(f"{what}: optimizer {i} has no model {i} among the accelerator's {len(models)} "
                         f"prepared models", key=_name("optimizer", i))


def state_of(accelerator: Any, *, what: str = "state") -> dict:
    """The state dict ``save_state`` saves (and ``load_state`` fills): see the module's docstring."""
    models = list(accelerator._models)
    sd: dict = {"step": int(accelerator.step)}
    for i, model in enumerate(models):
        sd[_name("model", i)] = get_model_state_dict(model)
    for i, opt in enumerate(accelerator._optimizers):
        sd[_name("optimizer", i)] = get_optimizer_state_dict(_owner(models, i, what), _inner(opt))
    for i, sched in enumerate(accelerator._schedulers):
        sd[_name("scheduler", i)] = sched.state_dict()
    if getattr(accelerator, "scaler", None) is not None:
        sd["scaler"] = accelerator.scaler.state_dict()
    for i, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
        sd[f"custom_{i}"] = obj.state_dict()
    rng: dict = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    sd[RNG] = {str(rank_and_world()[0]): rng}
    return sd


def save_state(accelerator: Any, client: CheckpointClient, ref: str, *, step: int | None = None) -> SaveHandle:
    """Save the accelerator's state to ``ref`` (collective); returns the save's handle (``.wait()``
    for the commit). ``step`` defaults to ``accelerator.step`` (a NAME of digits gives its own)."""
    sd = state_of(accelerator, what=ref)
    if step is None and not ref.rsplit("/", 1)[-1].isdigit():
        step = sd["step"]
    return client.save(sd, ref, step=step)


def load_state(accelerator: Any, client: CheckpointClient, ref: str) -> LoadedState:
    """Restore the accelerator's state from ``ref`` (``RUN/latest`` allowed) at any world size
    (collective). Every key but the RNG states must be in the checkpoint and the checkpoint must hold
    nothing else (``StateDictMismatch`` naming them). Sets ``accelerator.step``."""
    sd = state_of(accelerator, what=ref)
    rank, _ = rank_and_world()
    own = f"{RNG}.{rank}."
    report = client.load(sd, ref, strict=False)  # other ranks' RNG states are not this rank's to load
    missing = [k for k in report.missing if not k.startswith(own)]
    unexpected = [k for k in report.unexpected if not k.startswith(f"{RNG}.")]
    if missing or unexpected:
        raise StateDictMismatch(f"accelerator state and checkpoint {report.ref} differ: missing from the checkpoint "
                                f"{missing[:8]}, not in the accelerator's state {unexpected[:8]}", ref=report.ref,
                                missing=missing[:64], unexpected=unexpected[:64])
    models = list(accelerator._models)
    for i, model in enumerate(models):
        set_model_state_dict(model, sd[_name("model", i)])
    for i, opt in enumerate(accelerator._optimizers):
        set_optimizer_state_dict(_owner(models, i, ref), _inner(opt), sd[_name("optimizer", i)])
    for i, sched in enumerate(accelerator._schedulers):
        sched.load_state_dict(sd[_name("scheduler", i)])
    if "scaler" in sd:
        accelerator.scaler.load_state_dict(sd["scaler"])
    for i, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
        obj.load_state_dict(sd[f"custom_{i}"])
    accelerator.step = int(sd["step"])
    rng = sd[RNG][str(rank)]
    restored = not any(k.startswith(own) for k in report.missing)
    if restored:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return LoadedState(report, accelerator.step, restored)
