"""A save's routes (:mod:`ckptd.service.upload_routes`), mounted alone over a real local root, in process.

* open, upload, index: the last index commits, the marker names the manifest the answer names, and
  the session's status says so (durable when asked: this root is the durable store); a session
  opened on a service without a co-located socket or direct uploads offers neither;
* an index whose body names another rank than its URL is refused 400 naming both, one that declares a
  tensor's layout-independent digest 422 ``invalid_index`` naming the tensor: nothing is committed;
* a file whose bytes differ from the declared digest is 422 and is not stored; a digest header that
  is not 16 hex digits is refused before any byte is read;
* the status without ``wait`` lists the ranks whose index is stored; a long poll of an open session
  answers open after its wait, listing none; a wait over :data:`MAX_WAIT_SECONDS` is refused;
* presigned uploads on a service that has them off are refused 400 naming the file;
* the confirm and link paths end in one place way (``Intake.place``), each validating its own body:
  a link's body sent to ``.../confirm``, a confirmation's to ``.../link`` or a link without its file
  is 422 naming the field, nothing placed;
* a rank's keep-alive is 204; an abort deletes the session (its status is then 404).
"""

from __future__ import annotations

import pytest
import xxhash

from ckptd.service.upload_routes import MAX_WAIT_SECONDS, upload_router
from ckptd.store.intake import recorded_file
from ckptd_schemas import (
    ChecksumMismatch, InvalidIndex, InvalidRequest, SessionInfo, SessionNotFound, SessionStatus, error_from_body,
)

from .wiring import FILE, app_with, call, rank_index, save_one, services

DATA = bytes(range(256)) * 4  # 256 float32 values
BASE = "/v1/checkpoints/up/1/sessions"


@pytest.fixture
def svc(tmp_path):
    s = services(tmp_path / "root", direct_uploads=True)
    yield s
    s.workers.close()


@pytest.fixture
def app(svc):
    return app_with(upload_router(svc))


def _open(app, sid: str = "s1", world: int = 1) -> SessionInfo:
    r = call(app, "POST", BASE, json={"session": sid, "world_size": world, "step": 1, "direct_uploads": True})
    assert r.status_code == 200, r.text
    return SessionInfo.model_validate(r.json())


def _upload(app, data: bytes, *, sid: str = "s1", rank: int = 0, digest: str | None = None):
    return call(app, "PUT", f"{BASE}/{sid}/files/r{rank:06d}-0000.bin", content=data,
                headers={"X-Ckptd-Xxh3": digest or xxhash.xxh3_64_hexdigest(data)})


def test_the_last_index_commits_and_the_status_says_so(app, svc):
    info = _open(app)
    assert (info.run, info.name, info.session, info.world_size, info.step) == ("up", "1", "s1", 1, 1)
    assert info.local_socket is None and info.local_host is None and info.local_key is None and not info.presigned
    r = _upload(app, DATA)
    assert r.status_code == 200
    assert r.json() == {"file": FILE, "size": len(DATA), "xxh3": xxhash.xxh3_64_hexdigest(DATA)}
    r = call(app, "PUT", f"{BASE}/s1/ranks/0", json=rank_index(DATA))
    st = SessionStatus.model_validate(r.json())
    assert r.status_code == 200 and st.state == "committed" and st.ranks_done == [0]
    marker = svc.visibility.marker("up", "1")
    assert marker is not None and marker.session == "s1" and marker.manifest_xxh3 == st.manifest_xxh3
    r = call(app, "GET", f"{BASE}/s1", params={"durable": "true"})
    assert SessionStatus.model_validate(r.json()).durable is True  # without a durable tier the root is durable
    assert call(app, "GET", f"{BASE}/s1").json()["durable"] is None  # not asked


def test_an_index_for_another_rank_is_refused_and_nothing_commits(app, svc):
    _open(app)
    _upload(app, DATA)
    r = call(app, "PUT", f"{BASE}/s1/ranks/3", json=rank_index(DATA))
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 400 and type(err) is InvalidRequest
    assert err.message == "index body is for rank 0, URL says rank 3" and err.details == {"rank": 3}
    assert svc.visibility.marker("up", "1") is None
    assert call(app, "GET", f"{BASE}/s1").json()["state"] == "open"


