"""Route-level tests in process (httpx.ASGITransport): OpenAPI, probes, error mapping, ranges."""

from __future__ import annotations

import asyncio

import httpx
import torch
import xxhash

from ckptd.service import Settings, create_app
from ckptd.storage import LocalStorage


def _call(app, method: str, url: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url, **kw)
    return asyncio.run(go())


def _app(tmp_path):
    return create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))


def test_openapi_lists_every_route_and_probes_answer(tmp_path):
    app = _app(tmp_path)
    doc = _call(app, "GET", "/openapi.json").json()
    paths = set(doc["paths"])
    for p in ("/v1/checkpoints/{run}/{name}/sessions", "/v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file}",
              "/v1/checkpoints/{run}/{name}/sessions/{sid}/ranks/{rank}", "/v1/checkpoints/{run}/{name}",
              "/v1/checkpoints/{run}/{name}/read-plan", "/v1/checkpoints/{run}/{name}/files/{file}",
              "/v1/runs", "/v1/runs/{run}/checkpoints", "/healthz", "/readyz"):
        assert p in paths, p
    assert _call(app, "GET", "/healthz").json()["status"] == "ok"
    assert _call(app, "GET", "/readyz").status_code == 200


def test_errors_have_one_shape_and_status(tmp_path):
    app = _app(tmp_path)
    r = _call(app, "GET", "/v1/checkpoints/gpt/1000")
    assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found"
    assert "gpt/1000" in r.json()["error"]["message"]
    r = _call(app, "GET", "/v1/checkpoints/Bad_Run/1")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_name"
    r = _call(app, "POST", "/v1/checkpoints/gpt/1/sessions", json={"session": "s1", "world_size": 0})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert "world_size" in r.json()["error"]["message"]


def _commit_one(app, data: bytes) -> None:
    assert _call(app, "POST", "/v1/checkpoints/r/1/sessions", json={"session": "s1", "world_size": 1, "step": 1}).status_code == 200
    digest = xxhash.xxh3_64_hexdigest(data)
    r = _call(app, "PUT", "/v1/checkpoints/r/1/sessions/s1/files/f.bin", content=data,
              headers={"X-Ckptd-Xxh3": digest})
    assert r.status_code == 200, r.text
    n = len(data) // 4
    index = {"rank": 0, "world_size": 1, "files": ["f.bin"], "tensors": [{
        "name": "t", "shape": [n], "dtype": "float32", "group": "t", "chunks": [{
            "kind": "box", "rank": 0, "offsets": [0], "sizes": [n],
            "location": {"file": "f.bin", "offset": 0, "length": len(data), "raw_length": len(data),
                         "xxh3": digest}}]}]}
    r = _call(app, "PUT", "/v1/checkpoints/r/1/sessions/s1/ranks/0", json=index)
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def test_range_reads_and_read_plan(tmp_path):
    app = _app(tmp_path)
    data = torch.arange(1000, dtype=torch.float32).numpy().tobytes()
    _commit_one(app, data)
    r = _call(app, "GET", "/v1/checkpoints/r/latest/files/f.bin", headers={"Range": "bytes=8-15"})
    assert r.status_code == 206 and r.content == data[8:16]
    assert r.headers["content-range"] == f"bytes 8-15/{len(data)}"
    r = _call(app, "GET", "/v1/checkpoints/r/1/files/f.bin", headers={"Range": "bytes=-4"})
    assert r.content == data[-4:]
    r = _call(app, "GET", "/v1/checkpoints/r/1/files/f.bin", headers={"Range": "bytes=5000-6000"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = _call(app, "GET", "/v1/checkpoints/r/1/files/other.bin")
    assert r.status_code == 404 and "other.bin" in r.json()["error"]["message"]
    plan = _call(app, "POST", "/v1/checkpoints/r/1/read-plan",
                 json={"requests": [{"name": "t", "offsets": [10], "sizes": [5]}]}).json()
    (copy,) = plan["copies"]
    assert copy["regions"] == [[[10], [5]]] and plan["fetches"][0]["file"] == "f.bin"
    r = _call(app, "POST", "/v1/checkpoints/r/1/read-plan",
              json={"requests": [{"name": "t", "offsets": [990], "sizes": [20]}]})
    assert r.status_code == 422 and "'t'" in r.json()["error"]["message"]
    r = _call(app, "POST", "/v1/checkpoints/r/1/read-plan", json={"requests": [{"name": "nope"}]})
    assert r.status_code == 422 and "'nope'" in r.json()["error"]["message"]
