"""Every state dict shape that ``torch.distributed.checkpoint`` saves, ``CheckpointClient.save`` saves.

One save on 4 real gloo ranks writes one state dict holding every case below, through ckptd and,
for comparison, through DCP's own ``FileSystemWriter``. The same 4 ranks load it back at once; 3
ranks and 1 rank load it at other world sizes, each rank comparing every leaf bit for bit with
the value it was built from, and reading the DCP copy too: every key DCP restores, ckptd restores.

- dtypes: every whole-byte dtype torch has (floats, float8 variants, float4x2, signed and unsigned
  ints, bool, complex), 0-dim and 0-element tensors, transposed and strided views, a tensor that
  requires grad, keys whose tensors are views of one buffer;
- structures: nested dicts, lists and tuples, ``get_optimizer_state_dict`` flattened and nested (with
  ``param_groups``), an ``LRScheduler.state_dict()``, None, ints, floats, str, bytes,
  ``torch.get_rng_state()``, and per-rank RNG states (python, numpy) that differ between ranks
  under one key: each rank gets its own back at the same world size, and at a smaller one;
- DTensors: Shard(0) uneven, Shard(1), Replicate on a 1-D mesh of 4; (Shard, Shard), (Shard,
  Replicate), (Replicate, Shard) on a 2-D (dp=2, tp=2) mesh; layers on the dp sub-mesh of a
  (pp=2, dp=2) mesh, each stage its own keys, loaded with all layers at dp=1, dp=3 and on each
  stage's dp=2 sub-mesh;
- plain tensors only some ranks hold, and one held by two ranks.

What no checkpoint can hold (sparse, nested, quantized, meta, sub-byte dtypes) is refused by
``save`` with ``InvalidRequest`` naming the key, on every rank, before anything is uploaded.
"""

from __future__ import annotations

import random
import time
import zlib

import numpy as np
import torch

from support import run_ranks

LR = 0.01
SAVE_WORLD = 4

# Every whole-byte dtype: the name, and how to make random bits of it.
DTYPES = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "int8", "int16", "int32", "int64", "uint8",
          "uint16", "uint32", "uint64", "bool", "complex32", "complex64", "complex128"]
DTYPES = [d for d in DTYPES if hasattr(torch, d)]


