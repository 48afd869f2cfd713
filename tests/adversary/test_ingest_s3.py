"""Attacks on direct uploads to an S3 root: a write capability must not outlive its purpose.

A real ``ckptd serve --root s3://...`` on the suite's moto server. The promise (docs/guarantees.md
§3): no key that a visible manifest references can be written again, through the service or
through anything it handed out. A presigned ``PutObject`` URL signs ``If-None-Match: *`` (the store
creates the object once), a multipart upload is completed by the service with ``If-None-Match: *``
(its part URLs then name an upload that no longer exists), and a file is presigned once.

Attacks, each with a valid write token over raw HTTP: the single-PUT URL replayed with its signed
headers after the commit, with other bytes; a part URL of a multipart upload replayed after the
commit; a second presign of a file (other bytes declared, and the same); a presign of a file already
uploaded through the service. After each, the committed checkpoint still verifies and loads.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import time

import httpx
import pytest
import xxhash

from ckptd_client import CheckpointClient
from ckptd_schemas.filedigest import StreamDigest
from support import REPO, ServerProcess, scaled

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3srv(moto_s3, tmp_path_factory):
    from s3_server import aws_env

    url = moto_s3.url("ingest")
    srv = ServerProcess(url, env=aws_env(moto_s3.endpoint), log=tmp_path_factory.mktemp("ingest") / "server.log")
    srv.start()
    yield srv
    srv.stop()


def _behind_proxy(moto_s3, tmp_path_factory, checksums: str):
    """A service on its own root, reaching moto through a proxy with ``checksums`` (``FaultProxy``)."""
    from s3_server import FaultProxy, aws_env

    with FaultProxy(moto_s3, checksums=checksums) as proxy:
        srv = ServerProcess(moto_s3.url(f"ingest-{checksums}"), env=aws_env(proxy.endpoint),
                            log=tmp_path_factory.mktemp(checksums) / "server.log").start()
        yield srv
        srv.stop()


@pytest.fixture(scope="module")
def enforced(moto_s3, tmp_path_factory):
    """The service on a store that enforces the checksums signed into its URLs, as AWS S3 does."""
    yield from _behind_proxy(moto_s3, tmp_path_factory, "enforced")


@pytest.fixture(scope="module")
def kept(moto_s3, tmp_path_factory):
    """The service on a store that keeps whatever checksum a PUT claims and checks none."""
    yield from _behind_proxy(moto_s3, tmp_path_factory, "kept")


def _sha(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


class Save:
    """One raw save of one file (``data``) as a uint8 tensor, through presigned URLs."""

    def __init__(self, srv: ServerProcess, run: str, name: str, data: bytes, part: int = 5 * MiB) -> None:
        self.http = httpx.Client(base_url=srv.url, timeout=60)
        self.run, self.name, self.data, self.sid = run, name, data, "a" * 32
        self.base = f"/v1/checkpoints/{run}/{name}/sessions"
        r = self.http.post(self.base, json={"session": self.sid, "world_size": 1, "step": int(name),
                                            "direct_uploads": True})
        assert r.status_code == 200, r.text
        self.offered = r.json()["presigned"]  # direct uploads offered (a store shown to enforce checksums)
        self.file = f"{self.base}/{self.sid}/files/r0.bin"
        self.parts = [data[i:i + part] for i in range(0, len(data), part)] or [b""]
        self.claim = {"size": len(data), "part_size": part, "sha256": [_sha(p) for p in self.parts]}

    def presign(self, claim: dict | None = None) -> httpx.Response:
        return self.http.post(f"{self.file}/presign", json=claim or self.claim)

    def put_all(self, signed: dict) -> list[str]:
        etags = []
        for url, headers, part in zip(signed["urls"], signed["headers"], self.parts):
            r = httpx.put(url, content=part, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            etags.append(r.headers["ETag"])
        return etags

    def confirm(self, signed: dict, etags: list[str]) -> None:
        d = StreamDigest(signed["block_size"])
        d.update(self.data)
        whole, blocks = d.finish()
        r = self.http.post(f"{self.file}/confirm", json={
            **self.claim, "upload_id": signed["upload_id"], "etags": etags if signed["upload_id"] else [],
            "xxh3": whole, "block_size": signed["block_size"], "blocks": blocks})
        assert r.status_code == 200, r.text

    def commit(self) -> None:
        r = self.put_index()
        assert r.status_code == 200 and r.json()["state"] == "committed", r.text

    def put_index(self, xxh3: str | None = None) -> httpx.Response:
        """The rank's index: its one chunk's digest ``xxh3``, that of ``data`` unless given."""
        n = len(self.data)
        index = {"rank": 0, "world_size": 1, "files": ["r0.bin"], "tensors": [{
            "name": "model.blob", "shape": [n], "dtype": "uint8", "group": "model", "chunks": [{
                "kind": "box", "rank": 0, "offsets": [0], "sizes": [n],
                "location": {"file": "r0.bin", "offset": 0, "length": n, "codec": "raw", "raw_length": n,
                             "xxh3": xxh3 or xxhash.xxh3_64_hexdigest(self.data)}}]}]}
        return self.http.put(f"{self.base}/{self.sid}/ranks/0", json=index)

    def assert_intact(self, srv: ServerProcess) -> None:
        """The checkpoint verifies (``ckptd verify --server``) and loads its own bytes."""
        import torch

        out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", f"{self.run}/{self.name}",
                              "--server", srv.url], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        got = {"model": {"blob": torch.zeros(len(self.data), dtype=torch.uint8)}}
        with CheckpointClient(srv.url) as c:
            c.load(got, f"{self.run}/{self.name}")
        assert bytes(got["model"]["blob"].numpy()) == self.data


def test_a_presigned_put_replayed_after_the_commit_is_refused_by_the_store(s3srv):
    data = bytes(range(256)) * 64
    s = Save(s3srv, "replay", "1", data)
    signed = s.presign().json()
    assert signed["headers"][0]["If-None-Match"] == "*"
    s.confirm(signed, s.put_all(signed))
    s.commit()
    other = bytes(reversed(data))
    for body in (other, data):  # other bytes (the signed SHA-256 is moto's to check, not ours), and the same
        r = httpx.put(signed["urls"][0], content=body, headers=signed["headers"][0], timeout=60)
        assert r.status_code == 412, (r.status_code, r.text)
    s.assert_intact(s3srv)


def test_a_part_url_replayed_after_the_commit_writes_nothing(s3srv):
    data = bytes(range(251)) * (11 * MiB // 251)  # 3 parts of 5 MiB: one multipart upload
    s = Save(s3srv, "replay", "2", data)
    signed = s.presign().json()
    assert signed["upload_id"] is not None and len(signed["urls"]) == 3
    s.confirm(signed, s.put_all(signed))
    s.commit()
    r = httpx.put(signed["urls"][1], content=s.parts[1], headers=signed["headers"][1], timeout=60)
    assert r.status_code >= 400, (r.status_code, r.text)  # S3: 404 NoSuchUpload (moto answers 500)
    s.assert_intact(s3srv)


def test_a_file_is_presigned_once(s3srv):
    data = b"y" * 4000
    s = Save(s3srv, "twice", "1", data)
    assert s.presign().status_code == 200
    other = {**s.claim, "sha256": [_sha(b"z" * 4000)]}
    for claim in (other, s.claim):
        r = s.presign(claim)
        assert r.status_code == 409 and "presigned once" in r.json()["error"]["message"], r.text
    # a file uploaded through the service cannot be presigned afterwards either
    up = s.http.put(f"{s.base}/{s.sid}/files/r1.bin", content=data,
                    headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert up.status_code == 200, up.text
    r = s.http.post(f"{s.base}/{s.sid}/files/r1.bin/presign", json=s.claim)
    assert r.status_code == 409, r.text


def test_an_upload_through_the_service_does_not_replace_a_presigned_object(s3srv):
    """The URL's object is in place (not confirmed yet); a second way in, the service's own upload of
    the same file with other bytes, is refused, and the presigned bytes are what the commit checks."""
    data = b"q" * 3000
    s = Save(s3srv, "twoways", "1", data)
    signed = s.presign().json()
    etags = s.put_all(signed)
    other = b"r" * 3000
    up = s.http.put(s.file, content=other, headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(other)})
    assert up.status_code == 409, up.text
    s.confirm(signed, etags)
    s.commit()
    s.assert_intact(s3srv)


# -- what the store checks as the bytes arrive -------------------------------------------------------

def _checked(srv: ServerProcess) -> tuple[float, float]:
    """The data bytes the service's commits read back, and confirmed as checked on arrival (by the store)."""
    from adversary.test_requests import _metric

    return (_metric(srv.url, 'ckptd_commit_checked_bytes_total{how="read back"}'),
            _metric(srv.url, 'ckptd_commit_checked_bytes_total{how="on arrival"}'))


