"""Direct uploads on an S3 root: ranks PUT their data files straight into the store with presigned URLs.

A real ``ckptd serve --root s3://...`` on the moto server the suite runs, opted in to direct uploads
(``CKPTD_DIRECT_UPLOADS=true``; off by default). What must hold:

* with the service's default, a default client's save sends every byte through the service (no presign);
* opted in, a default client's save sends no data file through the service (the service's metrics count no
  ``upload_file`` request and no body bytes for them) and loads back bit for bit; ``ckptd verify``
  passes;
* a writer that PUTs other bytes than it declared (moto, unlike S3, does not check the signed
  SHA-256, which makes this the worst case) is refused at the commit: nothing becomes visible, and the
  last good checkpoint stays what ``RUN/latest`` names and loads;
* a confirmation that its presign or the store contradicts is refused; a presign on a root that
  takes none, for a committed checkpoint, or with a read token, is refused; a client against such a
  root sends its files through the service. Replayed URLs and second presigns are attacked in
  ``tests/adversary/test_ingest_s3.py``.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptd.service.auth import hash_token
from ckptd_client import CheckpointClient, ChecksumMismatch
from ckptd_client import _presigned
from support import ServerProcess, assert_bits_equal, blank_like

MiB = 1 << 20


@pytest.fixture
def s3srv(moto_s3, s3_env, tmp_path):
    from s3_server import aws_env

    url = moto_s3.url()
    srv = ServerProcess(url, env={**aws_env(moto_s3.endpoint), "CKPTD_DIRECT_UPLOADS": "true"},  # opted in
                        log=tmp_path / "server.log").start()
    yield srv
    srv.stop()
    moto_s3.clear(url.split("/", 3)[3])


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(6)},
            "step": torch.tensor(seed)}


def _requests(srv) -> dict[str, float]:
    """Requests answered per route name, from the service's own /metrics."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics", timeout=10).text):
        if fam.name == "ckptd_http_requests":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["route"]] = out.get(s.labels["route"], 0) + s.value
    return out


def test_a_save_on_s3_goes_straight_to_the_store_and_loads_back(s3srv, moto_s3):
    sd = _state(1)
    with CheckpointClient(s3srv.url, file_bytes=MiB, incremental=False) as c:
        c.save(sd, "direct/1").wait()
        got = blank_like(sd)
        c.load(got, "direct/1")
        files = c.manifest("direct/1").files
    assert_bits_equal(got, sd)
    seen = _requests(s3srv)
    assert seen.get("upload_file", 0) == 0, seen  # no data file crossed the service
    assert seen.get("presign_file") == seen.get("confirm_file") == len(files) >= 2, seen
    out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "direct/1", "--server", s3srv.url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK direct/1"), out.stdout + out.stderr


def test_the_dcp_writer_uploads_straight_to_the_store_too(s3srv):
    import torch.distributed.checkpoint as dcp

    sd = _state(5)["model"]
    with CheckpointClient(s3srv.url) as c:
        dcp.save(sd, storage_writer=c.dcp_writer("dcpw/1"), no_dist=True)
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(got, storage_reader=c.dcp_reader("dcpw/1"), no_dist=True)
    assert_bits_equal(got, sd)
    seen = _requests(s3srv)
    # the data went straight to the store; only DCP's own metadata (a few KiB) through the service
    assert seen.get("upload_file", 0) == 1 and seen.get("confirm_file", 0) >= 1, seen