def _bits(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN and Inf patterns included for floats)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool().reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _g(shape: tuple, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# DTensors on the full mesh: name -> (global shape, dtype, placements on the 1-D mesh of 4, on the 2-D mesh)
DT1 = {"dt1.shard0_uneven": ((10, 3), torch.float32, "S0"), "dt1.shard1": ((5, 7), torch.bfloat16, "S1"),
       "dt1.replicate": ((6,), torch.float64, "R"), "dt1.tiny": ((2, 3), torch.float16, "S0")}
DT2 = {"dt2.s0s1": ((9, 7), torch.float32, ("S0", "S1")), "dt2.s0r": ((5, 4), torch.bfloat16, ("S0", "R")),
       "dt2.rs0": ((7, 2), torch.float32, ("R", "S0")), "dt2.s0s0": ((11, 3), torch.float32, ("S0", "S0"))}
PP_LAYERS = 4  # layer i: weight (5 + i, 4) and bias (5 + i,), stage i // 2, on its stage's dp sub-mesh


def _placement(code: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


def _dtensor(full: torch.Tensor, mesh, codes) -> object:
    """The DTensor of ``full`` on ``mesh`` with ``codes`` placements, built from this rank's piece alone."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = [_placement(c) for c in codes]
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=LR if seed == 0 else 0.5, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return m, opt, sched


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    m, opt, sched = _model(0)
    for step in range(3):
        m(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return m, opt, sched


def _rng_states(rank: int) -> dict:
    """Per-rank RNG state as trainers keep it: python's and numpy's generators, seeded by rank."""
    return {"python": random.Random(1000 + rank).getstate(),
            "numpy": np.random.RandomState(1000 + rank).get_state()}


def plain_cases(rank: int) -> dict:
    """Plain (replicated) tensors and objects: the same on every rank except ``per_rank``."""
    torch.manual_seed(7)
    torch.rand(5)  # the global generator a few draws in: the same state on every rank, at every build
    buf = torch.arange(24, dtype=torch.float32)
    grid = _g((6, 8), 5)
    cases = {
        "dtypes": {d: _bits(getattr(torch, d), (3, 4), i) for i, d in enumerate(DTYPES)},
        "zero_dim": {d: _bits(getattr(torch, d), (), 50 + i) for i, d in enumerate(DTYPES)},
        "empty": {"e0": torch.empty(0), "e04": torch.empty(0, 4, dtype=torch.bfloat16),
                  "e30": torch.empty(3, 0, dtype=torch.int64)},
        "views": {"transposed": grid.t(), "strided": grid[::2, 1::3], "expanded": torch.arange(3.).expand(4, 3),
                  "narrow_col": grid[:, 5]},
        "grad": torch.randn(3, 3, generator=torch.Generator().manual_seed(9)).requires_grad_(),
        "shared": {"head": buf[:10], "tail": buf[10:].view(2, 7), "all": buf},
        "nested": {"a": {"b": {"c": _g((2,), 11)}}, "list": [_g((3,), 12), {"x": _g((1,), 13)}, [_g((2, 2), 14)]],
                   "tuple": (_g((2,), 15), 7, "t")},
        "objects": {"none": None, "int": 12345678901234, "float": 0.1, "nan": float("nan"), "str": "héllo",
                    "bytes": b"\x00\xffbytes", "list": [1, 2.5, "x", None], "tuple": (1, (2, 3)),
                    "dict": {"k": [1, {"j": 2}]}},
        "rng": {"torch": torch.get_rng_state(), "per_rank": _rng_states(rank)},
    }
    m, opt, sched = _trained()
    cases["model"] = dict(m.state_dict())
    cases["sched"] = sched.state_dict()
    return cases


def _train_state(flat: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    m, opt, _ = _trained()
    return get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))


def build(rank: int, world: int, meshes: dict | None) -> dict:
    """The state dict rank ``rank`` of ``world`` saves (``meshes``: None to leave out the DTensors)."""
    sd = plain_cases(rank)
    sd["optim_flat"] = _train_state(True)
    sd["optim_nested"] = _train_state(False)
    sd["step"] = torch.tensor(3)
    # plain tensors that only some ranks hold; one held by ranks 0 and 2
    if rank % 2:
        sd["odd_only"] = _g((4, 2), 20)
    if rank in (0, 2):
        sd["pair"] = {"t": _g((3,), 21, torch.int64)}
    sd[f"own{rank}"] = _g((2,), 30 + rank)
    if meshes is not None:
        mesh1, mesh2, pp = meshes["1d"], meshes["2d"], meshes["pp"]
        for k, (shape, dt, code) in DT1.items():
            sd[k] = _dtensor(_g(shape, zlib.crc32(k.encode()) % 1000, dt), mesh1, [code])
        for k, (shape, dt, codes) in DT2.items():
            sd[k] = _dtensor(_g(shape, zlib.crc32(k.encode()) % 1000, dt), mesh2, codes)
        stage = pp.get_coordinate()[0]
        dp = pp["dp"]
        for i in range(PP_LAYERS):
            if i // 2 == stage:
                sd[f"pp.layers.{i}.weight"] = _dtensor(_g((5 + i, 4), 40 + i), dp, ["S0"])
                sd[f"pp.layers.{i}.bias"] = _dtensor(_g((5 + i,), 50 + i), dp, ["S0"])
                sd[f"pp.layers.{i}.step"] = torch.tensor(i)  # plain: held by the stage's 2 ranks
    return sd


def _meshes(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    return {"1d": init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            "pp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))}


def _flat(sd: dict) -> dict:
    """Every leaf as ckptd names it: tensors as full CPU tensors (DTensors gathered), objects as they are."""
    from torch.distributed.tensor import DTensor

    from ckptd_client._flatten import flatten

    out = {}
    for leaf in flatten(sd).leaves:
        v = leaf.value
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[leaf.fqn] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def _differences(got: dict, want: dict) -> list[str]:
    return sorted(k for k in want if k not in got or not _same(got[k], want[k]))


def _blank(sd: dict) -> dict:
    """The same structure with every tensor overwritten (in place, views kept) and every object cleared."""
    from torch.distributed.tensor import DTensor

    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _blank(v)
        elif isinstance(v, list):
            out[k] = [_blank({"x": x})["x"] for x in v]
        elif isinstance(v, DTensor):
            with torch.no_grad():
                v.to_local().zero_()
            out[k] = v
        elif isinstance(v, torch.Tensor):
            if v.numel() > 1 and 0 in v.stride():  # an expanded view cannot be written in place: a fresh tensor
                v = v.contiguous()
            with torch.no_grad():
                if v.is_contiguous():
                    v.reshape(-1).view(torch.uint8).fill_(0)
                else:
                    v.zero_()
            out[k] = v
        else:
            out[k] = None
    return out


def save_job(rank: int, world: int, url: str, dcp_dir: str) -> dict:
    """Save the whole matrix through ckptd and DCP; load it back at once at the same world size."""
    import torch.distributed.checkpoint as dcp

    from ckptd_client import CheckpointClient

    meshes = _meshes(world)
    want = _flat(build(rank, world, meshes))
    with CheckpointClient(url) as c:
        t0 = time.perf_counter()
        c.save(build(rank, world, meshes), "matrix/1").wait()
        save_s = time.perf_counter() - t0
        dcp.save(build(rank, world, meshes), checkpoint_id=dcp_dir)
        sd = _blank(build(rank, world, meshes))
        report = c.load(sd, "matrix/1")
        # every pipeline layer (and every other DTensor) on this stage's dp=2 sub-mesh
        sub, sub_want = _load_sd(rank, world, meshes["pp"]["dp"])
        sub = _blank(sub)
        c.load(sub, "matrix/1")
    return {"bad": _differences(_flat(sd), want), "sub_bad": _differences(_flat(sub), sub_want),
            "keys": sorted(want), "save_s": save_s, "coverage": report.coverage_ranks}


def _load_sd(rank: int, world: int, mesh) -> tuple[dict, dict]:
    """What a rank of ``world`` loads: the plain cases (its own per-rank RNG), every plain tensor on
    rank 0, and every DTensor (and all pipeline layers) re-sharded over ``mesh`` (None: whole tensors);
    and its expected values."""
    sd = plain_cases(rank)
    sd["optim_flat"] = _train_state(True)
    sd["optim_nested"] = _train_state(False)
    sd["step"] = torch.tensor(3)
    if rank == 0:
        sd["odd_only"] = _g((4, 2), 20)
        sd["pair"] = {"t": _g((3,), 21, torch.int64)}
        for r in range(SAVE_WORLD):
            sd[f"own{r}"] = _g((2,), 30 + r)
    for i in range(PP_LAYERS):
        sd[f"pp.layers.{i}.weight"] = _g((5 + i, 4), 40 + i)
        sd[f"pp.layers.{i}.bias"] = _g((5 + i,), 50 + i)
        if rank == 0:
            sd[f"pp.layers.{i}.step"] = torch.tensor(i)
    for k, (shape, dt, _) in {**DT1, **DT2}.items():
        sd[k] = _g(shape, zlib.crc32(k.encode()) % 1000, dt)
    if mesh is not None:  # shard every DTensor over the load's mesh: Shard(0) for most, Shard(1), Replicate
        for k in list(sd):
            if k.startswith(("dt1.", "dt2.", "pp.layers.")) and not k.endswith(".step"):
                code = "S1" if sd[k].ndim == 2 and k.endswith("s0s1") else "R" if k == "dt2.rs0" else "S0"
                sd[k] = _dtensor(sd[k], mesh, [code])
    return sd, _flat(sd)


def load_job(rank: int, world: int, url: str, dcp_dir: str) -> dict:
    """Load at ``world`` through ckptd and through DCP (its own FileSystemReader); compare both."""
    import torch.distributed.checkpoint as dcp

    from ckptd_client import CheckpointClient

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sd, want = _load_sd(rank, world, mesh)
    sd = _blank(sd)
    with CheckpointClient(url) as c:
        report = c.load(sd, "matrix/1")
    dsd = _blank(_load_sd(rank, world, mesh)[0])
    try:
        dcp.load(dsd, checkpoint_id=dcp_dir)
        dcp_bad = _differences(_flat(dsd), want)
    except Exception as e:  # noqa: BLE001 - recorded: what DCP cannot load, ckptd still must
        dcp_bad = [f"dcp.load raised {type(e).__name__}: {e}"]
    return {"bad": _differences(_flat(sd), want), "dcp_bad": dcp_bad, "keys": sorted(want),
            "coverage": report.coverage_ranks}


def test_the_matrix_saves_and_loads_bit_for_bit_at_4_3_and_1_ranks(server, tmp_path):
    from ckptd_client import CheckpointClient

    dcp_dir = str(tmp_path / "dcp")
    saved = [r["result"] for r in run_ranks(save_job, SAVE_WORLD, server.url, dcp_dir, tmp=tmp_path)]
    for r, rec in enumerate(saved):
        assert rec["bad"] == [], f"rank {r} of {SAVE_WORLD}: {rec['bad']}"
        assert rec["sub_bad"] == [], f"rank {r} of {SAVE_WORLD}, dp=2 sub-mesh: {rec['sub_bad']}"
        assert rec["coverage"] == SAVE_WORLD
    with CheckpointClient(server.url) as c:
        m = c.manifest("matrix/1")
    names = {t.name for t in m.tensors}
    assert {f"dtypes.{d}" for d in DTYPES} <= names and f"zero_dim.{DTYPES[0]}" in names
    per_rank = [o for o in m.objects if o.name.startswith("rng.per_rank.")]
    assert per_rank and all(o.rank is not None for o in per_rank)  # each rank's own, not one of them
    assert [ch.rank for ch in m.tensor("pair.t").chunks][0] in (0, 2)
    assert [ch.rank for ch in m.tensor("odd_only").chunks][0] in (1, 3)

    loaded = [r["result"] for r in run_ranks(load_job, 3, server.url, dcp_dir, tmp=tmp_path)]
    for r, rec in enumerate(loaded):
        assert rec["bad"] == [], f"rank {r} of 3: {rec['bad']}"
        assert rec["coverage"] == 3
        # every key DCP restores, ckptd restores (here: all of them; DCP's misses are only informative)
        assert set(rec["bad"]) <= set(rec["dcp_bad"])

    # one rank, no process group: whole tensors, rank 0's per-rank objects
    sd, want = _load_sd(0, 1, None)
    sd = _blank(sd)
    with CheckpointClient(server.url) as c:
        report = c.load(sd, "matrix/1")
    assert _differences(_flat(sd), want) == []
    assert report.coverage_ranks == 1
