"""``ckptd_client._damage.reported``: a load that read damaged bytes reports the file, and its error says
what the service found.

A real ``Transport`` over loopback HTTP to a peer that answers as told (``canned_http``), standing for
the service's ``POST .../damaged``: the report names exactly the file of the error (or the part: the
marker, the manifest, the load tree), of the checkpoint the load read or, failing before it knew, the
one the error names; the error that
comes back keeps the original message, details and request id, and adds what the service found (the
file damaged, and what ``RUN/latest`` resolves to now, or nothing left; or the file intact: the
bytes were damaged on the way). An error with no data file to report, a load of no checkpoint, a
report the service refuses or answers oddly: the original error, as it was.
"""

from __future__ import annotations

import json
import logging

import pytest

from ckptd_client._damage import reported
from ckptd_client.transport import Transport
from ckptd_schemas import CorruptCheckpoint, Unavailable

from .canned_http import CannedPeer

BASE = "/v1/checkpoints/gpt/12"


def _error(**details) -> CorruptCheckpoint:
    e = CorruptCheckpoint("file 'r000001-0000.bin' fails its digests (tensors model.w)",
                          **{"file": "r000001-0000.bin", "tensors": ["model.w"], **details})
    e.request_id = "req-1"
    return e


def _report(e: CorruptCheckpoint, status: int, answer: object, base: str | None = BASE):
    def respond(method, path, body):
        return status, {"Content-Type": "application/json"}, json.dumps(answer).encode()

    with CannedPeer(respond) as peer:
        t = Transport(peer.url, retry_seconds=0, token="")
        try:
            return reported(t, base, e), peer.seen
        finally:
            t.close()


def test_a_damaged_file_recorded_as_bad_says_what_latest_is_now():
    e = _error()
    answer = {"damaged": True, "latest": "11", "files": {"r000001-0000.bin": "digest of block 3"}}
    out, seen = _report(e, 200, answer)
    assert [(s.method, s.path, json.loads(s.body)) for s in seen] == [
        ("POST", f"{BASE}/damaged", {"files": ["r000001-0000.bin"]})]
    assert type(out) is CorruptCheckpoint and out is not e
    assert out.message == (e.message + "; the service read file 'r000001-0000.bin' again, found it damaged and "
                           "recorded gpt/12 as bad: gpt/latest now resolves to gpt/11")
    assert out.details == {**e.details, "reported": answer}
    assert out.request_id == "req-1"


def test_a_damaged_file_with_nothing_left_to_resolve_to():
    out, _ = _report(_error(), 200, {"damaged": True, "latest": None})
    assert out.message.endswith("recorded gpt/12 as bad: gpt has no other checkpoint that is not known to be bad")


def test_a_file_found_intact_means_the_bytes_were_damaged_on_the_way():
    out, _ = _report(_error(), 200, {"damaged": False})
    assert out.message.endswith("; the service read file 'r000001-0000.bin' again and found it intact: the bytes "
                                "were damaged on their way here (a retry may succeed)")
    assert out.details["reported"] == {"damaged": False}


@pytest.mark.parametrize("details", [{"file": None}, {"file": 3}])
def test_an_error_about_no_part_is_not_reported(details):
    e = _error(**details)
    out, seen = _report(e, 200, {"damaged": True, "latest": "11"})
    assert out is e and seen == []


@pytest.mark.parametrize(("file", "part"), [("COMMITTED", "marker"), ("manifest", "manifest"),
                                            ("load tree", "load tree")])
def test_a_damaged_marker_manifest_or_load_tree_is_reported_as_that_part(file, part):
    e = _error(file=file)
    out, seen = _report(e, 200, {"damaged": True, "latest": "11"})
    assert [(s.method, s.path, json.loads(s.body)) for s in seen] == [("POST", f"{BASE}/damaged", {"parts": [part]})]
    assert out.message == (e.message + f"; the service checked its {part} again, found it damaged and recorded "
                           "gpt/12 as bad: gpt/latest now resolves to gpt/11")
    out, _ = _report(e, 200, {"damaged": False})
    assert out.message.endswith(f"found it intact: the {part} was damaged on its way here (a retry may succeed)")


def test_a_load_that_failed_before_it_knew_its_checkpoint_reports_the_one_the_error_names():
    e = _error(file="COMMITTED", ref="gpt/12")  # the service's 422 for a marker naming another load tree
    out, seen = _report(e, 200, {"damaged": True, "latest": "11"}, base=None)
    assert [(s.path, json.loads(s.body)) for s in seen] == [(f"{BASE}/damaged", {"parts": ["marker"]})]
    for ref in ("gpt/latest", "gpt", 7):  # not one checkpoint: nothing to report
        out, seen = _report(_error(file="COMMITTED", ref=ref), 200, {"damaged": True}, base=None)
        assert seen == []


def test_a_load_of_no_checkpoint_reports_nothing():
    e = _error()
    out, seen = _report(e, 200, {"damaged": True}, base=None)
    assert out is e and seen == []


@pytest.mark.parametrize(("status", "answer"), [(404, {"error": {"code": "checkpoint_not_found", "message": "gone"}}),
                                                (503, {"error": {"code": "storage", "message": "down"}}),
                                                (403, {"error": {"code": "forbidden", "message": "no"}})])
def test_a_refused_report_leaves_the_error_as_it_was_and_is_logged(status, answer, caplog):
    e = _error()
    with caplog.at_level(logging.WARNING, logger="ckptd_client"):
        out, seen = _report(e, status, answer)
    assert out is e and len(seen) == 1
    assert any("not reported" in r.getMessage() and "gpt/12" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("answer", [["damaged"], "yes", None])
def test_an_answer_that_is_not_an_object_leaves_the_error_as_it_was(answer):
    e = _error()
    out, _ = _report(e, 200, answer)
    assert out is e


def test_an_unreachable_service_leaves_the_error_as_it_was():
    e = _error()
    t = Transport("http://127.0.0.1:9", retry_seconds=0, token="", retry_refused=False)
    try:
        with pytest.raises(Unavailable):  # what the transport raises on its own
            t.request("GET", "/v1/health", timeout=5)
        assert reported(t, BASE, e) is e
    finally:
        t.close()
