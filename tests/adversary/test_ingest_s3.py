"""Attacks on direct uploads to an S3 root: a write capability must not outlive its purpose.

A real ``ckptd serve --root s3://...`` on the suite's moto server. The promise (docs/guarantees.md
§3): no key that a visible manifest references can be written again, through the service or
through anything it handed out. A presigned ``PutObject`` URL signs ``If-None-Match: *`` (the store
creates the object once), a multipart upload is completed by the service with ``If-None-Match: *``
(its part URLs then name an upload that no longer exists), and a file is presigned once.

Attacks, each with a valid write token over raw HTTP: the single-PUT URL replayed with its signed
headers after the commit, with other bytes; a part URL of a multipart upload replayed after the
commit; a second presign of a file (other bytes declared, and the same); a presign of a file already
uploaded through the service. After each, the committed checkpoint still verifies and loads. With
the service's default settings, a rank that asks for a presigned URL anyway gets none.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys

import httpx
import pytest
import xxhash

from ckptd_client import CheckpointClient, InvalidRequest
from ckptd_schemas import error_from_body
from ckptd_schemas.filedigest import StreamDigest
from support import REPO, ServerProcess

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3srv(moto_s3, tmp_path_factory):
    from s3_server import aws_env

    url = moto_s3.url("ingest")
    srv = ServerProcess(url, env={**aws_env(moto_s3.endpoint), "CKPTD_DIRECT_UPLOADS": "true"},  # opted in
                        log=tmp_path_factory.mktemp("ingest") / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(moto_s3, tmp_path_factory):
    """The service on the same store with its default settings: no direct uploads."""
    from s3_server import aws_env

    srv = ServerProcess(moto_s3.url("plain"), env=aws_env(moto_s3.endpoint),
                        log=tmp_path_factory.mktemp("plain") / "server.log").start()
    yield srv
    srv.stop()


def _sha(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


class Save:
    """One raw save of one file (``data``) as a uint8 tensor, through presigned URLs."""

    def __init__(self, srv: ServerProcess, run: str, name: str, data: bytes, part: int = 5 * MiB,
                 offered: bool | None = True) -> None:
        self.http = httpx.Client(base_url=srv.url, timeout=60)
        self.run, self.name, self.data, self.sid = run, name, data, "a" * 32
        self.base = f"/v1/checkpoints/{run}/{name}/sessions"
        r = self.http.post(self.base, json={"session": self.sid, "world_size": 1, "step": int(name),
                                            "direct_uploads": True})
        assert r.status_code == 200 and r.json()["presigned"] is offered, r.text
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
        n = len(self.data)
        index = {"rank": 0, "world_size": 1, "files": ["r0.bin"], "tensors": [{
            "name": "model.blob", "shape": [n], "dtype": "uint8", "group": "model", "chunks": [{
                "kind": "box", "rank": 0, "offsets": [0], "sizes": [n],
                "location": {"file": "r0.bin", "offset": 0, "length": n, "codec": "raw", "raw_length": n,
                             "xxh3": xxhash.xxh3_64_hexdigest(self.data)}}]}]}
        r = self.http.put(f"{self.base}/{self.sid}/ranks/0", json=index)
        assert r.status_code == 200 and r.json()["state"] == "committed", r.text

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


def test_by_default_a_rank_gets_no_url_into_the_store(plain):
    """On the service's default settings a rank asking for direct uploads is offered none, and one that asks
    for a presigned URL anyway is refused (a typed 400 naming the file, no URL); a confirmation of bytes put
    in the store past the service matches no presign and is refused; the rank's bytes then go through the
    service, checked as they arrive, and the checkpoint commits and loads."""
    s = Save(plain, "plain", "1", b"p" * 5000, offered=None)
    r = s.presign()
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 400 and type(err) is InvalidRequest and err.details == {"file": "r0.bin"}, r.text
    assert "direct uploads are off" in err.message and "urls" not in r.json(), r.text
    d = StreamDigest(1 << 20)
    d.update(s.data)
    whole, blocks = d.finish()
    r = s.http.post(f"{s.file}/confirm", json={**s.claim, "xxh3": whole, "block_size": 1 << 20, "blocks": blocks})
    assert r.status_code == 400 and "does not match the file's presign" in r.text, r.text
    r = s.http.put(s.file, content=s.data, headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(s.data)})
    assert r.status_code == 200, r.text
    s.commit()
    s.assert_intact(plain)


def test_a_file_replaced_in_the_store_between_arrival_and_commit_is_refused(plain, moto_s3):
    """Through the service (the default), a file's bytes are checked as they arrive, and the commit confirms
    them by the ETag and size that one listing of the session's files gives (no HEAD of each file), and
    reads no rank's index or records back: it folds them as the index's arrival checked them. Other
    bytes put over a staged file in the store, past the service, have another ETag: the commit refuses
    them naming the file, and the last good checkpoint stays ``latest`` and loads."""
    from adversary.test_arrival import _data, _index, _rows
    from ckptd_schemas.arrival import CHUNKS_HEADER, encode

    http = httpx.Client(base_url=plain.url, timeout=60)

    def save(name: str, data: bytes, swap: bytes | None = None) -> httpx.Response:
        base = f"/v1/checkpoints/swap/{name}/sessions"
        r = http.post(base, json={"session": "s1", "world_size": 1, "step": int(name)})
        assert r.status_code == 200 and r.json()["arrival_checks"] is True, r.text
        declared = encode(_rows(data))
        r = http.put(f"{base}/s1/files/f.bin", content=declared + data,
                     headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data), CHUNKS_HEADER: str(len(declared))})
        assert r.status_code == 200, r.text
        if swap is not None:  # another user of the bucket, past the service
            moto_s3.client().put_object(Bucket=moto_s3.bucket, Key=f"plain/runs/swap/{name}/sessions/s1/files/f.bin",
                                        Body=swap)
        return http.put(f"{base}/s1/ranks/0", json=_index(_rows(data)))

    r = save("1", _data(1))
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    log = moto_s3.log.read_text()
    session = "/ckptd-test/plain/runs/swap/1/sessions/s1"
    commit = log[log.find(f"PUT {session}/ranks/00000/"):log.find("PUT /ckptd-test/plain/runs/swap/1/COMMITTED")]
    assert commit and f"HEAD {session}/files/" not in commit, commit  # the files' stamps: one listing
    for record in ("ranks", "digests", "arrived"):  # as the index's arrival checked them, kept until the commit
        assert f"GET {session}/{record}/" not in commit, (record, commit)
    for other in (_data(3), _data(2)[:-4]):  # other bytes of the same size, and a shorter file
        r = save("2", _data(2), swap=other)
        err = error_from_body(r.json(), r.status_code)
        assert r.status_code == 422 and err.details.get("file") == "f.bin", r.text
        http.delete("/v1/checkpoints/swap/2/sessions/s1")
        assert http.get("/v1/checkpoints/swap/latest").headers["X-Ckptd-Name"] == "1"
    got = http.get("/v1/checkpoints/swap/1/files/f.bin", headers={"Range": f"bytes=0-{len(_data(1)) - 1}"})
    assert got.status_code in (200, 206) and got.content == _data(1)


def _ranks_with_files(srv: ServerProcess, run: str, world: int, sid: str = "s1"):
    """Session ``sid`` of ``run/1`` opened for ``world`` ranks, each rank's file stored (its chunks
    declared ahead of its bytes); a function that PUTs rank r's index."""
    from adversary.test_arrival import _data, _rows
    from ckptd_schemas.arrival import CHUNKS_HEADER, encode

    base = f"{srv.url}/v1/checkpoints/{run}/1/sessions"
    assert httpx.post(base, json={"session": sid, "world_size": world, "step": 1}).status_code == 200
    for r in range(world):
        declared = encode(_rows(_data(r)))
        resp = httpx.put(f"{base}/{sid}/files/f{r}.bin", content=declared + _data(r), timeout=60,
                         headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(_data(r)), CHUNKS_HEADER: str(len(declared))})
        assert resp.status_code == 200, resp.text

    def index(r: int) -> httpx.Response:
        return httpx.put(f"{base}/{sid}/ranks/{r}", timeout=60, json=_index_body(r, world))
    return index


