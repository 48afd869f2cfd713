"""``ckptd_client._manifest.get_manifest``: a manifest is taken only when its bytes hash to the digest
the service declares for them (``X-Ckptd-Manifest-Xxh3``, from the checkpoint's ``COMMITTED`` marker).

A real ``Transport`` over loopback HTTP to a peer that answers as told (``canned_http``): bytes that
match are returned exactly as received (in either case of hex digits); bytes damaged on storage or
on the way raise ``CorruptCheckpoint`` naming the ref the service resolved to and the manifest,
before anything parses them; a service that declares no digest (older releases) is taken as it
answers; the service's own typed errors pass through.
"""

from __future__ import annotations

import json

import pytest
import xxhash

from ckptd_client._manifest import MANIFEST_DIGEST_HEADER, get_manifest
from ckptd_client.transport import Transport
from ckptd_schemas import CheckpointNotFound, CorruptCheckpoint

from .canned_http import CannedPeer

BODY = b'{"format_version": 2, "run": "gpt", "name": "12"}'


def _get(answer, run: str = "gpt", name: str = "12") -> tuple[bytes, CannedPeer]:
    with CannedPeer(answer) as peer:
        t = Transport(peer.url, retry_seconds=0, token="")
        try:
            return get_manifest(t, run, name)[0], peer
        finally:
            t.close()


def _serving(body: bytes, digest: str | None, **headers: str):
    def answer(method, path, _):
        h = dict(headers)
        if digest is not None:
            h[MANIFEST_DIGEST_HEADER] = digest
        return 200, h, body
    return answer


def test_bytes_that_hash_to_the_declared_digest_are_returned_as_received():
    raw, peer = _get(_serving(BODY, xxhash.xxh3_64_hexdigest(BODY)))
    assert raw == BODY
    assert [(s.method, s.path) for s in peer.seen] == [("GET", "/v1/checkpoints/gpt/12")]
    raw, _ = _get(_serving(BODY, xxhash.xxh3_64_hexdigest(BODY).upper()))
    assert raw == BODY


@pytest.mark.parametrize("damage", ["flipped", "truncated", "extended"])
def test_bytes_that_do_not_hash_to_the_declared_digest_are_corrupt(damage):
    sent = {"flipped": BODY.replace(b"12", b"13"), "truncated": BODY[:-1], "extended": BODY + b" "}[damage]
    with pytest.raises(CorruptCheckpoint) as info:
        _get(_serving(sent, xxhash.xxh3_64_hexdigest(BODY), **{"X-Ckptd-Name": "12"}), name="latest")
    e = info.value
    assert e.message.startswith("manifest of gpt/12: ")  # the name latest resolved to
    assert f"the {len(sent)} bytes received hash to {xxhash.xxh3_64_hexdigest(sent)}" in e.message
    assert xxhash.xxh3_64_hexdigest(BODY) in e.message
    assert e.details == {"ref": "gpt/12", "file": "manifest"}  # the checkpoint a damage report names


def test_an_empty_declared_digest_matches_nothing():
    with pytest.raises(CorruptCheckpoint, match="manifest of gpt/12"):
        _get(_serving(BODY, ""))


def test_a_service_that_declares_no_digest_is_taken_as_it_answers():
    raw, _ = _get(_serving(BODY, None))
    assert raw == BODY


def test_the_services_typed_errors_pass_through():
    err = CheckpointNotFound("checkpoint gpt/12 not found", ref="gpt/12")

    def answer(method, path, _):
        return 404, {"Content-Type": "application/json"}, json.dumps(err.to_body()).encode()

    with pytest.raises(CheckpointNotFound) as info:
        _get(answer)
    assert info.value.details == {"ref": "gpt/12"}