def _refused_at_commit(s: Save) -> None:
    r = s.put_index()
    assert r.status_code == 422 and "refused at commit" in r.json()["error"]["message"], r.text
    names = [c["name"] for c in s.http.get(f"/v1/runs/{s.run}/checkpoints").json()]
    assert s.name not in names, names


def test_a_store_that_enforces_signed_checksums_refuses_other_bytes_and_the_commit_reads_none(enforced):
    """The store refuses a PUT of bytes other than the URL's signed SHA-256, so nothing of it is stored and
    the checkpoint cannot commit; what the store took, one PUT or parts, the commit confirms by its stored
    checksum and identity without reading a byte, and the re-read after the marker checks it."""
    before = _checked(enforced)
    good = Save(enforced, "enforced", "1", bytes(range(251)) * (11 * MiB // 251))  # 3 parts: a multipart upload
    one = Save(enforced, "enforced", "2", b"s" * 5000)  # one PUT
    for s in (good, one):
        s.confirm(signed := s.presign().json(), s.put_all(signed))
        s.commit()
    assert good.offered is True
    read, arrived = (a - b for a, b in zip(_checked(enforced), before))
    assert (read, arrived) == (0, len(good.data) + len(one.data))
    good.assert_intact(enforced)

    s = Save(enforced, "enforced", "3", b"t" * 5000)
    signed = s.presign().json()
    r = httpx.put(signed["urls"][0], content=b"u" * 5000, headers=signed["headers"][0], timeout=60)
    assert r.status_code == 400 and "BadDigest" in r.text, r.text  # the store's refusal
    r = s.http.post(f"{s.file}/confirm", json={**s.claim, "xxh3": "0" * 16, "block_size": signed["block_size"],
                                                "blocks": ["0" * 16]})
    assert r.status_code == 400 and "nothing was uploaded" in r.text, r.text
    r = s.put_index()
    assert r.status_code == 422 and "was not uploaded" in r.text, r.text
    assert [c["name"] for c in s.http.get("/v1/runs/enforced/checkpoints").json()] == ["1", "2"]


def test_on_an_enforcing_store_an_object_its_urls_did_not_make_is_read_back_and_refused(enforced, moto_s3):
    """A holder of the bucket's credentials (or anything that writes past the URLs) puts other bytes at a
    presigned file's key, before its confirmation (no checksum the URLs signed is kept for it) or after
    (its identity is not the one confirmed): the commit reads the file back and refuses it."""
    c = moto_s3.client()  # straight to the store, not through the checksum-enforcing front
    for name, before in (("4", True), ("5", False)):
        s = Save(enforced, "bypass", name, b"v" * 5000)
        signed = s.presign().json()
        key = f"ingest-enforced/runs/bypass/{name}/sessions/{s.sid}/files/r0.bin"
        if before:
            c.put_object(Bucket=moto_s3.bucket, Key=key, Body=b"w" * 5000)
            s.confirm(signed, [])
        else:
            s.confirm(signed, s.put_all(signed))
            c.put_object(Bucket=moto_s3.bucket, Key=key, Body=b"w" * 5000)
        _refused_at_commit(s)


def test_on_an_enforcing_store_a_false_chunk_digest_is_found_by_the_reread_after_the_marker(enforced):
    """The store vouches that the bytes are those its writer hashed with SHA-256, not for the chunk digests
    the writer's index gives them: the commit, which reads none of them, takes a false one, and the re-read
    after the marker finds it, records the checkpoint known bad, and ``latest`` moves on to the last good
    checkpoint, which loads; the bad one, loaded by its name, gives the bytes its writer hashed and no
    others. (Through the service the same lie is refused at the commit.)"""
    good, bad = Save(enforced, "lying", "1", b"g" * 5000), Save(enforced, "lying", "2", b"h" * 5000)
    for s in (good, bad):
        s.confirm(signed := s.presign().json(), s.put_all(signed))
    good.commit()
    r = bad.put_index(xxh3="0123456789abcdef")
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    deadline = time.monotonic() + scaled(60)
    while (st := {c["name"]: c["status"] for c in bad.http.get("/v1/runs/lying/checkpoints").json()}).get("2") \
            == "pending" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert st == {"1": "verified", "2": "known bad"}, st
    assert bad.http.get("/v1/checkpoints/lying/latest").headers["X-Ckptd-Name"] == "1"
    good.assert_intact(enforced)
    import torch

    got = {"model": {"blob": torch.zeros(5000, dtype=torch.uint8)}}
    with CheckpointClient(enforced.url) as c:  # by its name: the bytes its writer hashed, no others
        c.load(got, "lying/2")
    assert bytes(got["model"]["blob"].numpy()) == bad.data


@pytest.mark.parametrize("store", ["s3srv", "kept"])
def test_a_store_that_does_not_enforce_has_direct_uploads_read_back_and_other_bytes_refused(store, request):
    """moto stores a PUT of other bytes than its URL signed; so does a store that keeps (and answers) the
    checksum the PUT claimed without checking it. Neither is trusted (``S3Storage.enforces_checksums``):
    a session is offered no direct uploads, and what a rank uploads by URL anyway the commit reads back,
    refusing other bytes."""
    srv = request.getfixturevalue(store)
    s = Save(srv, "unchecked", "1", b"x" * 5000)
    assert s.offered is None  # the session's answer offers no direct uploads; a rank that presigns anyway:
    signed = s.presign().json()
    r = httpx.put(signed["urls"][0], content=b"y" * 5000, headers=signed["headers"][0], timeout=60)
    assert r.status_code == 200, r.text  # stored
    s.confirm(signed, [])
    _refused_at_commit(s)
    before = _checked(srv)
    s = Save(srv, "unchecked", "2", b"z" * 5000)
    s.confirm(signed := s.presign().json(), s.put_all(signed))
    s.commit()
    assert [a - b for a, b in zip(_checked(srv), before)] == [5000, 0]
