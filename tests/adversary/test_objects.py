"""Loading a checkpoint never runs code from it, whoever wrote it.

A real ``ckptd serve`` with tokens. The attacker holds a valid ``write:gpt*`` token and uses
nothing but the HTTP API (httpx): it opens a session, uploads a data file and sends an index
whose object is a payload that creates a marker file when unpickled without restriction (a
``pickle`` payload; ``torch.save`` data whose unpickling calls ``exec`` or ``os.system``,
alone or nested in plain containers, in the zip and the legacy format; raw pickle declared as
``torch``; pickle bytes inside a JSON object; DCP's stored metadata). The victim loads with a
default client (``CheckpointClient.load``, ``client.dcp_reader`` under ``dcp.load``, ``ckptd
export``): each raises ``UnsafeObject`` naming the key, the marker never appears, and the good
checkpoint committed first still loads bit for bit. Only ``trust_objects=True`` unpickles
(and warns).

Payloads that only use allowed globals: the attacker commits, over raw HTTP, ``torch.save`` data
whose ``data.pkl`` is written by hand. Every global it names is on the default allow-list (numpy's
``dtype``, ``ndarray``, ``multiarray._reconstruct`` and ``scalar``, ``_codecs.encode``), but the state
it gives a numpy dtype carries forged flags: an object dtype with its flags cleared makes an array, or
a ``multiarray.scalar``, whose raw bytes are read as object pointers during the load (a crash, or
worse, in the trainer); an integer dtype flagged as holding objects reads integers as pointers. A zip
whose records are deflated (``torch.save`` writes none) can inflate a few KB into gigabytes before
torch checks a record's size. Each is refused with ``UnsafeObject`` naming the key, in a fresh process
that must not crash, through ``CheckpointClient.load`` and ``ckptd export``; typical numpy state still
loads. The service itself never unpickles an object: verifying, previewing and resharding a
checkpoint whose object runs code when unpickled leave the payload unrun.

At save: an object that only an unrestricted unpickler can rebuild is refused with
``UnsafeObject`` naming its key, before anything is committed; a class the user allows
(``safe_globals=[...]`` or ``torch.serialization.add_safe_globals``) saves and loads. Typical
trainer state (numbers, strings, lists, dicts, optimizer and LR scheduler state, torch, numpy
and Python RNG state, ``OrderedDict``, numpy scalars, Lightning- and Accelerate-like dicts)
round-trips without any opt-in, stored as JSON where that is exact and as ``torch.save`` data
otherwise.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import random
import subprocess
import sys
import time
import uuid
import warnings
import zipfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from ckptd.service.auth import hash_token
from ckptd_client import CheckpointClient, CheckpointNotFound, UnsafeObject
from ckptd_schemas.format.objects import TrustedObjectWarning
from ckptd_schemas import BoxChunk, Location, ObjectEntry, RankIndex, TensorEntry
from ckptd_schemas.names import DCP_METADATA
from support import ServerProcess, assert_bits_equal, blank_like, make_state, scaled

WRITER, VICTIM = "attacker-write-token-0123456789", "victim-write-token-0123456789"
TOKENS = f"attacker sha256:{hash_token(WRITER)} write:gpt*\nvictim {VICTIM} write:gpt*\n"
GOOD = "gpt/1"
W = torch.arange(4, dtype=torch.float32)


# -- payloads: each creates its marker file when unpickled without restriction ---------------------------

class ExecOnLoad:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


class SystemOnLoad:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


class Opaque:
    """A plain user class: harmless, but not on any allow-list unless the user puts it there."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.n == self.n


def torch_bytes(value: Any, **kw: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf, **kw)
    return buf.getvalue()


