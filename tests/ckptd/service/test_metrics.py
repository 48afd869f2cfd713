"""Prometheus metrics and structured logs.

* after a real save and load through ``ckptd serve``, ``/metrics`` is scraped and
  parsed with prometheus_client's own parser: bytes in cover the bytes saved,
  bytes out the bytes loaded, one commit observed, no session left open;
* integrity refusals (a checksum mismatch, a commit refused at validation) and
  storage errors are counted once each, by code and by operation;
* reshard job progress is read from the job records at scrape time;
* request ids: taken from ``X-Request-Id`` when safe, echoed, put in error
  bodies, and found in the service's JSON log line for the request;
* the :class:`~ckptd.service.metrics.Metrics` object alone: both drill series from the first scrape;
  bytes and auth refusals by route and status (no series for zero bytes); a refusal the store counted
  is not counted again by the error handler; open sessions leave the gauge when committed, refused
  or reclaimed, and a scrape drops those the store no longer has open but keeps those it cannot ask
  about; a finished job's gauges stay ``FINISHED_JOB_KEEP_SECONDS``, then go.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from ckptd.reshard.models import JobStatus, now_utc, put_status
from ckptd.service import Settings, create_app
from ckptd.service import metrics as metrics_module
from ckptd.service.logs import JsonFormatter, TextFormatter
from ckptd.service.metrics import Metrics
from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.events import CommitEvent
from ckptd_client import CheckpointClient
from ckptd_schemas import ChecksumMismatch, OpenSession, StorageError
from support import ServerProcess, blank_like, make_state


def _call(app, method: str, url: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url, **kw)
    return asyncio.run(go())


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}, parsed by prometheus_client."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@pytest.fixture
def app(tmp_path):
    return create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))


def _index(data: bytes, shape: int, digest: str | None = None) -> dict:
    digest = digest or xxhash.xxh3_64_hexdigest(data)
    return {"rank": 0, "world_size": 1, "files": ["f.bin"], "tensors": [{
        "name": "t", "shape": [shape], "dtype": "float32", "group": "t", "chunks": [{
            "kind": "box", "rank": 0, "offsets": [0], "sizes": [len(data) // 4],
            "location": {"file": "f.bin", "offset": 0, "length": len(data), "raw_length": len(data),
                         "xxh3": digest}}]}]}


# -- a real service ------------------------------------------------------------------------------------------

def test_metrics_after_a_real_save_and_load(tmp_path):
    srv = ServerProcess(tmp_path / "root", args=["--log-level", "info", "--log-format", "json"]).start()
    try:
        before = scrape(httpx.get(f"{srv.url}/metrics").text)
        assert total(before, "ckptd_upload_sessions_open") == 0
        assert total(before, "ckptd_commit_seconds_count") == 0
        sd = make_state(1, mib=1.0)
        # direct_reads=False: every byte goes through the routes whose bytes this test counts
        with CheckpointClient(srv.url, retry_seconds=30, direct_reads=False) as c:
            c.save(sd, "m/5").wait()
            manifest = c.manifest("m/5")
            got = blank_like(sd)
            c.load(got, "m/5")
        r = httpx.get(f"{srv.url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        after = scrape(r.text)
        saved = manifest.total_bytes  # bytes of the data files
        assert saved >= 1 << 20
        assert total(after, "ckptd_bytes_in_total") >= saved
        # the files were handed over on this host (co-located uploads): counted as received, every byte
        assert total(after, "ckptd_bytes_in_total", route="local_upload") >= saved
        assert total(after, "ckptd_local_uploads_total", status="200") == len(manifest.files)
        assert total(after, "ckptd_bytes_out_total", route="get_file") >= saved * 0.9
        assert total(after, "ckptd_commit_seconds_count") == 1
        assert 0 < total(after, "ckptd_commit_seconds_sum") < 60
        assert total(after, "ckptd_commits_total") == 1
        assert total(after, "ckptd_committed_bytes_total") == saved  # with the process's CPU: CPU per GiB
        assert total(after, "process_cpu_seconds_total") > 0
        assert total(after, "ckptd_upload_sessions_open") == 0
        assert total(after, "ckptd_verify_failures_total") == 0
        assert total(after, "ckptd_storage_errors_total") == 0
        assert total(after, "ckptd_http_requests_total", route="open_session", status="200") >= 1
        assert total(after, "ckptd_http_request_seconds_count", route="put_index") >= 1
        assert not any(n.endswith("_created") for n, _ in after)  # the service turns those off
        # The request id comes back and is in the JSON log line of that request.
        r = httpx.get(f"{srv.url}/v1/checkpoints/m/5", headers={"X-Request-Id": "scrape-test-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "scrape-test-42"
        r = httpx.get(f"{srv.url}/v1/checkpoints/m/6", headers={"X-Request-Id": "bad id with spaces"})
        rid = r.headers["x-request-id"]
        assert r.status_code == 404 and rid != "bad id with spaces" and r.json()["error"]["request_id"] == rid
    finally:
        srv.stop()
    lines = [json.loads(x) for x in srv.log.read_text().splitlines() if x.startswith("{")]
    (line,) = [x for x in lines if x.get("request_id") == "scrape-test-42"]
    assert line["logger"] == "ckptd.access" and line["level"] == "info" and line["status"] == 200
    assert (line["method"], line["path"], line["route"]) == ("GET", "/v1/checkpoints/m/5", "get_manifest")
    assert line["run"] == "m" and line["checkpoint"] == "5" and line["duration_ms"] >= 0 and "ts" in line
    # The store's own log line of the commit carries the id of the request that committed.
    commit = [x for x in lines if x["msg"].startswith("committed m/5")]
    assert len(commit) == 1 and commit[0]["request_id"]
    assert any(x.get("request_id") == commit[0]["request_id"] and x.get("route") == "put_index" for x in lines)
    assert all(set(x) >= {"ts", "level", "logger", "msg"} for x in lines)


# -- in process ----------------------------------------------------------------------------------------------

def test_sessions_open_gauge_and_integrity_refusals_counted_once(app):
    m = lambda: scrape(_call(app, "GET", "/metrics").text)  # noqa: E731
    assert _call(app, "POST", "/v1/checkpoints/r/1/sessions", json={"session": "s1", "world_size": 1}).status_code == 200
    assert _call(app, "POST", "/v1/checkpoints/r/2/sessions", json={"session": "s2", "world_size": 1}).status_code == 200
    assert total(m(), "ckptd_upload_sessions_open") == 2
    assert _call(app, "DELETE", "/v1/checkpoints/r/2/sessions/s2").status_code == 204
    assert total(m(), "ckptd_upload_sessions_open") == 1
    data = b"\x01" * 64
    # Bytes that differ from their declared digest.
    r = _call(app, "PUT", "/v1/checkpoints/r/1/sessions/s1/files/f.bin", content=data,
              headers={"X-Ckptd-Xxh3": "0" * 16})
    assert r.status_code == 422 and r.json()["error"]["code"] == "checksum_mismatch"
    assert total(m(), "ckptd_verify_failures_total", code="checksum_mismatch") == 1
    # A commit refused at validation: the chunks do not tile the tensor.
    r = _call(app, "PUT", "/v1/checkpoints/r/1/sessions/s1/files/f.bin", content=data,
              headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert r.status_code == 200
    r = _call(app, "PUT", "/v1/checkpoints/r/1/sessions/s1/ranks/0", json=_index(data, 17))
    assert r.status_code == 422, r.text
    after = m()
    assert total(after, "ckptd_verify_failures_total") == 2, after  # counted once, not again by the handler
    assert total(after, "ckptd_verify_failures_total", code=r.json()["error"]["code"]) == 1
    assert total(after, "ckptd_upload_sessions_open") == 0  # refused at commit: no longer open
    assert total(after, "ckptd_commit_seconds_count") == 0


def test_session_committed_elsewhere_leaves_the_gauge_at_scrape(tmp_path):
    """Another replica took the last index: this replica's gauge notices at the next scrape."""
    a = create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))
    b = create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))
    data = b"\x02" * 16
    assert _call(a, "POST", "/v1/checkpoints/r/1/sessions", json={"session": "s1", "world_size": 1}).status_code == 200
    assert _call(b, "PUT", "/v1/checkpoints/r/1/sessions/s1/files/f.bin", content=data,
                 headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)}).status_code == 200
    r = _call(b, "PUT", "/v1/checkpoints/r/1/sessions/s1/ranks/0", json=_index(data, 4))
    assert r.json()["state"] == "committed"
    assert total(scrape(_call(a, "GET", "/metrics").text), "ckptd_upload_sessions_open") == 0
    assert total(scrape(_call(b, "GET", "/metrics").text), "ckptd_commits_total") == 1


