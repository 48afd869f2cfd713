"""The web view (``/ui``) over a real ``ckptd serve`` with tokens, real checkpoints and a real browser.

One server for the module, on a root filled through the public surface only: run ``alpha`` saved
by 2 gloo ranks (DTensor ``Shard(0)`` and ``Shard(1)`` tensors, a replicated one, an object; the
second save links its unchanged frozen tensor from the first), a reshard job of it to ``full``, a
service verification, one checkpoint's verification record removed, a gc dry run, a read lease, and an upload session left half done (rank 0's
file and index, rank 1's missing); run ``beta`` saved by one process. Tokens: ``admin``, a writer,
and a reader scoped to ``alpha`` only.

Checked: the shell and its assets are open and hold no data (and a strict CSP); every JSON route
answers 401 without a token and 403 for a run out of scope, and is paged with a maximum; and in
headless Chromium (Debian's, driven by Playwright; skipped without it), each page shows the
values of this root: run names, steps, sizes written and linked, verification, leases, lineage,
tensor names and shapes, one coloured segment per rank's chunk, a session's per-rank progress
(which moves without a reload when rank 1's file arrives), a job's state and plan, a gc reason.
"""

from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest
import torch
import xxhash

from ckptd.service.auth import hash_token
from ckptd.service.ui_static import STATIC
from ckptd_client import CheckpointClient
from support import ServerProcess, run_ranks, scaled

ADMIN, WRITER, READER = "ui-admin-token-0123456789", "ui-writer-token-0123456789", "ui-reader-token-0123456789"
TOKENS = (f"ops {ADMIN} admin;trainer sha256:{hash_token(WRITER)} write:*;"
          f"viewer sha256:{hash_token(READER)} read:alpha")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
UI_ROUTES = ["runs", "runs/alpha/checkpoints", "runs/alpha/steps", "checkpoints/alpha/10",
             "checkpoints/alpha/10/tensors", "checkpoints/alpha/10/objects", "runs/alpha/uploads", "runs/alpha/jobs",
             "runs/alpha/jobs/abc123/plan", "runs/alpha/retention"]


