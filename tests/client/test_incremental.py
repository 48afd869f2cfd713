"""Incremental saves: unchanged chunks are linked from the rank's previous checkpoint, not written.

Through a real service on a local root: what a save writes and what it links; loads, verify and
export of checkpoints that hold linked files, bit for bit, also after the checkpoints they
linked from are deleted; the commit's check of chunks placed in linked files (every linked byte is
read: a hostile index that places a false digest in one is refused); link refusals, which the saver
answers by writing the bytes; the opt-out; and that a save opens its session once (the stall opens
it to link, the upload uses that opening), on S3 with direct uploads too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import xxhash

from prometheus_client.parser import text_string_to_metric_families

from ckptd_client import CheckpointClient
from ckptd_schemas import Manifest, linked_name
from support import ServerProcess, assert_bits_equal, blank_like, verified

MIB = 1 << 20


def _state(step: int, frozen_mib: float = 2, trainable_kib: int = 64) -> dict:
    """A frozen backbone (the same bytes at every step), an adapter and optimizer state that move."""
    g = torch.Generator().manual_seed(0)
    rows = int(frozen_mib * MIB / (4 * 256))
    backbone = {f"layer{i}.weight": torch.randn(rows // 4, 256, generator=g) for i in range(4)}
    t = torch.Generator().manual_seed(1000 + step)
    n = trainable_kib * 1024 // 4
    return {"model": {**backbone, "lora.A": torch.randn(n, generator=t), "lora.B": torch.randn(n, generator=t)},
            "optim": {"lora.A.exp_avg": torch.randn(n, generator=t)}, "step": step}


def _manifest(url: str, ref: str) -> Manifest:
    run, name = ref.split("/")
    return Manifest.model_validate_json(httpx.get(f"{url}/v1/checkpoints/{run}/{name}").content)


def _written(m: Manifest) -> int:
    return m.total_bytes - m.linked_bytes


def _load(client: CheckpointClient, ref: str, like: dict) -> dict:
    got = blank_like(like)
    client.load(got, ref)
    return got


def _ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True, timeout=120)


def _answered(url: str, route: str) -> float:
    """Requests the service answered on ``route`` (a handler name), from its own /metrics."""
    return sum(s.value for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
               if fam.name == "ckptd_http_requests" for s in fam.samples
               if s.name.endswith("_total") and s.labels["route"] == route)


@pytest.fixture
def unleased(tmp_path):
    """A service whose manifest reads lease nothing, so that gc may delete what the test inspected."""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": "0"}).start()
    yield srv
    srv.stop()


def test_unchanged_chunks_are_linked_and_every_checkpoint_stays_whole(unleased, tmp_path):
    server = unleased
    client = CheckpointClient(server.url, file_bytes=MIB)  # several files, so linking is per file
    states = [_state(s) for s in range(1, 5)]
    for s, sd in enumerate(states, start=1):
        client.save(sd, f"ft/{s}").wait()
    first = _manifest(server.url, "ft/1")
    assert first.linked_bytes == 0
    frozen = sum(t.numel() * 4 for k, t in states[0]["model"].items() if k.startswith("layer"))
    for s in range(2, 5):
        m = _manifest(server.url, f"ft/{s}")
        linked = {f: e.linked for f, e in m.files.items() if e.linked is not None}
        assert linked and m.linked_bytes >= frozen, (s, m.linked_bytes, frozen)
        assert _written(m) < 0.1 * _written(first), (s, _written(m), _written(first))
        # each link names the previous checkpoint's file, under the name both sides derive
        assert all(f == linked_name(src.split("/")[0], src.split("/")[1]) and src.startswith(f"{s - 1}/")
                   for f, src in linked.items())
    for s, sd in enumerate(states, start=1):
        if s < 4:  # the newest is loaded after gc (a load leases what it reads, and gc keeps leased ones)
            continue
        assert_bits_equal(_load(client, f"ft/{s}", sd), sd, f"ft/{s}")

    # The checkpoints linked from go away: the later ones still load, verify and export.
    root = str(server.root)
    r = _ckptd("gc", "ft", "--keep-last", "1", "--root", root)
    assert r.returncode == 0 and "deleted ft/3" in r.stdout, r.stdout + r.stderr
    listed = httpx.get(f"{server.url}/v1/runs/ft/checkpoints").json()
    assert [c["name"] for c in listed] == ["4"]
    assert_bits_equal(_load(client, "ft/4", states[3]), states[3], "ft/4 after gc")
    r = _ckptd("verify", "ft/4", "--root", root)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _ckptd("export", "ft/4", str(tmp_path / "exported"), "--root", root)
    assert r.returncode == 0, r.stdout + r.stderr
    client.close()


def test_every_step_of_an_incremental_run_loads_bit_for_bit(server):
    client = CheckpointClient(server.url, file_bytes=MIB)
    states = [_state(s) for s in range(1, 4)]
    for s, sd in enumerate(states, start=1):
        client.save(sd, f"bits/{s}").wait()
    for s, sd in enumerate(states, start=1):
        assert_bits_equal(_load(client, f"bits/{s}", sd), sd, f"bits/{s}")
    client.close()


def test_a_save_after_the_linked_checkpoint_is_gone_writes_everything_again(server):
    client = CheckpointClient(server.url, file_bytes=MIB)
    client.save(_state(1), "gone/1").wait()
    shutil.rmtree(Path(server.root) / "runs" / "gone" / "1")  # deleted behind the service's back
    client.save(_state(2), "gone/2").wait()
    m = _manifest(server.url, "gone/2")
    assert m.linked_bytes == 0
    assert_bits_equal(_load(client, "gone/2", _state(2)), _state(2))
    client.close()


def test_opt_out_writes_every_chunk(server):
    client = CheckpointClient(server.url, incremental=False)
    for s in (1, 2):
        client.save(_state(s), f"full/{s}").wait()
    assert _manifest(server.url, "full/2").linked_bytes == 0
    client.close()


def test_links_are_checked(server):
    """Refused: a name that is not the derived one, a source that is not a visible checkpoint of the
    run, a file the source does not hold. And a chunk placed in a linked file is checked by reading
    the file, as every file is: a false digest is refused at commit."""
    client = CheckpointClient(server.url, file_bytes=MIB, incremental=False)
    client.save(_state(1), "chk/1").wait()
    verified(server.url, "chk/1")  # its re-read's record predates the links below (it vouches for those bytes)
    src = _manifest(server.url, "chk/1")
    f0 = sorted(src.files)[0]
    r = httpx.post(f"{server.url}/v1/checkpoints/chk/2/sessions", json={"session": "s1", "world_size": 1, "step": 2})
    assert r.status_code == 200, r.text
    base = f"{server.url}/v1/checkpoints/chk/2/sessions/s1/files"
    bad = {
        "another name": ("ln-0000000000000000.bin", {"checkpoint": "1", "file": f0}),
        "no such checkpoint": (linked_name("9", f0), {"checkpoint": "9", "file": f0}),
        "no such file": (linked_name("1", "nope.bin"), {"checkpoint": "1", "file": "nope.bin"}),
        "a path": (linked_name("1", f0), {"checkpoint": "../other", "file": f0}),
    }
    for what, (name, body) in bad.items():
        r = httpx.post(f"{base}/{name}/link", json=body)
        assert r.status_code in (400, 422) and "error" in r.json(), (what, r.status_code, r.text)
    name = linked_name("1", f0)
    # The link's name already taken by an upload of other bytes: refused 400 (not a retryable 503), nothing replaced
    taken = b"not the source"
    r = httpx.post(f"{server.url}/v1/checkpoints/chk/2/sessions", json={"session": "s0", "world_size": 1, "step": 2})
    other = f"{server.url}/v1/checkpoints/chk/2/sessions/s0/files"
    r = httpx.put(f"{other}/{name}", content=taken, headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(taken)})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{other}/{name}/link", json={"checkpoint": "1", "file": f0})
    assert r.status_code == 400 and "send the bytes" in r.json()["error"]["message"], r.text
    staged = Path(server.root) / "runs" / "chk" / "2" / "sessions" / "s0" / "files" / name
    assert staged.read_bytes() == taken
    r = httpx.post(f"{base}/{name}/link", json={"checkpoint": "1", "file": f0})
    assert r.status_code == 200 and r.json()["size"] == src.files[f0].size, r.text

    # An index placing a chunk at an offset of the linked file where the source placed none, declaring
    # a digest its bytes do not have: the commit reads the file (as it reads every file) and refuses it.
    stored = (Path(server.root) / "runs" / "chk" / "1" / "sessions" / src.session / "files" / f0).read_bytes()
    n = len(stored) - 4  # most of the file: a link must be at least half used (ckptd.store.links)
    real = xxhash.xxh3_64_hexdigest(stored[4:])
    for digest, ok in (("0" * 16 if real != "0" * 16 else "1" * 16, False), (real, True)):
        index = {"rank": 0, "world_size": 1, "files": [name], "tensors": [
            {"name": "w", "shape": [n], "dtype": "uint8", "group": "model", "chunks": [
                {"kind": "box", "rank": 0, "offsets": [0], "sizes": [n],
                 "location": {"file": name, "offset": 4, "length": n, "codec": "raw", "raw_length": n,
                              "xxh3": digest}}]}]}
        sid = "s1" if not ok else "s2"
        if ok:
            r = httpx.post(f"{server.url}/v1/checkpoints/chk/3/sessions",
                           json={"session": sid, "world_size": 1, "step": 3})
            assert r.status_code == 200
            link = f"{server.url}/v1/checkpoints/chk/3/sessions/{sid}/files/{name}/link"
            r = httpx.post(link, json={"checkpoint": "1", "file": f0})
            # chk/2's link moved the file's ctime: chk/1's recorded verification no longer vouches for it
            assert r.status_code == 400 and "send the bytes" in r.text, r.text
            assert httpx.post(f"{server.url}/v1/checkpoints/chk/1/verify", timeout=60).json()["ok"]
            r = httpx.post(link, json={"checkpoint": "1", "file": f0})  # verified again: linked
            assert r.status_code == 200, r.text
        ref = "chk/2" if not ok else "chk/3"
        r = httpx.put(f"{server.url}/v1/checkpoints/{ref}/sessions/{sid}/ranks/0", content=json.dumps(index),
                      headers={"Content-Type": "application/json"}, timeout=60)
        if ok:
            assert r.status_code == 200 and r.json()["state"] == "committed", r.text
        else:
            assert r.status_code == 422 and r.json()["error"]["code"] == "checksum_mismatch", r.text
    assert [c["name"] for c in httpx.get(f"{server.url}/v1/runs/chk/checkpoints").json()] == ["1", "3"]
    client.close()


@pytest.mark.parametrize("compression", ["zstd", None])
def test_compressed_and_raw_chunks_link_alike(server, compression):
    client = CheckpointClient(server.url, file_bytes=MIB, compression=compression)
    for s in (1, 2):
        client.save(_state(s), f"c{compression or 'raw'}/{s}".lower()).wait()
    m = _manifest(server.url, f"c{compression or 'raw'}/2".lower())
    assert m.linked_bytes > 0
    assert_bits_equal(_load(client, f"c{compression or 'raw'}/2".lower(), _state(2)), _state(2))
    client.close()


def test_show_reports_bytes_written_and_linked(server):
    client = CheckpointClient(server.url, file_bytes=MIB)
    handles = []
    for s in (1, 2):
        handles.append(client.save(_state(s), f"show/{s}"))
        handles[-1].wait()
    client.close()
    m = _manifest(server.url, "show/2")
    ways = handles[1].ways  # the save's handle says the same: what it wrote, which way, and what it linked
    assert ways.files["linked"] == len([f for f in m.files.values() if f.linked is not None]) > 0, ways
    assert ways.bytes["linked"] == m.unchanged_bytes and sum(ways.files.values()) == len(m.files), ways
    assert sum(ways.bytes[w] for w in ("socket", "http", "direct")) == _written(m), (ways, _written(m))
    r = _ckptd("show", "show/2", "--root", str(server.root))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("written"))
    assert "linked" in line and "from show/1" in line, r.stdout
    r = _ckptd("show", "show/1", "--root", str(server.root))
    assert not any(x.startswith("written") for x in r.stdout.splitlines()) and m.linked_bytes > 0


def test_unchanged_cpu_chunks_are_linked_in_the_stall_and_never_copied(server):
    """The frozen tensors are hashed in place and linked before save() returns: the snapshot copies
    only what changed (the pool's counters), the slab shrinks to that, and the result is the same."""
    client = CheckpointClient(server.url, file_bytes=MIB)
    pool = client.snapshot_pool
    states = [_state(s) for s in (1, 2, 3)]
    frozen = sum(t.numel() * 4 for k, t in states[0]["model"].items() if k.startswith("layer"))
    total = sum(t.numel() * t.element_size() for g in ("model", "optim") for t in states[0][g].values())
    client.save(states[0], "stall/1").wait()
    assert pool.stats.pooled_bytes == total
    for s, sd in enumerate(states[1:], start=2):
        before = pool.stats.pooled_bytes + pool.stats.fallback_bytes
        client.save(sd, f"stall/{s}").wait()
        copied = pool.stats.pooled_bytes + pool.stats.fallback_bytes - before
        assert copied == total - frozen, (s, copied, total - frozen)
    assert pool.capacity < total / 2  # sized down to what a save copies now
    for s, sd in enumerate(states, start=1):
        assert_bits_equal(_load(client, f"stall/{s}", sd), sd, f"stall/{s}")
    client.close()


def test_a_stall_link_that_fails_copies_instead(server, monkeypatch):
    """Every link attempted in the stall fails (the service unreachable then): the save copies
    everything, links the unchanged chunks from the upload instead, and the checkpoint is the same."""
    import ckptd_client._incremental as inc

    real = inc.link_files

    def failing_in_the_stall(*a, **k):
        if k.get("retry") is False:
            raise RuntimeError("service gone")
        return real(*a, **k)

    client = CheckpointClient(server.url, file_bytes=MIB)
    client.save(_state(1), "nolink/1").wait()
    pool = client.snapshot_pool
    before = pool.stats.pooled_bytes + pool.stats.fallback_bytes
    monkeypatch.setattr(inc, "link_files", failing_in_the_stall)
    opens = _answered(server.url, "open_session")
    client.save(_state(2), "nolink/2").wait()
    assert _answered(server.url, "open_session") - opens == 1  # opened in the stall, not again by the upload
    total = sum(t.numel() * t.element_size() for g in ("model", "optim") for t in _state(2)[g].values())
    assert pool.stats.pooled_bytes + pool.stats.fallback_bytes - before == total  # everything copied
    assert _manifest(server.url, "nolink/2").linked_bytes > 0  # and linked from the upload
    assert_bits_equal(_load(client, "nolink/2", _state(2)), _state(2))
    client.close()


def test_a_save_opens_its_session_once(server):
    """The stall opens the session to link the frozen files; the upload goes on with that opening
    instead of opening (joining) it again: one opening per save, with or without a stall link."""
    client = CheckpointClient(server.url, file_bytes=MIB)
    opened = []
    for s in (1, 2, 3):
        before = _answered(server.url, "open_session")
        client.save(_state(s), f"once/{s}").wait()
        opened.append(_answered(server.url, "open_session") - before)
    assert opened == [1, 1, 1], opened
    assert _manifest(server.url, "once/3").linked_bytes > 0  # saves 2 and 3 linked (in the stall)
    assert_bits_equal(_load(client, "once/3", _state(3)), _state(3))
    client.close()


def test_an_incremental_save_on_s3_uploads_straight_to_the_store(moto_s3, s3_env, tmp_path):
    """On an S3 root the stall's opening asks for presigned URLs: the second save, which links in its
    stall, sends none of its files through the service either."""
    from s3_server import aws_env

    url = moto_s3.url()
    srv = ServerProcess(url, env={**aws_env(moto_s3.endpoint), "CKPTD_DIRECT_UPLOADS": "true"},  # opted in
                        log=tmp_path / "server.log").start()
    try:
        with CheckpointClient(srv.url, file_bytes=MIB) as client:
            client.save(_state(1), "s3inc/1").wait()
            client.save(_state(2), "s3inc/2").wait()
            assert_bits_equal(_load(client, "s3inc/2", _state(2)), _state(2))
        assert _manifest(srv.url, "s3inc/2").linked_bytes > 0
        assert _answered(srv.url, "upload_file") == 0  # no data file crossed the service
        assert _answered(srv.url, "open_session") == 2
    finally:
        srv.stop()
        moto_s3.clear(url.split("/", 3)[3])


def test_a_file_edited_in_the_root_after_its_commit_is_not_linked(server):
    """Someone edits a committed data file in place (same size). The next save does not link it (its
    stamp moved since the checkpoint's recorded verification): the unchanged chunks are written again,
    and the new checkpoint verifies and loads bit for bit although the old one is now damaged. (An
    edit between the link and the commit is refused by the commit's read: tests/adversary/test_ingest.py.)"""
    client = CheckpointClient(server.url, file_bytes=MIB)
    client.save(_state(1), "edit/1").wait()
    m = _manifest(server.url, "edit/1")
    files = sorted((Path(server.root) / "runs" / "edit" / "1" / "sessions" / m.session / "files").iterdir())
    for path in files:
        st = path.stat()
        with open(path, "r+b") as f:  # one byte of each file flipped, in place
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # its mtime set back: ctime still moved
    client.save(_state(2), "edit/2").wait()
    assert _manifest(server.url, "edit/2").linked_bytes == 0
    r = _ckptd("verify", "edit/2", "--root", str(server.root))
    assert r.returncode == 0, r.stdout + r.stderr
    assert_bits_equal(_load(client, "edit/2", _state(2)), _state(2))
    r = _ckptd("verify", "edit/1", "--root", str(server.root))
    assert r.returncode == 1  # the edit is there, and verify says so
    client.close()


def test_chunks_that_keep_changing_are_not_hashed_in_the_stall(server, monkeypatch):
    """A state whose every tensor changes at every save (full training): from the third save on, the
    stall copies without hashing anything in place (only chunks unchanged at the last save are), so
    incremental saves add nothing to the stall of a state with nothing frozen; the result is the same."""
    import ckptd_client._save as save_mod

    hashed: list[int] = []
    real = save_mod.digest_source
    monkeypatch.setattr(save_mod, "digest_source", lambda t: hashed.append(t.numel()) or real(t))
    client = CheckpointClient(server.url, file_bytes=MIB)
    states = [{"model": {"w": torch.full((256, 256), float(s)), "b": torch.full((64,), float(s))}} for s in range(4)]
    counts = []
    for s, sd in enumerate(states):
        hashed.clear()
        client.save(sd, f"moving/{s}").wait()
        counts.append(len(hashed))
    assert counts == [0, 2, 0, 0], counts  # save 1: nothing known; save 2: unknown whether they change
    for s, sd in enumerate(states):
        assert_bits_equal(_load(client, f"moving/{s}", sd), sd)
    assert all(_manifest(server.url, f"moving/{s}").linked_bytes == 0 for s in range(4))
    client.close()


def _stored_bytes(root: Path, m: Manifest) -> int:
    """The bytes under the checkpoint's session directory, each inode once (a linked file is a hard link)."""
    seen: dict[tuple[int, int], int] = {}
    for p in (Path(root) / "runs" / m.run / m.name / "sessions" / m.session).rglob("*"):
        if p.is_file():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_one_unchanged_scalar_never_pins_the_earlier_file(server):
    """The reported case: a large tensor that changes at every save beside a 4-byte scalar that never
    does. Linking the earlier file for the scalar kept the whole earlier file alive at every save (the
    checkpoint stored twice the state). Now the scalar is written again at the second save, apart
    from the changed tensor, and from the third on its own file is linked: each checkpoint stores
    about the state once, ``ckptd show`` and the web view report the scalar's 4 bytes as unchanged,
    every manifest passes the commit's rule, and every step loads bit for bit."""
    from ckptd.store.links import check_links

    client = CheckpointClient(server.url)
    states = [{"model": {"big": torch.randn(256 * 1024, generator=torch.Generator().manual_seed(s)),
                         "scale": torch.tensor([0.5])}} for s in range(1, 5)]
    state_bytes = (256 * 1024 + 1) * 4
    for s, sd in enumerate(states, start=1):
        client.save(sd, f"scalar/{s}").wait()
    for s in range(1, 5):
        m = _manifest(server.url, f"scalar/{s}")
        check_links(m)
        stored = _stored_bytes(server.root, m)
        assert stored < 1.1 * state_bytes, (s, stored, state_bytes)  # pinned: about 2x from the second save on
        assert m.unchanged_bytes == (4 if s >= 3 else 0), (s, m.unchanged_bytes)
        assert m.linked_bytes == (64 if s >= 3 else 0), (s, m.linked_bytes)  # the scalar's slot, not the big file
    r = _ckptd("show", "scalar/4", "--root", str(server.root))
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("written"))
    assert "unchanged 4 B in 1 file (64 B) linked from scalar/3" in line, line
    rows = httpx.get(f"{server.url}/v1/ui/runs/scalar/checkpoints", timeout=10).json()["items"]
    assert {r["name"]: r["stats"]["unchanged_bytes"] for r in rows} == {"1": 0, "2": 0, "3": 4, "4": 4}
    for s, sd in enumerate(states, start=1):
        assert_bits_equal(_load(client, f"scalar/{s}", sd), sd, f"scalar/{s}")
    client.close()


