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
import os
import pickle
import random
import subprocess
import sys
import uuid
import warnings
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
from ckptd_schemas.names import DCP_METADATA
from ckptd_client.objects import TrustedObjectWarning
from ckptd_schemas import BoxChunk, Location, ObjectEntry, RankIndex, TensorEntry
from support import ServerProcess, assert_bits_equal, blank_like, make_state

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
