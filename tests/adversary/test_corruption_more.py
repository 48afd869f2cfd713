"""More damage to a committed checkpoint's data, read through every path that restores it.

The checkpoint holds zstd chunks, raw chunks and a stored (``torch``) object. The attacks: a byte of
a zstd chunk flipped; a byte of the stored object flipped, read alone (the load fetches only the
object's bytes); the data file truncated; and a flipped byte with the session's digest record
(``sessions/<sid>/digests/<file>``) rewritten to the damaged bytes, which nothing may trust once the
manifest is written. Each must fail typed (:class:`CorruptCheckpoint`, naming the file and what it
would fill) within seconds on every path: ``client.load`` with direct reads and over HTTP, DCP through
``client.dcp_reader``, ``ckptd export``, ``ckptd reshard`` and ``ckptd verify``, each exiting 1 with a
message and no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptd_schemas.filedigest import StreamDigest
from ckptd_client import CheckpointClient
from ckptd_schemas import CorruptCheckpoint, FileEntry
from support import REPO, ServerProcess

BOUND_S = 10.0
_n = iter(range(1, 1 << 20))


def _state() -> dict:
    return {"model": {"w": torch.zeros(512, 1024), "b": torch.arange(1000.0)},  # w: 2 MiB, compresses well
            "extra": {"rng": (1, "tuple-pickled", 2.5)}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    base = tmp_path_factory.mktemp("corruption-more")
    s = ServerProcess(base / "root", log=base / "server.log").start()
    yield s
    s.kill()


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    return p, time.monotonic() - t0


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("attack", ["flip-zstd-chunk", "flip-object", "truncate", "flip-and-rewrite-digest-record"])
def test_damaged_data_fails_typed_and_fast_on_every_read_path(srv, tmp_path, attack):
    ref = f"m{next(_n)}/1"
    run = ref.split("/")[0]
    with CheckpointClient(srv.url, compression="zstd") as c:
        assert c.save(_state(), ref).wait(timeout=60).state == "committed"
        m = c.manifest(ref)
    w = m.tensor("model.w").chunks[0].location
    obj = next(o for o in m.objects if o.name == "extra.rng").location
    assert w.codec == "zstd" and obj is not None and w.file == obj.file
    session = Path(srv.root) / "runs" / run / "1" / "sessions" / m.session
    path = session / "files" / w.file
    if attack in ("flip-zstd-chunk", "flip-and-rewrite-digest-record"):
        _flip(path, w.offset + w.length // 2)
    elif attack == "flip-object":
        _flip(path, obj.offset + obj.length // 2)
    else:
        path.chmod(0o644)
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    if attack == "flip-and-rewrite-digest-record":  # the record now vouches for the damaged bytes
        record = session / "digests" / w.file
        old = FileEntry.model_validate_json(record.read_bytes())
        d = StreamDigest(old.block_size)
        d.update(memoryview(path.read_bytes()))
        whole, blocks = d.finish()
        record.chmod(0o644)
        record.write_text(json.dumps({**old.model_dump(), "xxh3": whole, "blocks": blocks}))
    what = "object" if attack == "flip-object" else "tensors"
    names = ["extra.rng"] if attack == "flip-object" else ["model.w"]

    def target() -> dict:  # what the load restores: the object alone, or the whole state
        return {"extra": {"rng": None}} if attack == "flip-object" else {
            "model": {"w": torch.full((512, 1024), 7.0), "b": torch.zeros(1000)}, "extra": {"rng": None}}

    for direct in (True, False):
        t0 = time.monotonic()
        with CheckpointClient(srv.url, direct_reads=direct, retry_seconds=40) as c:
            with pytest.raises(CorruptCheckpoint) as info:
                c.load(target(), ref, strict=attack != "flip-object")
        assert time.monotonic() - t0 < BOUND_S
        err = info.value
        assert w.file in str(err), err
        got = err.details.get(what)
        assert got and set(names) <= set([got] if isinstance(got, str) else got), err.details
        assert all(f"'{n}'" in str(err) for n in names), err

    import torch.distributed.checkpoint as dcp

    t0 = time.monotonic()
    with CheckpointClient(srv.url, retry_seconds=40) as c:
        with pytest.raises(BaseException) as info:  # DCP wraps a rank's error in a CheckpointException
            dcp.load(target(), storage_reader=c.dcp_reader(ref))
    assert time.monotonic() - t0 < BOUND_S
    failures = getattr(info.value, "failures", None)
    err = next(iter(failures.values()))[0] if failures else info.value
    assert isinstance(err, CorruptCheckpoint), repr(info.value)
    assert w.file in str(err) and any(f"'{n}'" in str(err) for n in [*names, "extra.rng"]), err

    root = str(srv.root)
    for args in (["export", ref, str(tmp_path / "out"), "--root", root],
                 ["export", ref, str(tmp_path / "out.pt"), "--format", "torch", "--server", srv.url],
                 ["reshard", ref, "--to", "fsdp2:dp=2", "--root", root],
                 ["verify", ref, "--root", root], ["verify", ref, "--server", srv.url]):
        if attack == "flip-object" and args[0] != "verify":
            continue  # they read tensors; the object is the load's and the DCP reader's
        p, took = _cli(*args)
        assert p.returncode == 1 and took < BOUND_S + 10, (args, p.returncode, p.stdout, p.stderr)
        out = p.stdout + p.stderr
        assert "Traceback" not in out and w.file in out, (args, out)
        if args[0] in ("export", "reshard"):
            assert "tensor 'model.w'" in out or "tensors stored there: 'model.b', 'model.w'" in out, out
        if args[0] == "verify":
            assert not (Path(root) / "runs" / run / "1-fsdp2-dp2" / "COMMITTED").exists()
    assert not (tmp_path / "out.pt").exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no shard, no index
