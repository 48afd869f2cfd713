"""``--device auto``: one rule (``executor.choose_device``) picks the reshard engine, and the command says
which engine ran and why. The rule's table, the bytes a plan casts, and the line through real
``ckptd reshard --root`` runs on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from ckptd_schemas import InvalidRequest

from ckptd.reshard.executor import GPU_CAST_MIN_BYTES, cast_bytes, choose_device, plan_device
from ckptd.reshard.planner import outline_reshard
from ckptd.reshard.spec import parse_spec
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from stored_tensors import write_tensors

T = GPU_CAST_MIN_BYTES


def _no_probe() -> bool:
    raise AssertionError("the GPU was probed where the rule needs no GPU (probing may import torch)")


@pytest.mark.parametrize("requested, cast, gpu, device, reason", [
    ("auto", 0, True, "cpu", "auto: no dtype cast, the GPU buys nothing"),
    ("auto", 0, False, "cpu", "auto: no dtype cast, the GPU buys nothing"),
    ("auto", 1, True, "cpu", "under the 4 GiB at which the GPU pays for its start-up"),
    ("auto", T - 1, True, "cpu", "under the 4 GiB"),
    ("auto", T, False, "cpu", "4.00 GiB to cast, but no CUDA device"),
    ("auto", T, True, "cuda", "auto: 4.00 GiB to cast, at least the 4 GiB at which the GPU pays for its start-up"),
    ("auto", 10 * T, True, "cuda", "40.00 GiB to cast"),
    ("cpu", 10 * T, True, "cpu", "--device cpu"),
    ("cpu", 0, True, "cpu", "--device cpu"),
    ("cuda", 0, True, "cuda", "--device cuda"),  # asked for: taken (refused later without a GPU)
    ("cuda", 0, False, "cuda", "--device cuda"),
])
def test_choose_device_table(requested, cast, gpu, device, reason):
    probe = (lambda: gpu) if requested == "auto" and cast >= T else _no_probe
    got = choose_device(requested, cast, probe)
    assert got.device == device and reason in got.reason and got.cast_bytes == cast, got


def test_choose_device_refuses_unknown_devices():
    with pytest.raises(InvalidRequest, match="auto, cpu or cuda"):
        choose_device("tpu", 0, _no_probe)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"model.w": torch.randn(33, 17, generator=g), "model.b": torch.randn(5, 9, generator=g).bfloat16(),
            "optim.state.w.exp_avg": torch.randn(33, 17, generator=g), "optim.state.w.step": torch.tensor(3)}


def test_cast_bytes_counts_the_source_bytes_converted(tmp_path):
    storage = LocalStorage(tmp_path, durable=False)
    write_tensors(SessionStore(storage), "dc/1", _state(), step=1)
    m = CheckpointReader(storage).manifest("dc", "1")
    fp32 = 2 * 33 * 17 * 4  # the fp32 tensors; bf16 stays, the int step is not floating
    for spec in ("full", "fsdp2:dp=4", "tp=2"):
        assert cast_bytes(outline_reshard(m, parse_spec(spec))) == 0
        assert cast_bytes(outline_reshard(m, parse_spec(spec), dtype="bfloat16")) == fp32
    assert cast_bytes(outline_reshard(m, parse_spec("full"), dtype="float32")) == 5 * 9 * 2  # only the bf16 one
    choice = plan_device(outline_reshard(m, parse_spec("full"), dtype="bfloat16"), "auto")
    assert choice.device == "cpu" and "under the 4 GiB" in choice.reason  # a few kB never pays for the GPU


def _ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_cli_reshard_names_the_engine_and_why(tmp_path):
    storage = LocalStorage(tmp_path)
    write_tensors(SessionStore(storage), "dc/2", _state(), step=2)
    root = ["--root", str(tmp_path)]
    out = _ckptd("reshard", "dc/2", "--to", "fsdp2:dp=4", *root)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first == "engine: cpu (auto: no dtype cast, the GPU buys nothing; numpy)", out.stdout
    assert "committed dc/2-fsdp2-dp4" in out.stdout
    out = _ckptd("reshard", "dc/2", "--to", "fsdp2:dp=4", "--dtype", "bfloat16", "--json", *root)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)  # --json: one document, the engine inside it
    assert res["engine"]["device"] == "cpu" and res["engine"]["impl"] == "torch-cpu"
    assert "to cast, under the 4 GiB" in res["engine"]["reason"]
    out = _ckptd("reshard", "dc/2", "--to", "full", "--device", "cpu", "--out", "dc/2-cpu", *root)
    assert out.returncode == 0 and out.stdout.startswith("engine: cpu (--device cpu; numpy)\n"), out.stdout
    if not torch.cuda.is_available():
        out = _ckptd("reshard", "dc/2", "--to", "full", "--device", "cuda", "--out", "dc/2-gpu", *root)
        assert out.returncode != 0 and "no CUDA device" in out.stderr
        assert CheckpointReader(storage).marker("dc", "2-gpu") is None  # refused before any write