def test_a_file_of_several_parts_goes_up_as_one_multipart_upload(s3srv, monkeypatch):
    monkeypatch.setattr(_presigned, "PART_BYTES", 5 * MiB)  # S3's smallest part: 13 MiB are 3 parts
    g = torch.Generator().manual_seed(4)
    sd = {"big": torch.randn(13 * MiB // 4, generator=g), "small": torch.randn(10, generator=g)}
    with CheckpointClient(s3srv.url, file_bytes=64 * MiB, incremental=False) as c:
        c.save(sd, "multi/1").wait()
        got = blank_like(sd)
        c.load(got, "multi/1")
    assert_bits_equal(got, sd)
    seen = _requests(s3srv)
    assert seen.get("upload_file", 0) == 0 and seen.get("confirm_file") == 1, seen


def test_bytes_other_than_declared_are_refused_at_the_commit_and_the_last_good_stays(s3srv, monkeypatch):
    good = _state(1)
    with CheckpointClient(s3srv.url, file_bytes=MiB, incremental=False) as c:
        c.save(good, "direct/1").wait()
        real_put = httpx.Client.put

        def forged(self, url, *, content=None, **kw):  # the store gets other bytes than were declared
            if "X-Amz-Signature" in str(url):
                data = bytearray(b"".join(bytes(p) for p in content))
                data[len(data) // 2] ^= 0xFF
                content = bytes(data)
            return real_put(self, url, content=content, **kw)

        monkeypatch.setattr(_presigned, "PART_BYTES", 5 * MiB)

        monkeypatch.setattr(_presigned.httpx.Client, "put", forged)
        with pytest.raises(ChecksumMismatch, match="refused at commit"):
            c.save(_state(2), "direct/2").wait()
        monkeypatch.undo()
        assert [x.name for x in c.list_checkpoints("direct")] == ["1"]
        got = blank_like(good)
        report = c.load(got, "direct/latest")
    assert report.ref == "direct/1"
    assert_bits_equal(got, good)


def _sha(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def test_a_confirmation_the_presign_or_the_store_contradicts_is_refused(s3srv, moto_s3):
    base = f"{s3srv.url}/v1/checkpoints/raw/1/sessions"
    sid = "c" * 32
    info = httpx.post(base, json={"session": sid, "world_size": 1, "step": 1, "direct_uploads": True}, timeout=10)
    assert info.status_code == 200 and info.json()["presigned"] is True, info.text
    data = b"x" * 5000
    file = f"{base}/{sid}/files/r000000-0000.bin"
    part = {"size": len(data), "part_size": 5 * MiB, "sha256": [_sha(data)]}
    r = httpx.post(f"{file}/presign", json={**part, "sha256": [_sha(data)] * 2}, timeout=10)
    assert r.status_code == 422 and "1 parts, not 2" in r.text, r.text
    ok = {**part, "xxh3": "0" * 16, "block_size": 1 << 20, "blocks": ["0" * 16]}
    r = httpx.post(f"{file}/confirm", json=ok, timeout=10)
    assert r.status_code == 400 and "does not match the file's presign" in r.json()["error"]["message"], r.text
    signed = httpx.post(f"{file}/presign", json=part, timeout=10).json()
    assert signed["upload_id"] is None and len(signed["urls"]) == 1
    assert signed["headers"][0]["x-amz-checksum-sha256"] == _sha(data) and "X-Amz-Signature" in signed["urls"][0]
    signed_headers = signed["urls"][0].split("X-Amz-SignedHeaders=")[1].split("&")[0]
    assert "x-amz-checksum-sha256" in signed_headers and "if-none-match" in signed_headers, signed_headers
    ok["block_size"] = signed["block_size"]
    r = httpx.post(f"{file}/confirm", json=ok, timeout=10)
    assert r.status_code == 400 and "nothing was uploaded" in r.json()["error"]["message"], r.text
    assert httpx.put(signed["urls"][0], content=data, headers=signed["headers"][0], timeout=10).status_code == 200
    claim = {**ok, "size": len(data) + 5 * MiB, "sha256": [_sha(data)] * 2, "blocks": ["0" * 16] * 6}
    r = httpx.post(f"{file}/confirm", json=claim, timeout=10)
    assert r.status_code == 400 and "does not match the file's presign" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{file}/confirm", json={**ok, "blocks": []}, timeout=10)
    assert r.status_code == 400 and "block digests" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{file}/confirm", json={**ok, "upload_id": "u", "etags": []}, timeout=10)
    assert r.status_code == 400 and "0 ETags for 1 parts" in r.json()["error"]["message"], r.text
    httpx.delete(f"{base}/{sid}", timeout=10)


def test_presigns_are_refused_where_they_cannot_be_given(tmp_path):
    token = "writer-token-0123456789abcdef"
    reader = "reader-token-0123456789abcdef"
    env = {"CKPTD_TOKENS": f"w sha256:{hash_token(token)} write:*\nr sha256:{hash_token(reader)} read:*",
           "CKPTD_DIRECT_UPLOADS": "true"}
    srv = ServerProcess(tmp_path / "root", env=env).start()  # a local root: no presigned uploads
    try:
        h = {"Authorization": f"Bearer {token}"}
        base = f"{srv.url}/v1/checkpoints/loc/1/sessions"
        info = httpx.post(base, headers=h, json={"session": "d" * 32, "world_size": 1, "step": 1,
                                                 "direct_uploads": True}, timeout=10).json()
        assert info.get("presigned") is None
        body = {"size": 3, "part_size": 5 * MiB, "sha256": [_sha(b"abc")]}
        r = httpx.post(f"{base}/{'d' * 32}/files/r000000-0000.bin/presign", headers=h, json=body, timeout=10)
        assert r.status_code == 400 and "takes no presigned uploads" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{base}/{'d' * 32}/files/r000000-0000.bin/presign", json=body, timeout=10,
                       headers={"Authorization": f"Bearer {reader}"})
        assert r.status_code == 403
        # a client asking for direct uploads there sends through the service (over HTTP, as from another
        # host), and commits
        sd = _state(3)
        with CheckpointClient(srv.url, token=token, local_uploads=False) as c:
            c.save(sd, "loc/2").wait()
            got = blank_like(sd)
            c.load(got, "loc/2")
        assert_bits_equal(got, sd)
        seen = _requests(srv)
        assert seen.get("upload_file", 0) >= 1 and seen.get("presign_file", 0) == 2, seen  # the two refused above
        r = httpx.post(f"{srv.url}/v1/checkpoints/loc/2/sessions/{'e' * 32}/files/x.bin/presign", headers=h,
                       json=body, timeout=10)
        assert r.status_code in (404, 409), r.text  # committed: no session of it takes files
    finally:
        srv.stop()


def test_by_default_every_byte_goes_through_the_service(moto_s3, s3_env, tmp_path):
    """Direct uploads are the service's opt-in: on its default settings a default client (which asks for
    them) is offered none and sends every file through the service, checked as it arrives."""
    from s3_server import aws_env

    url = moto_s3.url()
    srv = ServerProcess(url, env=aws_env(moto_s3.endpoint), log=tmp_path / "server.log").start()
    try:
        sd = _state(4)
        with CheckpointClient(srv.url, file_bytes=MiB, incremental=False, local_uploads=False) as c:
            c.save(sd, "plain/1").wait()
            got = blank_like(sd)
            c.load(got, "plain/1")
        assert_bits_equal(got, sd)
        seen = _requests(srv)
        assert seen.get("upload_file", 0) >= 2 and seen.get("presign_file", 0) == 0, seen
    finally:
        srv.stop()
        moto_s3.clear(url.split("/", 3)[3])
