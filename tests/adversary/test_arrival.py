"""Bytes checked where they arrive, confirmed by identity at the commit, re-read after the marker.

Against a real ``ckptd serve`` on a local root, through the wire protocol a rank speaks: a file sent with
its chunks declared ahead of its bytes (``X-Ckptd-Chunks``, ``ckptd_schemas.arrival``), then the rank's
index. As an attacker with a valid token, or with write access to the root while the service runs:

* a declared digest that its bytes do not hash to is refused with the upload, naming the tensor, and
  nothing of the file is stored; so is a declaration that is not one;
* an index whose chunks differ from what was declared (a false digest where the declaration was true)
  is refused at the commit, which reads that file back;
* a staged file edited in place (its mtime put back), replaced, truncated or extended between its
  arrival and the commit is refused at the commit, and ``latest`` stays the last good checkpoint;
* the commit of declared files reads none of their bytes (``ckptd_commit_checked_bytes_total``), the checkpoint is
  ``pending`` until the independent re-read after the marker records it ``verified``, and a byte
  flipped right after the marker is found by that re-read: recorded known bad, ``latest`` moves on
  to the last good checkpoint, which still loads;
* ``CKPTD_VERIFY_BEFORE_VISIBLE``: the commit reads every byte before its marker, and the checkpoint
  is verified when its commit answers;
* a file linked from a checked checkpoint (an incremental save) rests on that check: the commit reads
  none of it while its rows are the source's; one replaced, truncated, extended or edited between
  the link and the commit is refused, and one whose source was found bad meanwhile is read back.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import xxhash

from adversary.test_requests import _auth, _metric, _server
from ckptd_schemas import linked_name
from ckptd_schemas.arrival import CHUNKS_HEADER, Declared, encode
from support import scaled

N = 4096  # int32 elements of tensor w, in two chunks of one file


def _data(seed: int) -> bytes:
    return b"".join(((seed * 7919 + i) % (1 << 31)).to_bytes(4, "little") for i in range(N))


def _rows(data: bytes) -> list[Declared]:
    half = len(data) // 2
    return [Declared(0, half, xxhash.xxh3_64_hexdigest(data[:half]), "raw", half, "tensor", "w"),
            Declared(half, half, xxhash.xxh3_64_hexdigest(data[half:]), "raw", half, "tensor", "w")]


def _index(rows: list[Declared], file: str = "f.bin") -> dict:
    chunks = [{"kind": "flat", "rank": 0, "start": r.offset // 4, "length": r.length // 4,
               "location": {"file": file, "offset": r.offset, "length": r.length, "codec": "raw",
                            "raw_length": r.length, "xxh3": r.xxh3}} for r in rows]
    return {"rank": 0, "world_size": 1, "files": [file],
            "tensors": [{"name": "w", "shape": [N], "dtype": "int32", "group": "model", "chunks": chunks}]}


def _open(url: str, name: str, step: int) -> dict:
    r = httpx.post(f"{url}/v1/checkpoints/r/{name}/sessions", headers=_auth(),
                   json={"session": "s1", "world_size": 1, "step": step})
    assert r.status_code == 200, r.text
    return r.json()


def _put(url: str, name: str, data: bytes, declared: bytes | None) -> httpx.Response:
    headers = {**_auth(), "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)}
    if declared is not None:
        headers[CHUNKS_HEADER] = str(len(declared))
    return httpx.put(f"{url}/v1/checkpoints/r/{name}/sessions/s1/files/f.bin", headers=headers,
                     content=(declared or b"") + data, timeout=60)


def _index_put(url: str, name: str, rows: list[Declared], file: str = "f.bin") -> httpx.Response:
    return httpx.put(f"{url}/v1/checkpoints/r/{name}/sessions/s1/ranks/0", json=_index(rows, file), headers=_auth(),
                     timeout=60)


def _save(url: str, name: str, step: int, data: bytes) -> None:
    """A checkpoint of ``data``, its chunks declared: committed."""
    assert _open(url, name, step)["arrival_checks"] is True
    assert _put(url, name, data, encode(_rows(data))).status_code == 200
    r = _index_put(url, name, _rows(data))
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def _staged(root: Path, name: str, file: str = "f.bin") -> Path:
    return root / "runs" / "r" / name / "sessions" / "s1" / "files" / file


def _verification(url: str, name: str, wait: float) -> dict | None:
    deadline = time.monotonic() + scaled(wait)
    while True:
        r = httpx.get(f"{url}/v1/checkpoints/r/{name}/verification", headers=_auth(), timeout=10)
        if r.status_code == 200 or time.monotonic() > deadline:
            return r.json() if r.status_code == 200 else None
        time.sleep(0.1)


def _latest(url: str) -> str:
    r = httpx.get(f"{url}/v1/checkpoints/r/latest", headers=_auth(), timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["X-Ckptd-Name"]


def _loads(url: str, name: str, data: bytes) -> bool:
    r = httpx.get(f"{url}/v1/checkpoints/r/{name}/files/f.bin", headers={**_auth(), "Range": f"bytes=0-{len(data) - 1}"},
                  timeout=30)
    return r.status_code in (200, 206) and r.content == data


def test_what_a_declaration_gets_wrong_is_refused_with_the_upload(tmp_path):
    srv = _server(tmp_path).start()
    try:
        data = _data(1)
        _open(srv.url, "1", 1)
        rows = _rows(data)
        lying = [rows[0], rows[1]._replace(xxh3="0123456789abcdef")]
        r = _put(srv.url, "1", data, encode(lying))
        assert r.status_code == 422 and r.json()["error"]["code"] == "checksum_mismatch", r.text
        err = r.json()["error"]
        assert err["details"]["tensor"] == "w" and "refused on arrival" in err["message"], err
        assert not _staged(tmp_path / "root", "1").exists()  # nothing of it stored
        for bad in (b"{", b'{"rows": 1}', b'[[0, 1, "zz", "raw", 1, "tensor", "w"]]',
                    b'[[0, 4, "0123456789abcdef", "raw", 5, "tensor", "w"]]'):
            r = _put(srv.url, "1", data, bad)
            assert r.status_code == 400 and r.json()["error"]["details"]["file"] == "f.bin", r.text
        r = httpx.put(f"{srv.url}/v1/checkpoints/r/1/sessions/s1/files/f.bin", content=b"[]",
                      headers={**_auth(), "X-Ckptd-Xxh3": "0" * 16, CHUNKS_HEADER: "100"})
        assert r.status_code == 400 and r.json()["error"]["details"]["field"] == CHUNKS_HEADER, r.text
        # the true declaration goes through; an index that then differs from it is read back and refused
        assert _put(srv.url, "1", data, encode(rows)).status_code == 200
        r = _index_put(srv.url, "1", [rows[0], rows[1]._replace(xxh3="0123456789abcdef")])
        assert r.status_code == 422 and r.json()["error"]["code"] == "checksum_mismatch", r.text
        assert "refused at commit" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def _edit_in_place(path: Path) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back: the ctime moved


def _replace(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    tmp = path.with_name("planted")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 4)


def _extend(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 4)


CHANGES = {"edited": _edit_in_place, "replaced": _replace, "truncated": _truncate, "extended": _extend}


def test_a_staged_file_changed_between_arrival_and_commit_is_refused(tmp_path):
    srv = _server(tmp_path).start()
    try:
        good = _data(1)
        _save(srv.url, "1", 1, good)
        for step, (how, change) in enumerate(CHANGES.items(), start=2):
            data = _data(step)
            _open(srv.url, how, step)
            assert _put(srv.url, how, data, encode(_rows(data))).status_code == 200
            change(_staged(tmp_path / "root", how))
            r = _index_put(srv.url, how, _rows(data))
            assert r.status_code == 422 and r.json()["error"]["code"] in ("checksum_mismatch", "integrity"), (how, r.text)
            assert "refused at commit" in r.json()["error"]["message"], (how, r.text)
            assert _latest(srv.url) == "1" and _loads(srv.url, "1", good), how
    finally:
        srv.stop()


def test_the_commit_reads_nothing_declared_and_the_reread_after_the_marker_finds_a_flip(tmp_path):
    srv = _server(tmp_path).start()
    try:
        good, data = _data(1), _data(2)
        # Two saves at once on a fresh service: their re-reads wait for the worker process to start (a new
        # interpreter importing the checker: hundreds of milliseconds), while the byte below is flipped
        # within a millisecond of the second commit's answer.
        _save(srv.url, "1", 1, good)
        _save(srv.url, "2", 2, data)
        with open(_staged(tmp_path / "root", "2"), "r+b") as f:  # right after the marker, before the re-read
            f.seek(8000)
            b = f.read(1)
            f.seek(8000)
            f.write(bytes([b[0] ^ 1]))
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="on arrival"}') == 2 * len(good)
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="read back"}') == 0
        assert _verification(srv.url, "1", 60)["ok"] is True  # the re-read after its marker
        rec = _verification(srv.url, "2", 60)
        assert rec is not None and rec["ok"] is False and "f.bin" in rec["problems"][0], rec
        assert _latest(srv.url) == "1" and _loads(srv.url, "1", good)
        ls = httpx.get(f"{srv.url}/v1/runs/r/checkpoints", headers=_auth()).json()
        assert {c["name"]: c["status"] for c in ls} == {"1": "verified", "2": "known bad"}, ls
    finally:
        srv.stop()


def test_verify_before_visible_reads_every_byte_before_the_marker(tmp_path):
    srv = _server(tmp_path, CKPTD_VERIFY_BEFORE_VISIBLE="1").start()
    try:
        data = _data(3)
        _save(srv.url, "1", 1, data)
        rec = httpx.get(f"{srv.url}/v1/checkpoints/r/1/verification", headers=_auth()).json()  # no waiting
        assert rec["ok"] is True and rec["bytes_read"] == len(data), rec
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="read back"}') == len(data)
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="on arrival"}') == 0
    finally:
        srv.stop()


def _link(url: str, name: str, step: int, source: str, data: bytes) -> tuple[str, dict]:
    """Checkpoint ``source`` of ``data`` saved and verified, then a session of ``name`` holding its
    ``f.bin``, linked: the linked file's name and the source's verification record."""
    _save(url, source, step - 1, data)
    rec = _verification(url, source, 60)
    assert rec["ok"] is True
    _open(url, name, step)
    file = linked_name(source, "f.bin")
    r = httpx.post(f"{url}/v1/checkpoints/r/{name}/sessions/s1/files/{file}/link", headers=_auth(),
                   json={"checkpoint": source, "file": "f.bin"}, timeout=30)
    assert r.status_code == 200, r.text
    return file, rec


@pytest.mark.slow
def test_a_linked_file_rests_on_its_source_check_and_is_refused_when_changed(tmp_path):
    srv = _server(tmp_path).start()
    data = _data(1)
    try:
        file, _ = _link(srv.url, "2", 2, "1", data)
        r = _index_put(srv.url, "2", _rows(data), file)
        assert r.status_code == 200 and r.json()["state"] == "committed", r.text
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="read back"}') == 0
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="on arrival"}') == 2 * len(data)
        assert _verification(srv.url, "2", 60)["ok"] is True  # the re-read after the marker read it
        # changed between the link and the commit: each from a source of its own (a hard link moves the
        # shared inode's ctime, so a source's record vouches for one link)
        for step, how in enumerate(("replaced", "truncated", "extended", "edited"), start=3):
            file, _ = _link(srv.url, how, 2 * step, f"src-{how}", data)
            CHANGES[how](_staged(tmp_path / "root", how, file))
            r = _index_put(srv.url, how, _rows(data), file)
            assert r.status_code == 422 and "refused at commit" in r.json()["error"]["message"], (how, r.text)
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="on arrival"}') == 6 * len(data)
    finally:
        srv.stop()


def test_a_link_whose_source_is_found_bad_before_the_commit_is_read_back(tmp_path):
    srv = _server(tmp_path).start()
    data = _data(1)
    try:
        file, rec = _link(srv.url, "2", 2, "1", data)
        # what a re-read of checkpoint 1 records when it finds a byte rotted in place (no stamp moves)
        rec.update(ok=False, problems=["file 'f.bin': chunk of tensor 'w' hashes to 0000000000000000"])
        (tmp_path / "root" / "runs" / "r" / "1" / "VERIFIED.json").write_text(json.dumps(rec))
        r = _index_put(srv.url, "2", _rows(data), file)
        assert r.status_code == 200 and r.json()["state"] == "committed", r.text
        assert _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="read back"}') == len(data)
    finally:
        srv.stop()