class FlakyStorage(LocalStorage):
    fail = False

    def list(self, prefix: str) -> list[str]:
        if self.fail:
            raise StorageError(f"storage list of {prefix!r} failed: injected", key=prefix)
        return super().list(prefix)


def test_storage_errors_counted_by_operation(tmp_path):
    storage = FlakyStorage(tmp_path)
    app = create_app(Settings(root=str(tmp_path)), storage)
    storage.fail = True
    r = _call(app, "GET", "/v1/runs")
    assert r.status_code == 503 and r.json()["error"]["code"] == "storage" and r.json()["error"]["request_id"]
    assert _call(app, "GET", "/readyz").status_code == 503
    storage.fail = False
    samples = scrape(_call(app, "GET", "/metrics").text)
    assert total(samples, "ckptd_storage_errors_total", op="list_runs") == 1
    assert total(samples, "ckptd_storage_errors_total", op="readyz") == 1
    assert total(samples, "ckptd_http_requests_total", route="list_runs", status="503") == 1


def test_reshard_progress_read_from_job_records(app, tmp_path):
    storage = app.state.storage
    now = now_utc()
    st = JobStatus(id="job1", state="running", source="r/1", out="r/1-full", spec="full", bytes_total=1000,
                   bytes_done=250, created_at=now, updated_at=now)
    put_status(storage, st)
    app.state.metrics.track_job(storage, "job1")
    s = scrape(_call(app, "GET", "/metrics").text)
    assert total(s, "ckptd_reshard_job_bytes_done", job="job1") == 250
    assert total(s, "ckptd_reshard_job_bytes_planned", job="job1") == 1000
    assert total(s, "ckptd_reshard_jobs_active") == 1
    put_status(storage, st.model_copy(update={"state": "done", "bytes_done": 1000}))
    for _ in range(2):  # counted once, however often scraped
        s = scrape(_call(app, "GET", "/metrics").text)
    assert total(s, "ckptd_reshard_job_bytes_done", job="job1") == 1000
    assert total(s, "ckptd_reshard_jobs_finished_total", state="done") == 1
    assert total(s, "ckptd_reshard_jobs_active") == 0