def _index_body(r: int, world: int) -> dict:
    """Rank r's index, of the file ``_ranks_with_files`` stored for it."""
    from adversary.test_arrival import N, _data, _rows

    chunks = [{"kind": "flat", "rank": r, "start": r * N + row.offset // 4, "length": row.length // 4,
               "location": {"file": f"f{r}.bin", "offset": row.offset, "length": row.length, "codec": "raw",
                            "raw_length": row.length, "xxh3": row.xxh3}} for row in _rows(_data(r))]
    return {"rank": r, "world_size": world, "files": [f"f{r}.bin"],
            "tensors": [{"name": "w", "shape": [world * N], "dtype": "int32", "group": "model", "chunks": chunks}]}


def _all_at_once(index, world: int) -> list[httpx.Response]:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        answers = list(pool.map(index, range(world)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    assert any(a.json()["state"] == "committed" for a in answers), [a.json()["state"] for a in answers]
    return answers


def test_indexes_arriving_together_probe_no_rank_stored_here(plain, moto_s3):
    """Sixteen ranks' indexes arrive at once (their files all stored first): each call looks for the first
    rank not yet stored, and a rank whose index this replica stored is not asked of the store again, so
    the HEADs of rank indexes stay about one per call (before, each call probed every rank from the same
    hint: 82 and 176 in two runs here, 1,300 at 64 ranks), and the save commits."""
    world, sid = 16, "s1"
    index = _ranks_with_files(plain, "probe", world, sid)
    start = len(moto_s3.log.read_text())
    _all_at_once(index, world)
    heads = moto_s3.log.read_text()[start:].count(f"HEAD /ckptd-test/plain/runs/probe/1/sessions/{sid}/ranks/")
    assert heads <= 2 * world, heads  # one failing probe a call, and a rank stored meanwhile (82 and 176 before)


def test_indexes_arriving_together_share_the_write_gates_reads(plain, moto_s3):
    """Before each write the gate reads the session's record, the marker and the refusal record; sixteen
    indexes arriving at once share reads begun after they arrived: the session's record is read a few
    times, not once per index (2 here; 16 before), the indexes are stored in a few objects (16 before),
    and the save commits."""
    world, sid = 16, "s1"
    index = _ranks_with_files(plain, "gate", world, sid)
    start = len(moto_s3.log.read_text())
    _all_at_once(index, world)
    log = moto_s3.log.read_text()[start:]
    reads = log.count(f"GET /ckptd-test/plain/runs/gate/1/sessions/{sid}/SESSION.json")
    assert reads <= world // 2, reads
    puts = log.count(f"PUT /ckptd-test/plain/runs/gate/1/sessions/{sid}/ranks/")  # stored together, not one a rank
    assert 1 <= puts <= world // 2, puts


def test_a_commit_that_reads_no_byte_lists_the_files_once(plain, moto_s3):
    """Every file checked as it arrived: the commit confirms each by its stamp from one listing of the
    session's files, and reads none of them, so it does not list them again after (a LIST per 1,000
    files, on the commit's path)."""
    world, sid = 4, "s1"
    index = _ranks_with_files(plain, "stamps", world, sid)
    start = len(moto_s3.log.read_text())
    _all_at_once(index, world)
    log = moto_s3.log.read_text()[start:]
    marker = log.index("PUT /ckptd-test/plain/runs/stamps/1/COMMITTED")
    log = log[:marker]  # the commit's requests (the re-read after the marker reads every file)
    folder = "list-type=2&prefix=plain/runs/stamps/1/sessions/s1/files/"
    listings = [line for line in log.splitlines() if folder in line]
    assert len(listings) == 1, listings
    assert "GET /ckptd-test/plain/runs/stamps/1/sessions/s1/files/" not in log  # no byte read back