PAYLOADS = {
    "pickle": lambda m: ("pickle", pickle.dumps(ExecOnLoad(m))),
    "torch-exec": lambda m: ("torch", torch_bytes(ExecOnLoad(m))),
    "torch-os-system": lambda m: ("torch", torch_bytes(SystemOnLoad(m))),
    "torch-nested-in-plain-dict": lambda m: ("torch", torch_bytes({"lr": 0.1, "hooks": [(1, ExecOnLoad(m))]})),
    "torch-legacy-format": lambda m: ("torch", torch_bytes(ExecOnLoad(m), _use_new_zipfile_serialization=False)),
    "raw-pickle-declared-torch": lambda m: ("torch", pickle.dumps(ExecOnLoad(m))),
}


# -- the attacker: raw HTTP with a valid write token -----------------------------------------------------

def plant(url: str, ref: str, objects: list[tuple[str, str, Any]], token: str = WRITER,
          step: int | None = None) -> None:
    """Commit ``ref`` holding tensor ``model.w`` and ``objects`` (name, encoding, bytes or JSON value)."""
    run, name = ref.split("/")
    base = f"{url}/v1/checkpoints/{run}/{name}"
    sid, fname = uuid.uuid4().hex, "r000000-0000.bin"
    data = bytearray(W.numpy().tobytes())
    entries = []
    for obj_name, encoding, payload in objects:
        if encoding == "json":
            entries.append(ObjectEntry(name=obj_name, encoding="json", value=payload))
            continue
        data += bytes((-len(data)) % 64)
        entries.append(ObjectEntry(name=obj_name, encoding=encoding, location=Location(
            file=fname, offset=len(data), length=len(payload), raw_length=len(payload),
            xxh3=xxhash.xxh3_64_hexdigest(payload))))
        data += payload
    tensor = TensorEntry(name="model.w", shape=[4], dtype="float32", group="model", chunks=[BoxChunk(
        rank=0, offsets=[0], sizes=[4], location=Location(file=fname, offset=0, length=16, raw_length=16,
                                                          xxh3=xxhash.xxh3_64_hexdigest(data[:16])))])
    index = RankIndex(rank=0, world_size=1, tensors=[tensor], objects=entries, files=[fname])
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(headers=auth, timeout=30) as h:
        h.post(f"{base}/sessions", json={"session": sid, "world_size": 1, "step": step}).raise_for_status()
        h.put(f"{base}/sessions/{sid}/files/{fname}", content=bytes(data),
              headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(bytes(data)),
                       "Content-Type": "application/octet-stream"}).raise_for_status()
        r = h.put(f"{base}/sessions/{sid}/ranks/0", content=index.model_dump_json(),
                  headers={"Content-Type": "application/json"})
        r.raise_for_status()
        assert r.json()["state"] == "committed", r.text


# -- fixtures --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("objects")
    (tmp / "tokens").write_text(TOKENS)
    s = ServerProcess(tmp / "root", env={"CKPTD_TOKENS_FILE": str(tmp / "tokens")}).start()
    good = make_state(1)
    with CheckpointClient(s.url, token=VICTIM, retry_seconds=10) as c:
        c.save(good, GOOD).wait()
    s.good = good
    yield s
    s.stop()


@pytest.fixture
def client(srv):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrustedObjectWarning)  # a default client never warns
        with CheckpointClient(srv.url, token=VICTIM, retry_seconds=10) as c:
            yield c


def fresh_ref() -> str:
    return f"gpt/{uuid.uuid4().int % 10**9 + 100}"


def good_still_loads(srv: ServerProcess, c: CheckpointClient) -> None:
    got = blank_like(srv.good)
    c.load(got, GOOD)
    assert_bits_equal(got, srv.good)


def target() -> dict:
    return {"model": {"w": torch.zeros(4)}, "extra": {"evil": None}}


