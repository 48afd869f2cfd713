"""Attacks on the ingest contract on a local root: every way into a checkpoint ends as a write-once
file of the session whose bytes the commit reads and checks after the last write anyone could make.

The promise (docs/guarantees.md §3): no stored file of a session is written twice, through the
service or otherwise; a record made once (a linked file's digests) is never trusted later without
the bytes. Each attack goes over raw HTTP to a real ``ckptd serve`` with a valid token, and edits the
root where the attacker is the root's editor; every refusal is typed, nothing becomes visible, and
the last good checkpoint still loads (``Env.assert_invisible``).

Attacks: a file re-uploaded into its session with other bytes (and the same bytes, which is a
retry, answered as before); a linked file edited in the root between the link and the commit
(rewritten in place, or its bytes changed with the mtime set back); a digest record that a second
link or upload would replace.
"""

from __future__ import annotations

import json
import os

import pytest

from ckptd_schemas import linked_name

from adversary.test_commit_checks import W, Env, _chunk, _index, _rows, _tensor, h


def _stored_files(env: Env, name: str) -> dict[str, int]:
    m = env.http.get(f"/v1/checkpoints/{env.run}/{name}")
    assert m.status_code == 200, m.text
    return {f: e["size"] for f, e in m.json()["files"].items()}


def _path_of(env: Env, name: str, file: str):
    (sid,) = os.listdir(env.root / "runs" / env.run / name / "sessions")
    return env.root / "runs" / env.run / name / "sessions" / sid / "files" / file


def test_a_stored_file_is_never_replaced_by_a_second_upload(env):
    """The first upload of ``r0.bin`` is stored; a second one with other bytes is refused (409) and the
    stored bytes stay; the same bytes again (a retry whose answer was lost) are answered as before."""
    a, b = _rows(0, 4), bytes(reversed(_rows(0, 4)))
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", a)
    r = env.http.put(f"/v1/checkpoints/{env.run}/2/sessions/s/files/r0.bin", content=b,
                     headers={"X-Ckptd-Xxh3": h(b)})
    assert r.status_code == 409 and r.json()["error"]["details"]["file"] == "r0.bin", r.text
    assert (env.root / "runs" / env.run / "2" / "sessions" / "s" / "files" / "r0.bin").read_bytes() == a
    env.upload("2", "s", "r0.bin", a)  # idempotent
    r = env.put_index("2", "s", _index(0, 1, [_tensor(W, [4, 3], [_chunk(0, "r0.bin", a, offsets=[0, 0],
                                                                             sizes=[4, 3])])], ["r0.bin"]))
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def _link(env: Env, name: str, sid: str, source: str, file: str) -> str:
    linked = linked_name(source, file)
    r = env.http.post(f"/v1/checkpoints/{env.run}/{name}/sessions/{sid}/files/{linked}/link",
                      json={"checkpoint": source, "file": file})
    assert r.status_code == 200, r.text
    return linked


@pytest.mark.parametrize("case", ["rewritten", "mtime-set-back"])
def test_a_linked_file_edited_in_the_root_before_the_commit_is_refused(env, case):
    """Step 2 links step 1's data file (a hard link: one inode). The root's editor then changes a
    byte of it before step 2's index arrives; the index describes the file as step 1's commit
    checked it. The commit reads the linked file like any other and refuses it; restored, step 1
    loads again."""
    (file, size), *_ = sorted(_stored_files(env, "1").items())
    path = _path_of(env, "1", file)
    original = path.read_bytes()
    env.open("2", "s", 1)
    linked = _link(env, "2", "s", "1", file)
    st = path.stat()
    edited = bytearray(original)
    edited[size // 2] ^= 0xFF
    with open(path, "r+b") as f:  # in place: the link shares the inode
        f.write(edited)
    if case == "mtime-set-back":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_mtime_ns == st.st_mtime_ns
    index = _index(0, 1, [_tensor("model.blob", [size], [_chunk(0, linked, original, offsets=[0], sizes=[size])],
                                  dtype="uint8")], [linked])
    r = env.put_index("2", "s", index)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "checksum_mismatch" and "refused at commit" in err["message"], err
    assert err["details"]["file"] == linked, err
    with open(path, "r+b") as f:
        f.write(original)
    env.assert_invisible("2", "s")


def test_an_unchanged_linked_file_commits_and_verifies(env):
    """The same link with the file left alone commits: the commit read it, and ``latest`` is step 2."""
    (file, size), *_ = sorted(_stored_files(env, "1").items())
    original = _path_of(env, "1", file).read_bytes()
    env.open("2", "s", 1)
    linked = _link(env, "2", "s", "1", file)
    index = _index(0, 1, [_tensor("model.blob", [size], [_chunk(0, linked, original, offsets=[0], sizes=[size])],
                                  dtype="uint8")], [linked])
    r = env.put_index("2", "s", index)
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    rec = json.loads((env.root / "runs" / env.run / "2" / "VERIFIED.json").read_bytes())
    assert rec["ok"] and rec["bytes_read"] == size, rec  # the commit's check read the linked bytes: recorded


def test_a_recorded_file_cannot_be_replaced_by_a_link(env):
    """``r0.bin`` was uploaded under the linked file's name; a link onto that name is refused and the
    upload's bytes and record stay."""
    (file, _), *_ = sorted(_stored_files(env, "1").items())
    linked = linked_name("1", file)
    data = _rows(0, 4)
    env.open("2", "s", 1)
    env.upload("2", "s", linked, data)
    r = env.http.post(f"/v1/checkpoints/{env.run}/2/sessions/s/files/{linked}/link",
                      json={"checkpoint": "1", "file": file})
    assert r.status_code in (400, 409), r.text
    assert (env.root / "runs" / env.run / "2" / "sessions" / "s" / "files" / linked).read_bytes() == data
