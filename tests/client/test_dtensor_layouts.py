"""DTensor placements other than FSDP2's Shard(0): Shard(1) (TP rows), Replicate, 2-D meshes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ckptd_client import CheckpointClient
from support import run_ranks

pytestmark = pytest.mark.slow


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(10, 7, generator=g), "b": torch.randn(5, 9, generator=g).bfloat16(),
            "c": torch.randn(13, generator=g)}


def save_job(rank: int, world: int, url: str, mesh_shape: tuple) -> dict:
    names = ("dp", "tp") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    gl = _globals()
    if len(mesh_shape) == 2:
        place = {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(1)], "c": [Shard(0), Replicate()]}
    else:
        place = {"a": [Shard(1)], "b": [Replicate()], "c": [Shard(0)]}
    sd = {k: distribute_tensor(v, mesh, place[k]) for k, v in gl.items()}
    client = CheckpointClient(url)
    client.save(sd, f"dt/{world}").wait()
    m = client.manifest(f"dt/{world}")
    client.close()
    return {"mesh": m.topology.mesh, "chunks": {t.name: len(t.chunks) for t in m.tensors}}


def load_job(rank: int, world: int, url: str, ref: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    gl = _globals()
    sd = {"a": distribute_tensor(torch.zeros_like(gl["a"]), mesh, [Shard(0)]),
          "b": distribute_tensor(torch.zeros_like(gl["b"]), mesh, [Shard(1)]),
          "c": distribute_tensor(torch.zeros_like(gl["c"]), mesh, [Replicate()])}
    client = CheckpointClient(url)
    client.load(sd, ref)
    client.close()
    return {k: v.full_tensor() for k, v in sd.items()}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_placements_round_trip_into_other_placements(server, tmp_path, mesh_shape):
    world = 1
    for s in mesh_shape:
        world *= s
    info = run_ranks(save_job, world, server.url, mesh_shape, tmp=tmp_path)[0]["result"]
    if len(mesh_shape) == 2:
        assert info["mesh"] == {"dp": 2, "tp": 2}
        assert info["chunks"] == {"a": 4, "b": 2, "c": 2}  # replicas written once
    else:
        assert info["chunks"] == {"a": 2, "b": 1, "c": 2}
    got = run_ranks(load_job, 3, server.url, f"dt/{world}", tmp=tmp_path)[0]["result"]
    for k, v in _globals().items():
        assert torch.equal(got[k], v), k
