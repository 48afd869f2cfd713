"""``ckptd import dcp`` and ``ckptd export``: DCP directories written by PyTorch's own
FileSystemWriter (FSDP2 on 2 gloo ranks, and one process with odd dtypes and nesting) are
imported, verified, resharded and exported; exports equal ``dcp_to_torch_save`` and
``safetensors.torch.load_file`` bit for bit; damaged directories are refused, naming the
file, with nothing committed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckptd.cli.root_backend import RootBackend
from ckptd.interop.dcp_import import DcpImportError, import_dcp, inspect_dcp
from ckptd.interop.export import INDEX_FILE, check_safetensors, export_safetensors, export_torch, parse_size
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from stored_tensors import read_tensor, write_tensors
from ckptd_client import CheckpointClient
from ckptd_client.dcp import DCP_METADATA
from ckptd_schemas import IntegrityError
from support import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def assert_same(got, want, where: str = "sd") -> None:
    """Same nesting, keys (in order), types and values; tensors bit for bit."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}.{i}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{list(got.shape)}"
        assert torch.equal(got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), \
            f"{where} differs bitwise"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def fsdp_dcp_job(rank: int, world: int, out: str) -> dict:
    """FSDP2 on gloo ranks, saved with PyTorch's own FileSystemWriter."""
    from fsdp_job import build, full_tensors, state, train_step

    model, opt = build(world, seed=5)
    for step in range(2):
        train_step(model, opt, step, rank, world)
    sd = {**state(model, opt), "extra": {"epoch": 2, "names": ("a", "b")}, "counts": torch.arange(9)}
    dcp.save(sd, storage_writer=FileSystemWriter(out))
    return full_tensors(state(model, opt))


def small_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"embed.weight": torch.randn(33, 8, generator=g), "norm.weight": torch.randn(8, generator=g).bfloat16(),
                  "head.weight": torch.randn(5, 8, generator=g).half(), "mask": torch.rand(4, 4, generator=g) > 0.5,
                  "scale": torch.tensor(1.5, dtype=torch.float64), "empty": torch.empty(0, 3), "ids": torch.arange(6)},
        "buffers": [torch.ones(2), torch.full((3,), 2.0)],   # a list of tensors: walked, restored as a list
        "optim": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["embed.weight"]}]},
        "step": 11,
    }


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dcp")
    full = run_ranks(fsdp_dcp_job, 2, str(base / "fsdp"), tmp=base)[0]["result"]
    dcp.save(small_state(), storage_writer=FileSystemWriter(str(base / "small")), no_dist=True)
    for name in ("fsdp", "small"):
        dcp_to_torch_save(base / name, base / f"{name}.pt")  # PyTorch's own conversion: the reference
    return base, full


def _ref(base: Path, name: str) -> dict:
    return torch.load(base / f"{name}.pt", weights_only=False)


