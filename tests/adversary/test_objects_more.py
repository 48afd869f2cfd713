"""Loading a checkpoint never runs code from it, continued: payloads that only use allowed globals.

The attacker holds a valid write token and commits, over raw HTTP, ``torch.save`` data whose
``data.pkl`` is written by hand. Every global it names is on the default allow-list (numpy's
``dtype``, ``ndarray``, ``multiarray._reconstruct`` and ``scalar``, ``_codecs.encode``), but the state it gives a numpy dtype carries forged flags: an
object dtype with its flags cleared makes an array, or a ``multiarray.scalar``, whose raw
bytes are read as object pointers during the load (a crash, or worse, in the trainer); an
integer dtype flagged as holding objects reads integers as pointers. A zip whose records are
deflated (``torch.save`` writes none) can inflate a few KB into gigabytes before torch checks
a record's size. Each is refused with ``UnsafeObject`` naming the key, in a fresh process that
must not crash, through ``CheckpointClient.load`` and ``ckptd export``; typical numpy state
still loads.

The service itself never unpickles an object: verifying, previewing and resharding a
checkpoint whose object runs code when unpickled leave the payload unrun.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from ckptd.service.auth import hash_token
from adversary.test_objects import plant
from support import ServerProcess

WRITER, VICTIM, ADMIN = "attacker-write-token-0123456789", "victim-write-token-0123456789", "admin-token-0123456789"
TOKENS = (f"attacker sha256:{hash_token(WRITER)} write:gpt*\nvictim {VICTIM} write:gpt*\n"
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
PAYLOADS = {
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
assert len(PAYLOADS["deflated-zip-bomb"]) < 256 << 10


def _plant(url: str, ref: str, objects: list[tuple[str, bytes]]) -> None:
    """Commit ``ref``: tensor ``model.w`` and ``objects`` (name, torch.save bytes), as the attacker."""
    plant(url, ref, [(name, "torch", payload) for name, payload in objects], token=WRITER, step=1)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("objects-more")
    (tmp / "tokens").write_text(TOKENS)
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


def test_forged_numpy_dtypes_and_deflated_records_are_refused_and_nothing_crashes(srv, tmp_path):
    refs = {}
    for i, (kind, payload) in enumerate(sorted(PAYLOADS.items())):
        refs[kind] = f"gpt/{1000 + i}"
        _plant(srv.url, refs[kind], [("extra.evil", payload)])
    rng = np.random.get_state()
    buf = io.BytesIO()
    torch.save({"rng": rng, "obj": np.array([1, "x", None], dtype=object),
                "rec": np.zeros(2, dtype=[("a", "O"), ("b", ">f8")])}, buf)
    _plant(srv.url, "gpt/999", [("extra.evil", buf.getvalue())])  # genuine numpy state: loads
    res = subprocess.run([sys.executable, "-c", VICTIM_SCRIPT, srv.url, VICTIM, json.dumps([*refs.values(), "gpt/999"])],
                         capture_output=True, text=True, timeout=120)
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
           str(out), "--root", srv.root]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode not in (0, -11) and "extra.evil" in res.stderr + res.stdout, res.stderr[-2000:]
    assert not out.exists()


class _RunsOnLoad:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_the_service_never_unpickles_an_object_verify_preview_reshard(srv, tmp_path):
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save({"hook": _RunsOnLoad(marker)}, buf)
    ref = "gpt/77"
    _plant(srv.url, ref, [("extra.evil", buf.getvalue()),
                          ("extra.dtype", PAYLOADS["object-dtype-flags-cleared"])])
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{srv.url}/v1/checkpoints/{ref}/verify", headers=admin, timeout=120)
    assert r.status_code == 200 and r.json()["ok"] is True, r.text  # the bytes are what was committed
    r = httpx.post(f"{srv.url}/v1/reshard/preview", json={"source": ref, "to": "full"}, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{srv.url}/v1/reshard", json={"source": ref, "to": "fsdp2:dp=2", "device": "cpu"},
                   headers=admin, timeout=60)
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = httpx.get(f"{srv.url}/v1/jobs/{job}", headers=admin).json()
        if st["state"] in ("done", "failed"):
            break
        time.sleep(0.2)
    assert st["state"] == "done", st
    r = httpx.get(f"{srv.url}/v1/checkpoints/{st['out']}", headers=admin)
    assert r.status_code == 200 and {o["name"] for o in r.json()["objects"]} == {"extra.evil", "extra.dtype"}
    assert not marker.exists(), "the service unpickled a checkpoint object"
    assert srv.proc.poll() is None and httpx.get(f"{srv.url}/healthz").status_code == 200
    assert os.path.getsize(srv.log) == 0 or "Traceback" not in Path(srv.log).read_text()