# -- loads refuse what would run code -------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_load_refuses_an_object_that_would_run_code(srv, client, tmp_path, kind):
    marker = tmp_path / "marker"
    encoding, payload = PAYLOADS[kind](marker)
    ref = fresh_ref()
    plant(srv.url, ref, [("extra.evil", encoding, payload)])
    with pytest.raises(UnsafeObject) as e:
        client.load(target(), ref)
    assert e.value.details["key"] == "extra.evil" and e.value.details["ref"] == ref
    assert "'extra.evil'" in e.value.message and ref in e.value.message
    assert not marker.exists(), "the payload ran inside load"
    good_still_loads(srv, client)


def test_trust_objects_loads_it_and_warns(srv, tmp_path):
    marker = tmp_path / "marker"
    ref = fresh_ref()
    plant(srv.url, ref, [("extra.evil", "pickle", pickle.dumps({"lr": 0.5}))])
    plant(srv.url, ref + "0", [("extra.evil", "torch", torch_bytes(ExecOnLoad(marker)))])
    with pytest.warns(TrustedObjectWarning, match="trust_objects=True"):
        c = CheckpointClient(srv.url, token=VICTIM, retry_seconds=10, trust_objects=True)
    with c, warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        sd = target()
        c.load(sd, ref)
        assert sd["extra"]["evil"] == {"lr": 0.5} and torch.equal(sd["model"]["w"], W)
        c.load(target(), ref + "0")
        assert marker.exists()  # the opt-in really is an unrestricted unpickler
        assert not [w for w in later if issubclass(w.category, TrustedObjectWarning)], "warned more than once"
        good_still_loads(srv, c)


def test_pickle_bytes_inside_a_json_object_stay_data(srv, client, tmp_path):
    marker = tmp_path / "marker"
    smuggled = pickle.dumps(ExecOnLoad(marker)).decode("latin-1")
    ref = fresh_ref()
    plant(srv.url, ref, [("extra.evil", "json", smuggled)])
    sd = target()
    client.load(sd, ref)
    assert sd["extra"]["evil"] == smuggled and not marker.exists()
    # A JSON object that also points at bytes is not a valid index: the service refuses it, nothing commits.
    run, name = fresh_ref().split("/")
    body = RankIndex(rank=0, world_size=1).model_dump(mode="json")
    body["objects"] = [{"name": "extra.evil", "encoding": "json", "value": smuggled, "location": {
        "file": "r000000-0000.bin", "offset": 0, "length": 4, "raw_length": 4, "xxh3": "0" * 16}}]
    base, sid = f"{srv.url}/v1/checkpoints/{run}/{name}", uuid.uuid4().hex
    with httpx.Client(headers={"Authorization": f"Bearer {WRITER}"}, timeout=30) as h:
        h.post(f"{base}/sessions", json={"session": sid, "world_size": 1, "step": None}).raise_for_status()
        r = h.put(f"{base}/sessions/{sid}/ranks/0", json=body)
    assert 400 <= r.status_code < 500, r.text
    with pytest.raises(CheckpointNotFound):
        client.load(target(), f"{run}/{name}")
    good_still_loads(srv, client)


def _dcp_failure(excinfo: pytest.ExceptionInfo) -> BaseException:
    """The error a rank raised inside ``dcp.load`` (DCP wraps it, with its traceback, in a CheckpointException)."""
    e = excinfo.value
    failures = getattr(e, "failures", None)
    return next(iter(failures.values()))[0] if failures else e


@pytest.mark.parametrize("kind", ["pickle", "torch-exec", "torch-os-system"])
def test_dcp_reader_refuses_an_object_that_would_run_code(srv, client, tmp_path, kind):
    marker = tmp_path / "marker"
    encoding, payload = PAYLOADS[kind](marker)
    ref = fresh_ref()
    plant(srv.url, ref, [("extra.evil", encoding, payload)])
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        dcp.load(target(), storage_reader=client.dcp_reader(ref))
    err = _dcp_failure(e)
    assert isinstance(err, UnsafeObject), repr(e.value)
    assert err.details["key"] == "extra.evil" and ref in err.message
    assert not marker.exists(), "the payload ran inside dcp.load"
    good_still_loads(srv, client)