def test_retention_deletes_the_source_of_a_link_and_the_newer_checkpoint_loads(unleased):
    """Step 1 full, step 2 linking step 1's file; ``ckptd gc --keep-last 1`` deletes step 1: the bytes
    step 2 uses stay (its link is its own hard link), and step 2 loads bit for bit and verifies."""
    server = unleased
    client = CheckpointClient(server.url)
    states = [_state(1), _state(2)]
    for s, sd in enumerate(states, start=1):
        client.save(sd, f"keep/{s}").wait()
    m = _manifest(server.url, "keep/2")
    linked = [e.linked for e in m.files.values() if e.linked is not None]
    assert linked and all(x.startswith("1/") for x in linked), m.files
    r = _ckptd("gc", "keep", "--keep-last", "1", "--root", str(server.root))
    assert r.returncode == 0 and "deleted keep/1" in r.stdout, r.stdout + r.stderr
    assert [c["name"] for c in httpx.get(f"{server.url}/v1/runs/keep/checkpoints").json()] == ["2"]
    assert not (Path(server.root) / "runs" / "keep" / "1" / "sessions").exists()
    assert_bits_equal(_load(client, "keep/2", states[1]), states[1], "keep/2 after its source was deleted")
    r = _ckptd("verify", "keep/2", "--root", str(server.root))
    assert r.returncode == 0, r.stdout + r.stderr
    client.close()
