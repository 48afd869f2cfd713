"""``ckptd_client._manifest.get_manifest``: the manifest a ref resolved to, and the newer checkpoints
the service skipped as known to be bad (``X-Ckptd-Skipped``).

A real ``Transport`` over loopback HTTP to a peer that answers as told (``canned_http``): the skipped
list comes back in the service's order; no header, an empty one, or one that does not parse (not
JSON, not a list, entries of another shape) is read as none and logged, never an error (the manifest
itself was checked); the manifest's digest is checked whatever the header says.
"""

from __future__ import annotations

import json
import logging

import pytest
import xxhash

from ckptd_client._manifest import get_manifest
from ckptd_client.transport import Transport
from ckptd_schemas import CorruptCheckpoint
from ckptd_schemas.api import SKIPPED_HEADER, SkippedCheckpoint

from .canned_http import CannedPeer

BODY = b'{"run": "gpt", "name": "7"}'
SKIPPED = [{"ref": "gpt/9", "reason": "verification failed at 2026-01-01T00:00:00Z: file 'r0.bin' is missing"},
           {"ref": "gpt/8", "reason": "verification failed at 2026-01-01T00:00:00Z: digest"}]


def _resolve(skipped: str | None, body: bytes = BODY, digest: str | None = None):
    def answer(method, path, _):
        h = {"X-Ckptd-Manifest-Xxh3": digest or xxhash.xxh3_64_hexdigest(BODY), "X-Ckptd-Name": "7"}
        if skipped is not None:
            h[SKIPPED_HEADER] = skipped
        return 200, h, body

    with CannedPeer(answer) as peer:
        t = Transport(peer.url, retry_seconds=0, token="")
        try:
            return get_manifest(t, "gpt", "latest"), peer.seen
        finally:
            t.close()


def test_the_skipped_checkpoints_come_back_in_the_services_order():
    (raw, skipped), seen = _resolve(json.dumps(SKIPPED))
    assert raw == BODY
    assert skipped == [SkippedCheckpoint(**s) for s in SKIPPED]
    assert [(s.method, s.path) for s in seen] == [("GET", "/v1/checkpoints/gpt/latest")]


@pytest.mark.parametrize("header", [None, "", "[]"])
def test_no_skipped_checkpoints(header, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptd_client"):
        (raw, skipped), _ = _resolve(header)
    assert (raw, skipped) == (BODY, [])
    assert not caplog.records


@pytest.mark.parametrize("header", ["not json", "5", '{"ref": "gpt/9"}', '[{"ref": "gpt/9"}]',
                                    '[{"ref": "gpt/9", "reason": 5}]', "[null]"])
def test_a_header_that_does_not_parse_is_read_as_none_and_logged(header, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptd_client"):
        (raw, skipped), _ = _resolve(header)
    assert (raw, skipped) == (BODY, [])
    (record,) = [r for r in caplog.records if r.name == "ckptd_client"]
    assert "gpt/latest" in record.getMessage() and SKIPPED_HEADER in record.getMessage()


def test_the_manifest_is_checked_whatever_the_header_says():
    with pytest.raises(CorruptCheckpoint, match="manifest of gpt/7"):
        _resolve(json.dumps(SKIPPED), body=BODY + b" ")


def test_a_skipped_entry_with_a_field_added_by_a_later_release_is_read(caplog):
    """The header is an answer: a service of a later release may add to its entries (compatibility)."""
    with caplog.at_level(logging.WARNING, logger="ckptd_client"):
        (raw, skipped), _ = _resolve(json.dumps([{**SKIPPED[0], "added_later": 1}]))
    assert raw == BODY and [s.model_dump() for s in skipped] == [SKIPPED[0]] and not caplog.records
