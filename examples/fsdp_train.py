"""Train a small FSDP2 model on CPU ranks, save it through ckptd, load it at any world size.

    ckptd serve &                                                   # in another terminal
    torchrun --nproc-per-node 2 examples/fsdp_train.py --save demo/20
    torchrun --nproc-per-node 3 examples/fsdp_train.py --load demo/latest

The second job has a different world size (3 ranks, uneven shards): each rank
fetches only the byte ranges its shards cover, and training resumes with the
saved weights, Adam moments and learning rate.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptd_client import CheckpointClient


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", help="checkpoint ref to save after training, e.g. demo/20")
    ap.add_argument("--load", help="checkpoint ref to resume from, e.g. demo/latest")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--url", default=os.environ.get("CKPTD_URL", "http://127.0.0.1:8470"))
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 101), torch.nn.GELU(), torch.nn.Linear(101, 13))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    client = CheckpointClient(args.url)

    start = 0
    if args.load:
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": 0}
        report = client.load(sd, args.load)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        start = sd["step"]
        if rank == 0:
            print(f"loaded {report.ref} at world size {world}: {len(report.tensors)} tensors, "
                  f"{report.bytes_read} bytes read by rank 0, resuming at step {start}")

    g = torch.Generator().manual_seed(rank)
    for step in range(start, start + args.steps):
        x = torch.randn(16, 37, generator=g)
        loss = (model(x) - x[:, :13]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    if args.save:
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
              "step": start + args.steps}
        handle = client.save(sd, args.save)   # returns once this rank's shards are snapshotted
        handle.wait()                          # committed on the service, or raises why not
        if rank == 0:
            print(f"saved {args.save} from {world} ranks")
    client.close()
    dist.barrier()  # every rank done with gloo before any tears it down (else a gloo thread can abort at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