def test_import_verify_reshard_export_fsdp_dir(dirs, tmp_path):
    base, full = dirs
    assert len(list((base / "fsdp").glob("*.distcp"))) == 2
    root = str(tmp_path / "root")
    out = ckptd("import", "dcp", str(base / "fsdp"), "fsdp/2", "--root", root, "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["ref"] == "fsdp/2" and res["tensors"] == len(full) + 1 and res["objects"] >= 3
    assert out.stderr == ""  # quiet with --json (and no terminal)
    assert ckptd("verify", "fsdp/2", "--root", root).returncode == 0

    reader = CheckpointReader(LocalStorage(root))
    m = reader.manifest("fsdp", "2")
    assert m.step == 2 and any(o.name == DCP_METADATA for o in m.objects)
    w = m.tensor("model.l1.weight")
    assert w is not None and len(w.chunks) == 2  # FSDP2's two shards, kept as they were written
    for name, t in full.items():
        assert torch.equal(read_tensor(reader, "fsdp/2", name), t), name

    out = ckptd("reshard", "fsdp/2", "--to", "fsdp2:dp=3", "--root", root, "--json")
    assert out.returncode == 0, out.stderr
    resharded = json.loads(out.stdout)["ref"]
    assert ckptd("verify", resharded, "--root", root).returncode == 0

    want = _ref(base, "fsdp")
    for ref in ("fsdp/2", resharded):  # exports do not depend on the layout
        pt = tmp_path / f"{ref.replace('/', '_')}.pt"
        out = ckptd("export", ref, "--format", "torch", str(pt), "--root", root, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["nested"] is True
        assert_same(torch.load(pt, weights_only=False), want)

        st_dir = tmp_path / f"st-{ref.replace('/', '_')}"
        out = ckptd("export", ref, "--format", "safetensors", str(st_dir), "--prefix", "model.",
                    "--max-shard-size", "1500", "--root", root)
        assert out.returncode == 0, out.stderr
        assert "every tensor's digest matches the source" in out.stdout
        _check_hf_dir(st_dir, want["model"])


def _check_hf_dir(st_dir: Path, want: dict) -> None:
    from safetensors.torch import load_file

    index = json.loads((st_dir / INDEX_FILE).read_text())
    shards = sorted(p.name for p in st_dir.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    got = {}
    for s in shards:
        part = load_file(st_dir / s)
        assert all(index["weight_map"][k] == s for k in part)
        got.update(part)
    assert set(got) == set(want)
    for k, t in want.items():
        assert_same(got[k], t, k)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())


def test_import_small_dir_through_the_service_and_read_it_with_dcp(dirs, server, tmp_path):
    base, _ = dirs
    out = ckptd("import", "dcp", str(base / "small"), "small/11", "--server", server.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("committed small/11 from DCP checkpoint")
    assert ckptd("verify", "small/11", "--server", server.url).returncode == 0

    client = CheckpointClient(server.url)
    reader = client.dcp_reader("small/latest")
    md = reader.read_metadata()  # DCP's own metadata, as FileSystemWriter wrote it
    original = _dcp_metadata(base / "small")
    assert md.planner_data == original.planner_data
    assert md.state_dict_metadata.keys() == original.state_dict_metadata.keys()

    sd = small_state()
    blank = _blank(sd)
    dcp.load(blank, storage_reader=client.dcp_reader("small/11"), no_dist=True)
    assert_same(blank, sd)

    flat = _blank(sd)  # CheckpointClient.load reads it too (DCP flattens keys as ckptd does)
    client.load(flat, "small/11")
    assert_same(flat, sd)

    pt = tmp_path / "small.pt"
    assert ckptd("export", "small/11", "--format", "torch", str(pt), "--server", server.url).returncode == 0
    assert_same(torch.load(pt, weights_only=False), _ref(base, "small"))

    # A cast reshard carries DCP's metadata along; dcp_reader reports the dtypes the data now has.
    out = ckptd("reshard", "small/11", "--to", "fsdp2:dp=2", "--dtype", "bfloat16", "--out", "small/bf16",
                "--root", server.root)
    assert out.returncode == 0, out.stderr
    md = client.dcp_reader("small/bf16").read_metadata()
    assert md.state_dict_metadata["model.embed.weight"].properties.dtype == torch.bfloat16
    assert md.state_dict_metadata["model.ids"].properties.dtype == torch.int64
    cast = _blank(sd)
    cast["model"]["embed.weight"] = cast["model"]["embed.weight"].bfloat16()
    dcp.load(cast, storage_reader=client.dcp_reader("small/bf16"), no_dist=True)
    assert torch.equal(cast["model"]["embed.weight"], sd["model"]["embed.weight"].bfloat16())
    assert_same(cast["model"]["ids"], sd["model"]["ids"])
    client.close()


def _dcp_metadata(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def _blank(sd):
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_blank(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def _nothing_committed(root: Path) -> None:
    reader = CheckpointReader(LocalStorage(root))
    assert all(r.checkpoints == 0 for r in reader.runs_page()[0])
    for sessions in root.glob("runs/*/*/sessions"):
        assert not any(sessions.iterdir()), f"session left behind in {sessions}"


def test_damaged_directories_are_refused_and_nothing_is_committed(dirs, tmp_path):
    base, _ = dirs
    root = tmp_path / "root"

    no_meta = tmp_path / "no-meta"
    shutil.copytree(base / "small", no_meta)
    (no_meta / ".metadata").unlink()
    out = ckptd("import", "dcp", str(no_meta), "bad/1", "--root", str(root))
    assert out.returncode == 1 and str(no_meta / ".metadata") in out.stderr, out

    truncated = tmp_path / "truncated"
    shutil.copytree(base / "fsdp", truncated)
    victim = sorted(truncated.glob("*.distcp"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    out = ckptd("import", "dcp", str(truncated), "bad/2", "--root", str(root))
    assert out.returncode == 1 and str(victim) in out.stderr and "truncated" in out.stderr, out
    with pytest.raises(DcpImportError) as e:
        inspect_dcp(truncated)
    assert e.value.details["files"] == [str(victim)]

    missing = tmp_path / "missing"
    shutil.copytree(base / "fsdp", missing)
    gone = sorted(missing.glob("*.distcp"))[0]
    gone.unlink()
    out = ckptd("import", "dcp", str(missing), "bad/3", "--root", str(root))
    assert out.returncode == 1 and str(gone) in out.stderr and "missing" in out.stderr, out

    not_a_dir = ckptd("import", "dcp", str(tmp_path / "nowhere"), "bad/4", "--root", str(root))
    assert not_a_dir.returncode == 1
    assert not (root / "runs").exists()  # each was refused before anything was written

    # Damage that only decoding finds (a mangled item): the half-written session is dropped, nothing commits.
    mangled = tmp_path / "mangled"
    shutil.copytree(base / "small", mangled)
    (victim,) = mangled.glob("*.distcp")
    raw = bytearray(victim.read_bytes())
    last = max((i for i in inspect_dcp(mangled).items if i.is_tensor), key=lambda i: i.offset)
    raw[last.offset:last.offset + last.length] = bytes(last.length)
    victim.write_bytes(bytes(raw))
    with pytest.raises(DcpImportError) as e:
        import_dcp(mangled, "bad/5", RootBackend(str(root), create=True).import_target())
    assert str(victim) in e.value.message and last.index.fqn in e.value.message
    _nothing_committed(root)
    assert ckptd("ls", "bad", "--root", str(root)).stdout == ""


def test_export_options_and_refusals(dirs, tmp_path):
    base, _ = dirs
    storage = LocalStorage(tmp_path / "root")
    import_dcp(base / "small", "small/11", RootBackend(str(tmp_path / "root"), create=True).import_target())
    reader = CheckpointReader(storage)
    m = reader.manifest("small", "11")

    def read(file: str, start: int, end: int) -> bytes:
        return reader.read_range("small", "11", file, start, end)

    want = _ref(base, "small")["model"]
    # Tiny slabs: every tensor is streamed (written and read back) in many pieces.
    res = export_safetensors(m, read, tmp_path / "slabs", prefix="model.", slab_bytes=24, max_shard_size=10**9)
    assert res.files == ["model-00001-of-00001.safetensors", INDEX_FILE]
    from safetensors.torch import load_file

    got = load_file(tmp_path / "slabs" / res.files[0])
    assert set(got) == set(want)
    for k, t in want.items():
        assert_same(got[k], t, k)
    # The read-back check compares what is on disk with what was assembled: one flipped byte is named.
    shard = tmp_path / "slabs" / res.files[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=rf"{res.files[0]}: tensor .* reads back with digest"):
        check_safetensors(tmp_path / "slabs", res.files[:1], res.digests)

    # A write that fails on the writer thread (disk full) fails the export and leaves nothing behind.
    from ckptd.storage import local

    calls = []
    real_write = local._LocalWriter.write

    def failing(self, data):
        calls.append(len(data))
        if len(calls) == 3:
            raise local.StorageFull("storage write failed: disk full", key="x")
        return real_write(self, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local._LocalWriter, "write", failing)
        with pytest.raises(local.StorageFull, match="disk full"):
            export_safetensors(m, read, tmp_path / "full", slab_bytes=24, max_shard_size=10**9)
    assert 3 <= len(calls) <= 4 and not any((tmp_path / "full").iterdir())  # one more may be in flight

    res = export_safetensors(m, read, tmp_path / "bf16", dtype="bfloat16", max_shard_size=parse_size("1KB"))
    got = {}
    for f in res.files[:-1]:
        got.update(load_file(tmp_path / "bf16" / f))
    assert got["model.embed.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.embed.weight"], want["embed.weight"].bfloat16())
    assert torch.equal(got["model.ids"], want["ids"]) and torch.equal(got["model.mask"], want["mask"])
    assert torch.equal(got["buffers.1"], torch.full((3,), 2.0).bfloat16())

    export_torch(m, read, tmp_path / "model.pt", prefix="model.", slab_bytes=16)
    assert_same(torch.load(tmp_path / "model.pt", weights_only=False), want)
    # The torch file is read back too: a tensor saved other than assembled is named, and nothing is left.
    from torch.distributed.checkpoint import _traverse

    real_set = _traverse.set_element

    def changed(root, path, value):
        real_set(root, path, value + 1 if isinstance(value, torch.Tensor) and value.is_floating_point() else value)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_traverse, "set_element", changed)
        with pytest.raises(IntegrityError, match=r"tampered.pt: tensor .* reads back with digest"):
            export_torch(m, read, tmp_path / "tampered.pt", prefix="model.")
    assert not list(tmp_path.glob("*tampered*"))

    # A checkpoint without DCP metadata exports with flat FQN keys.
    write_tensors(SessionStore(storage), "plain/1", {"model.w": torch.arange(6.0).view(2, 3)})
    pm = reader.manifest("plain", "1")
    res = export_torch(pm, lambda f, a, b: reader.read_range("plain", "1", f, a, b), tmp_path / "plain.pt")
    assert not res.nested
    assert_same(torch.load(tmp_path / "plain.pt", weights_only=False), {"model.w": torch.arange(6.0).view(2, 3)})

    root = str(tmp_path / "root")
    assert ckptd("export", "small/11", "--format", "safetensors", str(tmp_path / "slabs"), "--root", root
                 ).returncode == 2  # the directory already holds an export
    assert ckptd("export", "small/11", str(tmp_path / "x"), "--prefix", "nope.", "--root", root).returncode == 2
    assert ckptd("export", "small/11", str(tmp_path / "y"), "--max-shard-size", "5 parsecs", "--root", root
                 ).returncode == 2
    assert ckptd("export", "small/99", str(tmp_path / "z"), "--root", root).returncode == 1  # not there

    # A corrupt byte in the store: the export is refused (block digests), nothing is left behind.
    t = m.tensor("model.embed.weight")
    loc = t.chunks[0].location
    data_file = next((tmp_path / "root").glob(f"runs/small/11/sessions/*/files/{loc.file}"))
    raw = bytearray(data_file.read_bytes())
    raw[loc.offset + 5] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    out = ckptd("export", "small/11", str(tmp_path / "corrupt"), "--root", root)
    assert out.returncode == 1 and loc.file in out.stderr, out
    assert not any((tmp_path / "corrupt").glob("*"))


_SAMPLER = """
import sys, threading, time
from ckptd.cli import main as cli
import ckptd.interop.dcp_import, ckptd.interop.export, safetensors.torch  # before the baseline

def anon():  # resident anonymous memory (heap, not page cache or mapped files), bytes
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0

start, peak, done = anon(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
rc = cli.main(sys.argv[1:])
done.set()
print(max(peak[0], anon()) - start)
sys.exit(rc)
"""


def _heap_growth_of(args: list[str]) -> int:
    out = subprocess.run([sys.executable, "-c", _SAMPLER, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


def test_import_and_export_memory_stay_bounded(tmp_path):
    """12 items of 32 MiB: importing and exporting them grows the heap by a few items, not by the 384 MiB."""
    n, rows = 12, 8192
    dcp.save({"model": {f"layers.{i}.weight": torch.full((rows, 1024), float(i)) for i in range(n)}},
             storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    model = n * rows * 1024 * 4
    root = str(tmp_path / "root")
    growth = _heap_growth_of(["import", "dcp", str(tmp_path / "dcp"), "big/1", "--root", root, "--json"])
    assert growth < model // 2, f"import grew the heap by {growth >> 20} MiB for a {model >> 20} MiB model"
    growth = _heap_growth_of(["export", "big/1", str(tmp_path / "hf"), "--root", root, "--json",
                              "--max-shard-size", "100MB"])
    assert growth < model // 3, f"export grew the heap by {growth >> 20} MiB for a {model >> 20} MiB model"
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 6  # two 32 MiB tensors per 100 MB shard