def save_alpha(rank: int, world: int, url: str, parent: str | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    full = {"w": torch.randn(8, 4, generator=g), "v": torch.randn(4, 6, generator=g),
            "frozen": torch.randn(64, 64, generator=g)}
    client = CheckpointClient(url, token=WRITER)
    for step in (10, 20):
        sd = {"model": {"w": distribute_tensor(full["w"] + step, mesh, [Shard(0)]),
                        "v": distribute_tensor(full["v"] + step, mesh, [Shard(1)]),
                        "frozen": distribute_tensor(full["frozen"], mesh, [Shard(0)]),
                        "bias": torch.full((5,), float(step))},
              "sched": {"epoch": step // 10}}
        kw = {"parent": parent} if parent and step == 20 else {}
        client.save(sd, f"alpha/{step}", **kw).wait()
    client.close()


def _h(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    s = ServerProcess(tmp / "root", env={"CKPTD_TOKENS": TOKENS}).start()
    try:
        beta = CheckpointClient(s.url, token=WRITER)
        beta.save({"model": {"w": torch.ones(3, 3)}}, "beta/5").wait()
        beta.close()
        run_ranks(save_alpha, 2, s.url, "beta/5", tmp=tmp)
        with httpx.Client(base_url=s.url, timeout=scaled(120)) as c:
            job = c.post("/v1/reshard", json={"source": "alpha/20", "to": "full", "jobs": 1}, headers=_h(ADMIN))
            assert job.status_code == 202, job.text
            assert c.post("/v1/checkpoints/alpha/10/verify", headers=_h(ADMIN)).json()["ok"]
            assert c.put("/v1/checkpoints/alpha/10/leases/dash1", headers=_h(READER)).status_code == 200
            deadline = time.monotonic() + scaled(120)
            while (st := c.get(f"/v1/jobs/{job.json()['id']}", headers=_h(ADMIN)).json())["state"] not in ("done", "failed"):
                assert time.monotonic() < deadline, st
                time.sleep(0.2)
            assert st["state"] == "done", st
            # every commit records its own check; a checkpoint without that record (a root written
            # before records existed) shows as "not verified"
            (tmp / "root" / "runs" / "alpha" / "20-full" / "VERIFIED.json").unlink()
            gc = c.post("/v1/runs/alpha/gc", json={"keep_last": 1, "dry_run": True}, headers=_h(ADMIN))
            assert gc.status_code == 200, gc.text
            # a save left half done: rank 0's data file and index are in, rank 1's are not
            w = _h(WRITER)
            base = "/v1/checkpoints/alpha/30/sessions/s-open"
            assert c.post("/v1/checkpoints/alpha/30/sessions", json={"session": "s-open", "world_size": 2, "step": 30},
                          headers=w).status_code == 200
            _upload(c, f"{base}/files/r000000-0000.bin", 0)
            index = {"rank": 0, "world_size": 2, "files": ["r000000-0000.bin"], "tensors": [{
                "name": "model.x", "shape": [500], "dtype": "float32", "group": "model", "chunks": [{
                    "kind": "box", "rank": 0, "offsets": [0], "sizes": [250], "location": {
                        "file": "r000000-0000.bin", "offset": 0, "length": 1000, "raw_length": 1000,
                        "xxh3": xxhash.xxh3_64_hexdigest(_data(0))}}]}]}
            r = c.put(f"{base}/ranks/0", json=index, headers=w)
            assert r.status_code == 200 and r.json()["state"] == "open", r.text
        yield s
    finally:
        s.stop()


def _data(rank: int) -> bytes:
    return torch.arange(250, dtype=torch.float32).add(rank).numpy().tobytes()


def _upload(c: httpx.Client, url: str, rank: int) -> None:
    data = _data(rank)
    r = c.put(url, content=data, headers={**_h(WRITER), "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert r.status_code == 200, r.text


# -- the shell and the JSON routes, over HTTP --------------------------------------------------------

def test_the_shell_and_its_assets_are_open_static_and_hold_no_data(srv):
    assets = sorted(p.name for p in STATIC.iterdir())
    assert {"index.html", "app.js", "api.js", "ui.css"} <= set(assets)
    for path in ["/ui", "/ui/", *(f"/ui/static/{a}" for a in assets)]:
        r = httpx.get(f"{srv.url}{path}", timeout=10)  # no token
        assert r.status_code == 200 and r.content, path
        assert "script-src 'self'" in r.headers["content-security-policy"], path
        assert r.headers["x-content-type-options"] == "nosniff"
        for secret in ("alpha", "beta", "r000000", ADMIN, "manifest_xxh3\":\""):
            assert secret not in r.text, (path, secret)
    html = httpx.get(f"{srv.url}/ui", timeout=10).text
    srcs = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    assert srcs and all(u.startswith(("/ui/static/", "#/")) for u in srcs), srcs  # nothing from elsewhere
    assert httpx.get(f"{srv.url}/ui/static/nothing.js", timeout=10).status_code == 401  # no other file


def test_every_json_route_needs_a_token(srv):
    for path in UI_ROUTES:
        for token in (None, "not-a-token-we-know-of-at-all"):
            r = httpx.get(f"{srv.url}/v1/ui/{path}", headers=_h(token), timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)


def test_a_reader_of_one_run_sees_only_that_run(srv):
    runs = httpx.get(f"{srv.url}/v1/ui/runs", headers=_h(READER), timeout=10).json()
    assert [r["run"] for r in runs["items"]] == ["alpha"] and runs["total"] == 1
    assert runs["items"][0]["checkpoints"] == 3 and runs["items"][0]["latest"] == "20"
    admin = httpx.get(f"{srv.url}/v1/ui/runs", headers=_h(ADMIN), timeout=10).json()
    assert [r["run"] for r in admin["items"]] == ["alpha", "beta"]
    for path in [p.replace("alpha", "beta").replace("/10", "/5") for p in UI_ROUTES if "alpha" in p]:
        r = httpx.get(f"{srv.url}/v1/ui/{path}", headers=_h(READER), timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (path, r.text)
        assert "request_id" in r.json()["error"]
    assert httpx.get(f"{srv.url}/v1/ui/checkpoints/beta/5", headers=_h(ADMIN), timeout=10).status_code == 200


def test_lists_are_paged_with_a_maximum(srv):
    url = f"{srv.url}/v1/ui/runs/alpha/checkpoints"
    first = httpx.get(url, params={"limit": 1}, headers=_h(READER), timeout=10).json()
    second = httpx.get(url, params={"limit": 1, "offset": 1}, headers=_h(READER), timeout=10).json()
    assert first["total"] == second["total"] == 3 and len(first["items"]) == len(second["items"]) == 1
    assert [first["items"][0]["name"], second["items"][0]["name"]] in (["20-full", "20"], ["20", "20-full"])
    r = httpx.get(url, params={"limit": 501}, headers=_h(READER), timeout=10)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    t = httpx.get(f"{srv.url}/v1/ui/checkpoints/alpha/20/tensors", params={"limit": 2}, headers=_h(READER),
                  timeout=10).json()
    assert len(t["items"]) == 2 and t["total"] == 4
    row = httpx.get(url, headers=_h(READER), timeout=10).json()["items"]
    by = {r["name"]: r for r in row}
    s10, s20 = by["10"]["stats"], by["20"]["stats"]
    assert s10["linked_bytes"] == 0 and s20["linked_bytes"] > 64 * 64 * 4 // 2 - 1  # rank's frozen half, linked
    assert s20["written_bytes"] == s20["file_bytes"] - s20["linked_bytes"] < s10["written_bytes"]
    assert s10["logical_bytes"] == (8 * 4 + 4 * 6 + 64 * 64 + 5) * 4 and s10["world_size"] == 2
    assert by["10"]["verification"]["ok"] is True and by["10"]["leases"] == ["client-dash1"]
    assert by["20-full"]["derived_from"] == "alpha/20" and by["20-full"]["stats"]["world_size"] == 1


# -- the pages, in a browser -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium on PATH (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install 'playwright>=1.40')")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page_as(browser, srv):
    contexts, errors = [], []

    def open_(token: str | None, hash_: str):
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(ctx)
        if token:
            ctx.add_init_script(f"sessionStorage.setItem('ckptd.token', {token!r})")
        page = ctx.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and "401" not in m.text and "403" not in m.text
                and errors.append(m.text))
        page.set_default_timeout(scaled(20) * 1000)
        page.goto(f"{srv.url}/ui#{hash_}")
        return page

    yield open_
    for ctx in contexts:
        ctx.close()
    assert not errors, errors  # no script error, no refused resource (CSP), on any page


def _ready(page, state: str = "ready") -> None:
    page.wait_for_selector(f"main[data-state={state}]")


def test_runs_page_lists_only_the_readers_runs(page_as):
    page = page_as(READER, "/")
    _ready(page)
    rows = page.locator("#runs tbody tr")
    assert rows.count() == 1 and rows.first.get_attribute("data-run") == "alpha"
    cells = rows.first.locator("td").all_inner_texts()
    assert cells[:4] == ["alpha", "3", "20", "20"], cells
    assert "beta" not in page.inner_text("body")


def test_run_page_shows_checkpoints_on_a_timeline_with_lineage(page_as):
    page = page_as(READER, "/run/alpha")
    _ready(page)
    rows = {r.get_attribute("data-name"): r.locator("td").all_inner_texts() for r in page.locator("#checkpoints tbody tr").all()}
    assert set(rows) == {"10", "20", "20-full"}
    assert rows["10"][0] == "10" and rows["20"][0] == "20"
    assert rows["20"][3] != "0 B" and rows["10"][3] == "0 B"  # linked: the frozen tensor, in the second save only
    assert "2 ranks" in rows["10"][6] and "1 rank" in rows["20-full"][6]
    assert rows["10"][7].startswith("✓ ok") and rows["20-full"][7] == "not verified"
    assert rows["20"][7].startswith("✓ ok")  # recorded by its commit
    assert rows["10"][8] == "client-dash1"
    assert "from alpha/20" in rows["20-full"][9]
    assert "parent beta/5" in rows["20"][9]
    steps = sorted(g.get_attribute("data-step") for g in page.locator("#timeline g.ckpt").all())
    assert steps == ["10", "20", "20"]
    nodes = {n.get_attribute("data-ref") for n in page.locator("#lineage g.node").all()}
    assert {"alpha/20", "alpha/20-full"} <= nodes
    assert "beta/5" in nodes  # the other run's parent, drawn above the run's checkpoints


def test_checkpoint_page_shows_tensors_and_which_rank_holds_what(page_as):
    page = page_as(READER, "/ckpt/alpha/20")
    _ready(page)
    tensors = {t.get_attribute("data-tensor"): t for t in page.locator("#tensors .tensor").all()}
    assert set(tensors) == {"model.w", "model.v", "model.frozen", "model.bias"}
    assert tensors["model.w"].locator(".shape").inner_text() == "[8, 4]"
    assert tensors["model.v"].locator(".dtype").inner_text() == "float32"

    def segs(name: str) -> list[tuple[str, float, float, float, float]]:
        out = []
        for r in tensors[name].locator("rect.seg").all():
            out.append((r.get_attribute("data-rank"), *(round(float(r.get_attribute(k)), 1)
                                                       for k in ("x", "width", "y", "height"))))
        return sorted(out)

    assert segs("model.w") == [("0", 0.0, 150.0, 0.0, 18.0), ("1", 150.0, 150.0, 0.0, 18.0)]  # rows: Shard(0)
    assert segs("model.v") == [("0", 0.0, 300.0, 0.0, 9.0), ("1", 0.0, 300.0, 9.0, 9.0)]  # columns: Shard(1)
    assert len(segs("model.bias")) == 1  # replicated: saved once, by one rank
    tensors["model.w"].locator("details.chunks summary").click()
    chunk_rows = tensors["model.w"].locator("details.chunks tbody tr").all_inner_texts()
    assert len(chunk_rows) == 2 and "at [4, 0] size [4, 4]" in " ".join(chunk_rows)
    assert "sched.epoch" in page.locator("#objects").inner_text() and "2" in page.locator("#objects").inner_text()
    assert page.locator("#rank-bytes rect").count() == 2
    assert "20-full" in page.inner_text("body")  # derived here
    page.fill("#tensor-filter", "frozen")
    page.press("#tensor-filter", "Enter")
    page.locator("#tensors .tensor[data-tensor='model.w']").wait_for(state="detached")
    assert page.locator("#tensors .tensor").get_attribute("data-tensor") == "model.frozen"


def test_live_page_shows_uploads_jobs_and_gc_and_refreshes_without_a_reload(page_as, srv):
    page = page_as(READER, "/live/alpha")
    _ready(page)
    card = page.locator("#uploads .upload")
    assert card.count() == 1 and card.get_attribute("data-name") == "30"
    assert "1 of 2 ranks done" in card.inner_text()
    assert card.locator("[data-state]").inner_text() == "open"
    ranks = card.locator(".rank").all_inner_texts()
    assert ranks[0].startswith("rank 0: 1 file, 1000 B") and "index ✓" in ranks[0]
    assert ranks[1].startswith("rank 1: 0 files") and "index pending" in ranks[1]
    job = page.locator("#jobs tbody tr")
    assert job.count() == 1 and job.locator("[data-state]").inner_text() == "done"
    assert "alpha/20-full" in job.inner_text() and "full" in job.inner_text()
    job.locator("button").click()
    page.wait_for_selector("#plan .plan")
    assert "work units" in page.inner_text("#plan") and page.locator("#plan .plan-ranks tbody tr").count() == 1
    reasons = {r.get_attribute("data-name"): r.locator(".reason").inner_text()
               for r in page.locator("#retention .decision tr[data-name]").all()}
    assert reasons["20"] == "newest committed checkpoint", reasons
    assert "dry run" in page.inner_text("#retention")
    page.evaluate("window.__marker = 1")  # gone if the page reloads
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        _upload(c, "/v1/checkpoints/alpha/30/sessions/s-open/files/r000001-0000.bin", 1)
    page.locator("#uploads .rank[data-rank='1']", has_text="1 file,").wait_for(timeout=scaled(15) * 1000)
    assert page.evaluate("window.__marker") == 1


def test_the_page_asks_for_a_token_and_refuses_other_runs(page_as):
    page = page_as(None, "/")
    _ready(page, "login")
    assert page.locator("#login").is_visible() and page.locator("#runs").count() == 0
    page.fill("#token", "wrong-token-wrong-token")
    page.click("#login button[type=submit]")
    page.locator("#login-error", has_text="did not accept").wait_for()
    page.fill("#token", READER)
    page.click("#login button[type=submit]")
    _ready(page)
    assert page.locator("#runs tbody tr").count() == 1
    assert page.evaluate("sessionStorage.getItem('ckptd.token')") == READER
    page.goto(page.url.split("#")[0] + "#/run/beta")
    _ready(page, "error")
    assert page.locator("#error").get_attribute("data-status") == "403"