def test_dcp_reader_refuses_stored_metadata_that_would_run_code(srv, client, tmp_path):
    marker = tmp_path / "marker"
    ref = fresh_ref()
    plant(srv.url, ref, [("extra.evil", "json", 1), (DCP_METADATA, "torch", torch_bytes(ExecOnLoad(marker)))])
    with pytest.raises(UnsafeObject) as e:
        client.dcp_reader(ref).read_metadata()
    assert e.value.details["key"] == DCP_METADATA
    with pytest.raises(BaseException) as e:  # DCP reports a failed metadata read as text, in its own exception
        dcp.load(target(), storage_reader=client.dcp_reader(ref))
    assert DCP_METADATA in str(e.value) and "unrestricted unpickler" in str(e.value), repr(e.value)
    assert not marker.exists(), "the payload ran while DCP read the metadata"
    sd = target()
    client.load(sd, ref)  # the reserved object is not part of the state dict
    assert sd["extra"]["evil"] == 1 and not marker.exists()


def test_export_refuses_an_object_that_would_run_code(srv, client, tmp_path):
    marker = tmp_path / "marker"
    ref = fresh_ref()
    plant(srv.url, ref, [("extra.evil", "torch", torch_bytes(ExecOnLoad(marker)))])
    cmd = [sys.executable, "-m", "ckptd.cli.main", "export", ref, "--format", "torch", str(tmp_path / "out.pt"),
           "--root", srv.root]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "extra.evil" in res.stderr + res.stdout, res.stderr
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    res = subprocess.run(cmd + ["--trust-objects"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert marker.exists()


def test_import_of_a_dcp_directory_does_not_unpickle_its_metadata_freely(srv, tmp_path):
    marker = tmp_path / "marker"
    src = tmp_path / "dcp"
    dcp.save({"model": {"w": W.clone()}, "step": 3}, checkpoint_id=str(src))
    ref = fresh_ref()
    cmd = [sys.executable, "-m", "ckptd.cli.main", "import", "dcp", str(src), ref, "--root", srv.root]
    good = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr  # DCP's own metadata reads under the restriction
    (src / ".metadata").write_bytes(pickle.dumps(ExecOnLoad(marker)))
    res = subprocess.run(cmd[:-3] + [fresh_ref(), "--root", srv.root], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "builtins.exec" in res.stderr + res.stdout, res.stderr
    assert not marker.exists(), "the payload ran while the import read .metadata"


# -- saves refuse what a default load would refuse ------------------------------------------------------

def test_save_refuses_an_unsafe_object_naming_the_key(srv, client, tmp_path):
    marker = tmp_path / "marker"
    ref = fresh_ref()
    for value, key in ((ExecOnLoad(marker), "extra.bad"), ({"deep": [(1, Opaque(1))]}, "extra.bad.deep")):
        sd = {"model": {"w": W.clone()}, "extra": {"epoch": 3, "bad": value}}
        with pytest.raises(UnsafeObject) as e:
            client.save(sd, ref)
        assert e.value.details["key"] == key and f"{key!r}" in e.value.message
    assert not marker.exists()
    with pytest.raises(CheckpointNotFound):
        client.load({"model": {"w": torch.zeros(4)}, "extra": {"epoch": None, "bad": None}}, ref)


def test_user_allow_list_saves_and_loads_a_class(srv, client):
    ref = fresh_ref()
    sd = {"model": {"w": W.clone()}, "extra": {"evil": Opaque(7)}}
    with CheckpointClient(srv.url, token=VICTIM, retry_seconds=10, safe_globals=[Opaque]) as allowing:
        allowing.save(sd, ref).wait()
        got = target()
        allowing.load(got, ref)
        assert got["extra"]["evil"] == Opaque(7)
    with pytest.raises(UnsafeObject) as e:  # a client that does not allow it refuses it
        client.load(target(), ref)
    assert any("Opaque" in g for g in e.value.details["globals"])
    with torch.serialization.safe_globals([Opaque]):  # torch's own allow-list is honoured too
        got = target()
        client.load(got, ref)
    assert got["extra"]["evil"] == Opaque(7)
    assert Opaque not in torch.serialization.get_safe_globals()


# -- typical trainer state needs no opt-in --------------------------------------------------------------

def trainer_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    np.random.seed(0)
    random.seed(0)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": {"step": torch.optim.lr_scheduler.StepLR(sched_opt, 3).state_dict(),
                  "onecycle": torch.optim.lr_scheduler.OneCycleLR(
                      torch.optim.SGD(model.parameters(), lr=0.1), 1.0, total_steps=10).state_dict(),
                  "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(sched_opt).state_dict()},
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "numpy_generator": np.random.default_rng(0).bit_generator.state},
        "trainer": {"epoch": 2, "global_step": 1234, "best": np.float64(0.25), "loss_scale": float("inf"),
                    "name": "run-a", "tags": ["a", "b"], "history": (collections.OrderedDict(a=1),),
                    "counts": collections.OrderedDict(a=1),
                    "shape": (3, 4), "seen": {1, 2}, "ids": {0: "zero"}},
        # Lightning-like (callbacks, loops) and Accelerate-like (a custom-object list, a scaler) checkpoints
        "lightning": {"callbacks": {"ModelCheckpoint{'monitor': 'val'}": {"best_model_score": torch.tensor(0.5),
                                                                           "best_model_path": "/ckpt/e2.ckpt"}},
                      "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3, "completed": 3}}}},
                      "hparams": {"lr": 1e-3, "layers": [4, 3]}},
        "accelerate": {"step": 3, "scaler": {"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 0},
                       "custom": [{"epoch": 1}]},
    }


def blank(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return type(v)((k, blank(x)) for k, x in v.items())
    if isinstance(v, list) and any(isinstance(x, (torch.Tensor, dict, list)) for x in v):
        return [blank(x) for x in v]
    return None


def assert_same(got: Any, want: Any, where: str = "") -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}.{i}")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_typical_trainer_objects_round_trip_without_opt_in(srv, client):
    ref = fresh_ref()
    sd = trainer_state()
    client.save(sd, ref).wait()
    got = blank(sd)
    client.load(got, ref)
    assert_same(got, sd)
    run, name = ref.split("/")
    manifest = httpx.get(f"{srv.url}/v1/checkpoints/{run}/{name}", headers={"Authorization": f"Bearer {VICTIM}"}).json()
    enc = {o["name"]: o["encoding"] for o in manifest["objects"]}
    assert set(enc.values()) <= {"json", "torch"}
    for key in ("trainer.epoch", "trainer.tags", "sched.step.gamma", "lightning.hparams.layers", "accelerate.step",
                "optim.param_groups.0.lr", "trainer.counts.a", "trainer.ids.0", "rng.numpy_generator.state.state"):
        assert enc[key] == "json", key
    for key in ("rng.numpy", "rng.python", "trainer.best", "trainer.loss_scale", "trainer.history",
                "trainer.shape", "trainer.seen", "optim.param_groups.0.betas", "sched.plateau.best"):
        assert enc[key] == "torch", key


# == payloads that only use allowed globals, and a service that never unpickles ==============================

ADMIN = "admin-token-0123456789"
ADMIN_TOKENS = (f"attacker sha256:{hash_token(WRITER)} write:gpt*\nvictim {VICTIM} write:gpt*\n"
                f"root {ADMIN} admin\n")

# -- hand-written pickles (protocol 2, the opcodes torch's restricted unpickler reads) -----------------------


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _bytes(b: bytes) -> bytes:
    """``_codecs.encode(TEXT, 'latin1')``: how protocol 2 pickles bytes (numpy does so too)."""
    return b"c_codecs\nencode\n" + _str(b.decode("latin1")) + _str("latin1") + b"\x86R"


def _int(n: int) -> bytes:
    return b"J" + n.to_bytes(4, "little", signed=True)


def _dtype(spec: str, flags: int) -> bytes:
    """A dtype made by ``numpy.dtype(spec, False, True)``, then given numpy's state tuple with ``flags``."""
    make = b"cnumpy\ndtype\n" + _str(spec) + b"\x89\x88\x87R"
    return make + b"(K\x03" + _str("|") + b"NNN" + _int(-1) + _int(-1) + _int(flags) + b"tb"


def _array(dtype: bytes, raw: bytes, n: int = 1) -> bytes:
    """``ndarray.__setstate__((1, (n,), dtype, False, raw))`` on ``_reconstruct(ndarray, (0,), b'b')``."""
    return (b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _bytes(b"b") + b"\x87R"
            + b"(K\x01" + _int(n) + b"\x85" + dtype + b"\x89" + _bytes(raw) + b"tb")


def _torch_zip(pkl: bytes, compress: bool = False, extra: dict[str, bytes] | None = None) -> bytes:
    """A ``torch.save`` zip of ``{'x': 1}`` with its ``data.pkl`` replaced by ``pkl``."""
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else zin.read(info.filename)
            zout.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED)
        for name, data in (extra or {}).items():
            zout.writestr(f"archive/{name}", data, compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


POINTER = (0x4141414141414141).to_bytes(8, "little")
NUMPY_PAYLOADS = {
    # an object array whose item is the raw pointer 0x4141...: read or printed, it crashes
    "object-dtype-flags-cleared": _torch_zip(b"\x80\x02" + _array(_dtype("O8", 0), POINTER) + b"."),
    # multiarray.scalar(dtype, bytes) returns *(PyObject **)bytes, with a reference taken, during the load
    "scalar-of-forged-object-dtype": _torch_zip(
        b"\x80\x02cnumpy._core.multiarray\nscalar\n" + _dtype("O8", 0) + _bytes(POINTER) + b"\x86R."),
    # integers flagged as object references: numpy decrements "references" at 0x4141... when it frees them
    "int-dtype-flagged-as-objects": _torch_zip(b"\x80\x02" + _array(_dtype("i8", 63), POINTER) + b"."),
    # a zip whose records are deflated: 64 MiB of zeros in a 64 KB payload
    "deflated-zip-bomb": _torch_zip(b"\x80\x02}q\x00.", compress=True, extra={"data/bomb": bytes(64 << 20)}),
}
assert len(NUMPY_PAYLOADS["deflated-zip-bomb"]) < 256 << 10


def _plant(url: str, ref: str, objects: list[tuple[str, bytes]]) -> None:
    """Commit ``ref``: tensor ``model.w`` and ``objects`` (name, torch.save bytes), as the attacker."""
    plant(url, ref, [(name, "torch", payload) for name, payload in objects], token=WRITER, step=1)


@pytest.fixture(scope="module")
def numpy_srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("objects-more")
    (tmp / "tokens").write_text(ADMIN_TOKENS)
    s = ServerProcess(tmp / "root", env={"CKPTD_TOKENS_FILE": str(tmp / "tokens")}).start()
    yield s
    s.stop()


# The victim: a default client in its own process (a crash there must not take the test run down).
VICTIM_SCRIPT = """
import json, sys, resource, torch
from ckptd_client import CheckpointClient, UnsafeObject
url, token, refs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
with CheckpointClient(url, token=token, retry_seconds=10) as c:
    for ref in refs:
        sd = {"model": {"w": torch.zeros(4)}, "extra": {"evil": None}}
        try:
            c.load(sd, ref)
            out[ref] = ["loaded", repr(sd["extra"]["evil"])[:200]]
        except UnsafeObject as e:
            out[ref] = ["refused", e.details.get("key"), e.message]
        except Exception as e:
            out[ref] = ["error", type(e).__name__, str(e)[:300]]
        print(json.dumps({ref: out[ref]}), flush=True)
print(json.dumps({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}), flush=True)
"""


def test_forged_numpy_dtypes_and_deflated_records_are_refused_and_nothing_crashes(numpy_srv, tmp_path):
    refs = {}
    for i, (kind, payload) in enumerate(sorted(NUMPY_PAYLOADS.items())):
        refs[kind] = f"gpt/{1000 + i}"
        _plant(numpy_srv.url, refs[kind], [("extra.evil", payload)])
    rng = np.random.get_state()
    buf = io.BytesIO()
    torch.save({"rng": rng, "obj": np.array([1, "x", None], dtype=object),
                "rec": np.zeros(2, dtype=[("a", "O"), ("b", ">f8")])}, buf)
    _plant(numpy_srv.url, "gpt/999", [("extra.evil", buf.getvalue())])  # genuine numpy state: loads
    res = subprocess.run([sys.executable, "-c", VICTIM_SCRIPT, numpy_srv.url, VICTIM,
                          json.dumps([*refs.values(), "gpt/999"])], capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    got = {k: v for line in lines for k, v in line.items()}
    assert res.returncode == 0, f"the loading process died ({res.returncode}) after {got}: {res.stderr[-2000:]}"
    for kind, ref in refs.items():
        assert got[ref][0] == "refused" and got[ref][1] == "extra.evil", (kind, got[ref])
        assert ref in got[ref][2], (kind, got[ref])
    assert "flags" in got[refs["object-dtype-flags-cleared"]][2]
    assert "compressed zip records" in got[refs["deflated-zip-bomb"]][2]
    assert got["gpt/999"][0] == "loaded" and "'rng'" in got["gpt/999"][1], got["gpt/999"]
    assert got["maxrss_mib"] < 1024, got

    # ckptd export reads objects through the same loader
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "ckptd.cli.main", "export", refs["object-dtype-flags-cleared"], "--format", "torch",
           str(out), "--root", numpy_srv.root]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode not in (0, -11) and "extra.evil" in res.stderr + res.stdout, res.stderr[-2000:]
    assert not out.exists()


class _RunsOnLoad:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_the_service_never_unpickles_an_object_verify_preview_reshard(numpy_srv, tmp_path):
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save({"hook": _RunsOnLoad(marker)}, buf)
    ref = "gpt/77"
    _plant(numpy_srv.url, ref, [("extra.evil", buf.getvalue()),
                                ("extra.dtype", NUMPY_PAYLOADS["object-dtype-flags-cleared"])])
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{numpy_srv.url}/v1/checkpoints/{ref}/verify", headers=admin, timeout=120)
    assert r.status_code == 200 and r.json()["ok"] is True, r.text  # the bytes are what was committed
    r = httpx.post(f"{numpy_srv.url}/v1/reshard/preview", json={"source": ref, "to": "full"}, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{numpy_srv.url}/v1/reshard", json={"source": ref, "to": "fsdp2:dp=2", "device": "cpu"},
                   headers=admin, timeout=60)
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    deadline = time.monotonic() + scaled(120)
    while time.monotonic() < deadline:
        st = httpx.get(f"{numpy_srv.url}/v1/jobs/{job}", headers=admin).json()
        if st["state"] in ("done", "failed"):
            break
        time.sleep(0.2)
    assert st["state"] == "done", st
    r = httpx.get(f"{numpy_srv.url}/v1/checkpoints/{st['out']}", headers=admin)
    assert r.status_code == 200 and {o["name"] for o in r.json()["objects"]} == {"extra.evil", "extra.dtype"}
    assert not marker.exists(), "the service unpickled a checkpoint object"
    assert numpy_srv.proc.poll() is None and httpx.get(f"{numpy_srv.url}/healthz").status_code == 200
    assert os.path.getsize(numpy_srv.log) == 0 or "Traceback" not in Path(numpy_srv.log).read_text()