def test_metrics_registries_are_per_app(tmp_path):
    a = create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))
    b = create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))
    _call(a, "GET", "/v1/runs")
    assert total(scrape(_call(a, "GET", "/metrics").text), "ckptd_http_requests_total", route="list_runs") == 1
    assert total(scrape(_call(b, "GET", "/metrics").text), "ckptd_http_requests_total", route="list_runs") == 0


def test_request_ids_in_headers_and_error_bodies(app):
    r = _call(app, "GET", "/v1/checkpoints/r/1", headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["error"]["request_id"] == "abc-123"
    for bad in ("x" * 200, "a b", "é"):
        r = _call(app, "GET", "/healthz", headers={"X-Request-Id": bad.encode("utf-8")})
        assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32
    a, b = _call(app, "GET", "/healthz"), _call(app, "GET", "/healthz")
    assert a.headers["x-request-id"] != b.headers["x-request-id"]
    r = _call(app, "GET", "/v1/checkpoints/Bad_Run/1")  # validation and routing errors carry it too
    assert r.json()["error"]["request_id"] == r.headers["x-request-id"]
    r = _call(app, "GET", "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["request_id"] == r.headers["x-request-id"]


def test_formatters_redact_bearer_tokens():
    rec = logging.LogRecord("uvicorn.asgi", logging.DEBUG, "", 0, "scope=%s", (
        {"headers": [(b"authorization", b"Bearer sekrit-token-123")]},), None)
    rec.request_id = "r1"
    for fmt in (JsonFormatter(), TextFormatter()):
        out = fmt.format(rec)
        assert "sekrit-token-123" not in out and "[redacted]" in out and "r1" in out
    line = json.loads(JsonFormatter().format(rec))
    assert line["level"] == "debug" and line["logger"] == "uvicorn.asgi" and line["request_id"] == "r1"


# -- the Metrics object alone (ckptd.service.metrics) -------------------------------------------------------

def _value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_the_drill_series_exist_from_the_first_scrape_and_count_each_drill():
    m = Metrics()
    first = scrape(m.render().decode())
    assert total(first, "ckptd_drills_total", result="ok") == 0
    assert total(first, "ckptd_drills_total", result="failed") == 0
    assert ("ckptd_drills_total", (("result", "ok"),)) in first  # both series are there, at 0
    m.observe_drill(True)
    m.observe_drill(False)
    m.observe_drill(False)
    assert (_value(m, "ckptd_drills_total", result="ok"), _value(m, "ckptd_drills_total", result="failed")) == (1, 2)


def test_requests_bytes_and_refusals_by_route():
    m = Metrics()
    m.observe_request("get_file", "GET", 206, 0.01, 0, 4096)
    m.observe_request("put_index", "PUT", 401, 0.001, 10, 0)
    m.observe_request("put_index", "PUT", 403, 0.001, 0, 0)
    assert _value(m, "ckptd_bytes_out_total", route="get_file") == 4096
    assert _value(m, "ckptd_bytes_in_total", route="get_file") is None  # no bytes: no series made up
    assert _value(m, "ckptd_http_requests_total", route="put_index", method="PUT", status="401") == 1
    assert _value(m, "ckptd_auth_refusals_total", status="401") == 1
    assert _value(m, "ckptd_auth_refusals_total", status="403") == 1
    assert _value(m, "ckptd_auth_refusals_total", status="206") is None
    m.observe_local_upload(200, 1000)
    m.observe_local_upload(422, 24)
    assert _value(m, "ckptd_local_uploads_total", status="200") == 1
    assert _value(m, "ckptd_bytes_in_total", route="local_upload") == 1024  # received, whatever the answer


def test_a_refusal_counted_by_the_store_is_not_counted_again_by_the_handler(tmp_path):
    m = Metrics()
    err = ChecksumMismatch("rank 1's bytes differ")
    m.opened("r", "1", "s1")
    m.refused("r", "1", "s1", err)
    m.observe_error(err, "put_index")  # the same error, reaching the error handler
    assert _value(m, "ckptd_verify_failures_total", code="checksum_mismatch") == 1
    m.observe_error(ChecksumMismatch("an upload's bytes differ"), "upload_file")  # not counted before: counted
    assert _value(m, "ckptd_verify_failures_total", code="checksum_mismatch") == 2
    m.observe_error(StorageError("injected"), "upload_file")
    assert _value(m, "ckptd_storage_errors_total", op="upload_file") == 1
    assert _value(m, "ckptd_upload_sessions_open") == 0  # refused: no longer open


def test_open_sessions_leave_the_gauge_when_committed_or_reclaimed():
    m = Metrics()
    for sid in ("s1", "s2", "s3"):
        m.opened("r", sid, sid)
    assert _value(m, "ckptd_upload_sessions_open") == 3
    m.committed(CommitEvent(run="r", name="s1", session="s1", manifest_xxh3="0" * 16, files=2, bytes=4096,
                           derived_from=None), 0.2)
    m.reclaimed(["runs/r/s2/sessions/s2"])  # the sweep's keys: the session id is the last part
    assert _value(m, "ckptd_upload_sessions_open") == 1
    assert _value(m, "ckptd_sessions_reclaimed_total") == 1 and _value(m, "ckptd_commits_total") == 1
    assert _value(m, "ckptd_committed_bytes_total") == 4096 and _value(m, "ckptd_commit_seconds_count") == 1


class _UnreadableStorage(LocalStorage):
    fail = False

    def read_or_none(self, key: str) -> bytes | None:
        if self.fail:
            raise StorageError(f"storage get of {key!r} failed: injected", key=key)
        return super().read_or_none(key)


def test_a_scrape_keeps_a_session_it_cannot_ask_about_and_drops_one_that_is_gone(tmp_path):
    storage = _UnreadableStorage(tmp_path, durable=False)
    store = SessionStore(storage)
    m = Metrics()
    m.watch_sessions(store)
    store.open("r", "1", OpenSession(session="s1", world_size=1))
    assert _value(m, "ckptd_upload_sessions_open") == 1  # heard from the store
    storage.fail = True
    m.render()  # the store cannot be read: the session may still be open
    assert _value(m, "ckptd_upload_sessions_open") == 1
    storage.fail = False
    m.render()
    assert _value(m, "ckptd_upload_sessions_open") == 1  # open, as the store now says
    m.opened("r", "2", "s-never")  # heard of, never stored: the scrape finds it is no session
    assert _value(m, "ckptd_upload_sessions_open") == 2
    m.render()
    assert _value(m, "ckptd_upload_sessions_open") == 1


def test_a_finished_jobs_gauges_go_after_they_were_kept(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path, durable=False)
    m = Metrics()
    now = now_utc()
    st = JobStatus(id="job9", state="done", source="r/1", out="r/1-full", spec="full", bytes_total=10, bytes_done=10,
                   created_at=now, updated_at=now)
    put_status(storage, st)
    m.track_job(storage, "job9")
    monkeypatch.setattr(metrics_module, "FINISHED_JOB_KEEP_SECONDS", 3600.0)
    for _ in range(2):
        m.render()
    assert _value(m, "ckptd_reshard_job_bytes_done", job="job9") == 10  # kept: a scrape sees its 100%
    assert _value(m, "ckptd_reshard_jobs_finished_total", state="done") == 1
    monkeypatch.setattr(metrics_module, "FINISHED_JOB_KEEP_SECONDS", 0.0)
    m.render()
    assert _value(m, "ckptd_reshard_job_bytes_done", job="job9") is None
    assert _value(m, "ckptd_reshard_job_bytes_planned", job="job9") is None
    assert _value(m, "ckptd_reshard_jobs_finished_total", state="done") == 1
    assert _value(m, "ckptd_reshard_jobs_active") == 0