def test_an_index_that_declares_a_tensor_digest_is_refused(app, svc):
    _open(app)
    _upload(app, DATA)
    r = call(app, "PUT", f"{BASE}/s1/ranks/0", json=rank_index(DATA, digest="0" * 16))
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 422 and type(err) is InvalidIndex
    assert "declares the layout-independent digest of tensor 'model.w'" in err.message
    assert err.details == {"rank": 0, "tensor": "model.w"}
    assert svc.visibility.marker("up", "1") is None
    st = call(app, "GET", f"{BASE}/s1").json()
    assert st["state"] == "open" and st["ranks_done"] == []  # nothing of it stored: the rank may send it again
    assert call(app, "PUT", f"{BASE}/s1/ranks/0", json=rank_index(DATA)).json()["state"] == "committed"


def test_bytes_that_differ_from_their_digest_are_not_stored(app, svc):
    _open(app)
    r = _upload(app, DATA, digest="0123456789abcdef")
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 422 and isinstance(err, ChecksumMismatch)
    assert svc.storage.list("runs/up/1/sessions/s1/files") == []
    r = _upload(app, DATA, digest="not-hex")
    assert r.status_code == 422 and "x-ckptd-xxh3" in error_from_body(r.json(), 422).message.lower()


def test_the_status_lists_ranks_and_a_long_poll_answers_after_its_wait(app):
    _open(app, world=2)
    _upload(app, DATA)
    assert call(app, "PUT", f"{BASE}/s1/ranks/0", json=rank_index(DATA, world=2)).json()["state"] == "open"
    assert call(app, "GET", f"{BASE}/s1").json()["ranks_done"] == [0]
    r = call(app, "GET", f"{BASE}/s1", params={"wait": 0.2})
    assert r.status_code == 200 and r.json()["state"] == "open" and r.json()["ranks_done"] == []
    r = call(app, "GET", f"{BASE}/s1", params={"wait": MAX_WAIT_SECONDS + 1})
    assert r.status_code == 422 and type(error_from_body(r.json(), 422)) is InvalidRequest


def test_a_long_poll_of_a_settled_session_answers_at_once(app):
    assert save_one(app, "up/1", DATA).json()["state"] == "committed"
    r = call(app, "GET", f"{BASE}/s1", params={"wait": MAX_WAIT_SECONDS})  # settled: no wait at all
    assert r.status_code == 200 and r.json()["state"] == "committed"


def test_presigned_uploads_are_refused_where_they_are_off(tmp_path):
    svc = services(tmp_path / "root", direct_uploads=False)
    app = app_with(upload_router(svc))
    _open(app)
    r = call(app, "POST", f"{BASE}/s1/files/{FILE}/presign", json={"size": 10, "part_size": 5 << 20,
                                                                   "sha256": ["A" * 43 + "="]})
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 400 and type(err) is InvalidRequest and err.details == {"file": FILE}
    assert "direct uploads are off" in err.message


def test_each_place_path_takes_its_own_body_only(app, svc):
    _open(app)
    link = {"checkpoint": "0", "file": FILE}
    confirm = {"size": 10, "part_size": 5 << 20, "sha256": ["A" * 43 + "="], "xxh3": "0" * 16,
               "block_size": 4096, "blocks": ["0" * 16]}
    for path, body, field in (("confirm", link, "size"), ("link", confirm, "checkpoint"),
                              ("link", {"checkpoint": "0"}, "file")):
        r = call(app, "POST", f"{BASE}/s1/files/{FILE}/{path}", json=body)
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(f"invalid request at body.{field}:"), \
            r.text
    assert recorded_file(svc.storage, "up", "1", "s1", FILE) is None


def test_keep_alive_and_abort(app, svc):
    _open(app)
    _upload(app, DATA)
    assert call(app, "POST", f"{BASE}/s1/alive").status_code == 204
    assert call(app, "DELETE", f"{BASE}/s1").status_code == 204
    assert svc.storage.list("runs/up/1/sessions") == []
    r = call(app, "GET", f"{BASE}/s1")
    assert r.status_code == 404 and isinstance(error_from_body(r.json(), 404), SessionNotFound)
