"""The two assembly engines (numpy on the host, torch on a device) agree bit for bit, on every dtype and
codec a trainer saves; the host engine refuses a region outside its buffer; the CPU admin commands run
without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from ckptd.reshard.digest import tensor_digest
from ckptd.reshard.executor import plan_engine, run_plan
from ckptd.reshard.planner import outline_reshard
from ckptd.reshard.spec import parse_spec
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from ckptd_schemas.format.engines import HostEngine, TorchEngine, iter_slabs, pick_engine
from stored_tensors import read_tensor, write_tensors
from ckptd_client import CheckpointClient
from ckptd_schemas import Copy, IntegrityError, InvalidRequest

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float64, torch.complex64,
          torch.float8_e4m3fn]
ENGINES = {"host": HostEngine, "torch-cpu": lambda: TorchEngine("cpu")}


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.complex64:
        return torch.randn(shape, generator=g, dtype=torch.complex64)
    return (torch.randn(shape, generator=g) * 50).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved through a real service with zstd frames, beside a raw copy, every dtype."""
    from tests.support import ServerProcess

    root = tmp_path_factory.mktemp("engines") / "root"
    srv = ServerProcess(root).start()
    tensors = {f"model.{str(d).split('.')[1]}": _tensor(d, (37, 23), i) for i, d in enumerate(DTYPES)}
    tensors["model.vec"] = _tensor(torch.float32, (301,), 99)
    try:
        for codec in (None, "zstd"):
            c = CheckpointClient(srv.url, compression=codec)
            c.save(tensors, f"eng/{codec or 'raw'}", step=1).wait()
            c.close()
    finally:
        srv.stop()
    storage = LocalStorage(root, durable=False)
    return tensors, CheckpointReader(storage), SessionStore(storage)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("spec", ["tp=2", "fsdp2:dp=3", "zero3:dp=2,align=16"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engines_reshard_every_dtype_and_codec_bit_for_bit(saved, codec, spec, engine):
    tensors, reader, sessions = saved
    plan = outline_reshard(reader.manifest("eng", codec), parse_spec(spec))
    out = f"eng/{uuid.uuid4().hex[:8]}"
    run_plan(reader, sessions, plan, out, uuid.uuid4().hex, engine=ENGINES[engine](), jobs=2)
    digests = {t.name: t.digest for t in reader.manifest("eng", out.split("/")[1]).tensors}
    for name, t in tensors.items():
        assert _bits(read_tensor(reader, out, name)) == _bits(t), name
        assert digests[name] is not None


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_slabs_and_digests_agree_across_engines(saved, codec):
    tensors, reader, _ = saved
    m = reader.manifest("eng", codec)
    read = lambda f, a, b: reader.read_range("eng", codec, f, a, b)
    for t in m.tensors:
        slabs = {}
        for name, make in ENGINES.items():
            buf = make().buffer(64)
            slabs[name] = b"".join(bytes(raw) for _, raw in iter_slabs(m, t, read, slab_elems=50, buffer=buf))
        assert slabs["host"] == slabs["torch-cpu"] == _bits(tensors[t.name]), t.name
    # a cast digest needs torch; the plain one is the host's and matches the stored bytes' walk
    t = m.tensor("model.float32")
    assert tensor_digest(m, t, read) != tensor_digest(m, t, read, cast="bfloat16")


def test_the_host_engine_refuses_a_region_outside_its_buffer():
    buf = HostEngine().buffer(64)
    buf.begin("float32", 4, [2, 2], sizes=[2, 2], offsets=[0, 0])
    src = np.arange(4, dtype=np.float32).tobytes()
    ok = Copy(request=0, tensor="w", dtype="float32", fetch=0, codec="raw", byte_start=0, byte_length=16, pos0=0,
              npos=4, strides=[2, 1], base=0, chunk_xxh3="0", regions=[[[0, 0], [2, 2]]])
    buf.copy(memoryview(src), ok)
    assert bytes(buf.result("float32")) == src
    bad = ok.model_copy(update={"regions": [[[0, 0], [3, 2]]]})  # one row more than the source holds
    with pytest.raises(IntegrityError, match="tensor 'w' source.*outside"):
        buf.copy(memoryview(src), bad)
    with pytest.raises(InvalidRequest, match="does not cast"):
        buf.result("bfloat16")


def test_pick_engine():
    assert isinstance(pick_engine("cpu"), HostEngine)
    assert isinstance(pick_engine("cpu", casts=True), TorchEngine)
    if not torch.cuda.is_available():
        assert isinstance(pick_engine("auto"), HostEngine)
        with pytest.raises(InvalidRequest, match="no CUDA device"):
            pick_engine("cuda")
    with pytest.raises(InvalidRequest, match="auto, cpu or cuda"):
        pick_engine("tpu")


_NO_TORCH = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked: this command must not need torch")
sys.meta_path.insert(0, _Block())
from ckptd.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _ckptd_without_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, timeout=120)


def test_cpu_reshard_and_verify_run_without_importing_torch(tmp_path):
    storage = LocalStorage(tmp_path)
    g = torch.Generator().manual_seed(0)
    write_tensors(SessionStore(storage), "nt/1", {"model.w": torch.randn(33, 17, generator=g),
                                                   "model.b": torch.randn(5, 9, generator=g).bfloat16()}, step=1)
    out = _ckptd_without_torch("reshard", "nt/1", "--to", "tp=2", "--json", "--root", str(tmp_path))
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout)["ref"]
    assert _ckptd_without_torch("verify", ref, "--root", str(tmp_path)).returncode == 0
    reader = CheckpointReader(storage)
    assert torch.equal(read_tensor(reader, ref, "model.w"), read_tensor(reader, "nt/1", "model.w"))
    # a cast needs torch: with torch blocked the command fails instead of writing anything
    cast = _ckptd_without_torch("reshard", "nt/1", "--to", "full", "--dtype", "bfloat16", "--root", str(tmp_path))
    assert cast.returncode != 0 and "blocked" in cast.stderr
    assert sorted(storage.list("runs/nt")) == sorted(["1", ref.split("/")[1]])
    assert isinstance(plan_engine(outline_reshard(reader.manifest("nt", "1"), parse_spec("full")), "cpu"), HostEngine)
    # export to safetensors (no cast) and its read-back check: no torch either
    out = _ckptd_without_torch("export", ref, str(tmp_path / "st"), "--root", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    got = load_file(tmp_path / "st" / json.loads(out.stdout)["files"][0])
    assert torch.equal(got["w"], read_tensor(reader, "nt/1", "model.w"))  # the model's weights: model. stripped
    assert torch.equal(got["b"], read_tensor(reader, "nt/1", "model.b"))
