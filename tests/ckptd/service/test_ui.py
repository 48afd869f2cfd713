"""The web view (``/ui``) over a real ``ckptd serve`` with tokens, real checkpoints and a real browser.

One server for the module, on a root filled through the public surface only: run ``alpha`` saved
by 2 gloo ranks (DTensor ``Shard(0)`` and ``Shard(1)`` tensors, a replicated one, an object; the
second save links its unchanged frozen tensor from the first), a reshard job of it to ``full``, a
service verification (``POST .../verify`` of ``alpha/10``), ``alpha/20``'s commit record replaced by
``ckptd verify --in-service``'s, ``alpha/20-full``'s record removed and the checkpoint then passed
by ``ckptd verify --root`` (which records nothing), a gc dry run, a read lease, an upload session
left half done (rank 0's file and index, rank 1's missing), and a stale one (opened longer ago than
the session TTL, rank 1 killed mid-file: its unfinished write left on disk); run ``beta`` saved by
one process. Tokens: ``admin``, a writer, and a reader scoped to ``alpha`` only.

Checked: the shell and its assets are open and hold no data (and a strict CSP); every JSON route
answers 401 without a token and 403 for a run out of scope, and is paged with a maximum; and in
headless Chromium (Debian's, driven by Playwright; skipped without it), each page shows the
values of this root: run names, steps, sizes written and linked, verification, leases, lineage,
tensor names and shapes, one coloured segment per rank's chunk, a session's per-rank progress
(which moves without a reload when rank 1's file arrives), a job's state and plan, a gc reason.

And what a new user found wrong (issue 31): no page prints ``null``; a recorded verification shows
"✓ ok" on the run page, the checkpoint page and the timeline tooltip, and no record shows "no
record" (never "not verified": ``ckptd verify --root`` records nothing); sizes are the CLI's
(``ckptd.cli.output.human``: decimal kB/MB/GB); an unknown run is a 404 and "no such run: NAME";
a session shows the bytes it holds (unfinished writes too), its last activity and whether it is
stale; rank colours are never the failed red or the verified green.
"""

from __future__ import annotations

import colorsys
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import torch
import xxhash

from ckptd.cli.output import human
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
STALE_TTL = 6 * 3600  # the default CKPTD_STALE_SESSION_TTL
PARTIAL = 300_000  # bytes of the stale session's unfinished write
DEAD_AFTER = 300  # the default CKPTD_DEAD_SESSION_AFTER
NO_TEXT = re.compile(r"\b(null|undefined|NaN)\b|\b[KMGT]iB\b")  # on no page


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
    # no sweep while the module runs (the first one runs at start, before any session): the stale
    # session below stays to be shown
    s = ServerProcess(tmp / "root", env={"CKPTD_TOKENS": TOKENS, "CKPTD_RECLAIM_INTERVAL": "86400"}).start()
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
            # ... and `ckptd verify --root` passing it records nothing: the view cannot know of it
            out = _cli("verify", "--root", str(tmp / "root"), "alpha/20-full")
            assert out.returncode == 0 and out.stdout.startswith("OK alpha/20-full"), out
            assert not (tmp / "root" / "runs" / "alpha" / "20-full" / "VERIFIED.json").exists()
            # `ckptd verify --in-service` records (the service's worker checks): alpha/20's record is its
            (tmp / "root" / "runs" / "alpha" / "20" / "VERIFIED.json").unlink()
            out = _cli("verify", "--in-service", "--server", s.url, "alpha/20", token=ADMIN)
            assert out.returncode == 0 and out.stdout.startswith("OK alpha/20"), out
            assert (tmp / "root" / "runs" / "alpha" / "20" / "VERIFIED.json").exists()
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
            # a save whose ranks died: rank 0's file is in, rank 1 was killed while writing its file
            # (a local root keeps the hidden temp a killed writer leaves), and it was opened longer
            # ago than the session TTL (its SESSION.json says when)
            stale = "/v1/checkpoints/alpha/40/sessions/s-stale"
            assert c.post("/v1/checkpoints/alpha/40/sessions", json={"session": "s-stale", "world_size": 2, "step": 40},
                          headers=w).status_code == 200
            _upload(c, f"{stale}/files/r000000-0000.bin", 0)
            sdir = tmp / "root" / "runs" / "alpha" / "40" / "sessions" / "s-stale"
            (sdir / "files" / ".r000001-0000.bin.tmp-0123456789ab").write_bytes(b"\0" * PARTIAL)
            meta = json.loads((sdir / "SESSION.json").read_text())
            meta["created_at"] = (datetime.now(timezone.utc) - timedelta(seconds=STALE_TTL + 3600)).isoformat()
            (sdir / "SESSION.json").write_text(json.dumps(meta))
            # a save whose ranks stopped minutes ago: opened well within the TTL, but no writer heard
            # from for longer than CKPTD_DEAD_SESSION_AFTER (its activity record says when one last was)
            idle = "/v1/checkpoints/alpha/50/sessions/s-idle"
            assert c.post("/v1/checkpoints/alpha/50/sessions", json={"session": "s-idle", "world_size": 2, "step": 50},
                          headers=w).status_code == 200
            _upload(c, f"{idle}/files/r000000-0000.bin", 0)
            idir = tmp / "root" / "runs" / "alpha" / "50" / "sessions" / "s-idle"
            meta = json.loads((idir / "SESSION.json").read_text())
            meta["created_at"] = (datetime.now(timezone.utc) - timedelta(seconds=DEAD_AFTER + 120)).isoformat()
            (idir / "SESSION.json").write_text(json.dumps(meta))
            (idir / "ACTIVE.json").write_text(json.dumps(
                {"at": (datetime.now(timezone.utc) - timedelta(seconds=DEAD_AFTER + 60)).isoformat()}))
        yield s
    finally:
        s.stop()


def _cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CKPTD_TOKEN": token or ""}
    env.pop("CKPTD_URL", None)
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], env=env, capture_output=True, text=True,
                          check=False, timeout=scaled(180))


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


def test_an_unknown_run_is_a_typed_404_not_an_empty_page(srv):
    for path in ["runs/nosuchrun/checkpoints", "runs/nosuchrun/steps", "checkpoints/nosuchrun/10",
                 "checkpoints/nosuchrun/10/tensors"]:
        r = httpx.get(f"{srv.url}/v1/ui/{path}", headers=_h(ADMIN), timeout=10)
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "not_found", (path, r.text)
        assert err["details"] == {"run": "nosuchrun"} and "no such run" in err["message"] and err["request_id"]
        # a token that may not read it learns nothing of whether it exists
        assert httpx.get(f"{srv.url}/v1/ui/{path}", headers=_h(READER), timeout=10).status_code == 403
    assert httpx.get(f"{srv.url}/v1/ui/checkpoints/alpha/99", headers=_h(READER),
                     timeout=10).json()["error"]["code"] == "checkpoint_not_found"  # the run exists, not that one
    up = httpx.get(f"{srv.url}/v1/ui/runs/nosuchrun/uploads", headers=_h(ADMIN), timeout=10).json()
    assert up["run_exists"] is False and up["items"] == []
    assert httpx.get(f"{srv.url}/v1/ui/runs/alpha/uploads", headers=_h(READER), timeout=10).json()["run_exists"]


def test_a_session_shows_what_it_holds_its_last_activity_and_whether_it_is_stale(srv):
    items = httpx.get(f"{srv.url}/v1/ui/runs/alpha/uploads", headers=_h(READER), timeout=10).json()["items"]
    by = {u["name"]: u for u in items}
    st, op, idle = by["40"], by["30"], by["50"]
    assert st["stale"] is True and op["stale"] is False and st["ttl_seconds"] == STALE_TTL
    assert (st["reclaim_reason"], op["reclaim_reason"], idle["reclaim_reason"]) == ("expired", "idle", "idle")
    assert idle["stale"] is True and idle["dead_after_seconds"] == DEAD_AFTER
    # the one rule: the last writer heard from (the upload, or the record) plus CKPTD_DEAD_SESSION_AFTER
    assert datetime.fromisoformat(idle["reclaim_at"]) == \
        datetime.fromisoformat(idle["last_activity"]) + timedelta(seconds=DEAD_AFTER)
    assert st["files"] == 1 and st["bytes"] == 1000 and st["partial_files"] == 1 and st["partial_bytes"] == PARTIAL
    assert [(r["files"], r["bytes"], r["partial_bytes"]) for r in st["ranks"]] == [(1, 1000, 0), (0, 0, PARTIAL)]
    for u in (st, op):
        age = datetime.now(timezone.utc) - datetime.fromisoformat(u["last_activity"])
        assert timedelta(seconds=-5) < age < timedelta(seconds=scaled(600)), u  # the upload, not the opening
    assert datetime.fromisoformat(st["reclaim_at"]) < datetime.now(timezone.utc) < datetime.fromisoformat(op["reclaim_at"])


def test_a_file_streaming_in_shows_as_received_now_not_as_old_activity(srv):
    """A rank streaming a large file: the live page's JSON says the service is receiving it now, and
    how much so far, rather than the last recorded activity (which the upload moves only at its end);
    when the stream is cut, nothing is being received."""
    import socket

    def receiving() -> dict:
        items = httpx.get(f"{srv.url}/v1/ui/runs/alpha/uploads", headers=_h(READER), timeout=10).json()["items"]
        return {u["name"]: u for u in items}["30"]["receiving"]

    assert receiving() == {"files": 0, "bytes": 0}
    sent = 24 << 20  # more than the service batches before it writes
    head = (f"PUT /v1/checkpoints/alpha/30/sessions/s-open/files/r000001-0000.bin HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {WRITER}\r\nX-Ckptd-Xxh3: {'0' * 16}\r\nContent-Length: {64 << 20}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\0" * sent)
        deadline = time.monotonic() + scaled(30)
        while (rx := receiving())["bytes"] == 0:
            assert time.monotonic() < deadline, rx
            time.sleep(0.1)
        assert rx["files"] == 1 and 0 < rx["bytes"] <= sent, rx
    deadline = time.monotonic() + scaled(30)
    while (rx := receiving())["files"]:
        assert time.monotonic() < deadline, rx
        time.sleep(0.1)
    assert rx == {"files": 0, "bytes": 0}


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
        page.on("console", lambda m: m.type == "error" and not re.search(r"\b40[134]\b", m.text)
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
    text = page.inner_text("body")
    assert not NO_TEXT.search(text), NO_TEXT.search(text)  # no "null", no "undefined", no binary units


def _colour(page, css: str) -> tuple[int, int, int]:
    """A CSS colour as the browser resolves it."""
    rgb = page.evaluate("""(c) => { const p = document.createElement("span"); document.body.append(p);
        p.style.color = c; const out = getComputedStyle(p).color; p.remove(); return out; }""", css)
    return tuple(int(x) for x in re.findall(r"\d+", rgb)[:3])


def test_runs_page_lists_only_the_readers_runs(page_as):
    page = page_as(READER, "/")
    _ready(page)
    rows = page.locator("#runs tbody tr")
    assert rows.count() == 1 and rows.first.get_attribute("data-run") == "alpha"
    cells = rows.first.locator("td").all_inner_texts()
    assert cells[:4] == ["alpha", "3", "20", "20"], cells
    assert "beta" not in page.inner_text("body")


def test_run_page_shows_checkpoints_on_a_timeline_with_lineage(page_as, srv):
    page = page_as(READER, "/run/alpha")
    _ready(page)
    rows = {r.get_attribute("data-name"): r.locator("td").all_inner_texts() for r in page.locator("#checkpoints tbody tr").all()}
    assert set(rows) == {"10", "20", "20-full"}
    assert rows["10"][0] == "10" and rows["20"][0] == "20"
    assert rows["20"][3] != "0 B" and rows["10"][3] == "0 B"  # linked: the frozen tensor, in the second save only
    assert "2 ranks" in rows["10"][6] and "1 rank" in rows["20-full"][6]
    assert rows["10"][7].startswith("✓ ok")  # POST .../verify
    assert rows["20"][7].startswith("✓ ok")  # ckptd verify --in-service
    assert rows["20-full"][7] == "no record"  # ckptd verify --root passed it, and records nothing: not "not verified"
    assert rows["10"][8] == "client-dash1"
    assert "from alpha/20" in rows["20-full"][9]
    assert "parent beta/5" in rows["20"][9]
    steps = sorted(g.get_attribute("data-step") for g in page.locator("#timeline g.ckpt").all())
    assert steps == ["10", "20", "20"]
    tips = {g.get_attribute("data-name"): g.locator("title").text_content() for g in page.locator("#timeline g.ckpt").all()}
    assert tips["10"].endswith("verification: ✓ ok") and tips["20"].endswith("verification: ✓ ok"), tips
    assert tips["20-full"].endswith("verification: no record"), tips
    stats = {r["name"]: r["stats"] for r in httpx.get(f"{srv.url}/v1/ui/runs/alpha/checkpoints", headers=_h(READER),
                                                       timeout=10).json()["items"]}
    for name, cells in rows.items():  # sizes in the CLI's units and rounding (ckptd show, ckptd verify)
        assert cells[2] == human(stats[name]["written_bytes"]) and cells[3] == human(stats[name]["unchanged_bytes"])
        assert f"{human(stats[name]['written_bytes'])} written" in tips[name]
    nodes = {n.get_attribute("data-ref") for n in page.locator("#lineage g.node").all()}
    assert {"alpha/20", "alpha/20-full"} <= nodes
    assert "beta/5" in nodes  # the other run's parent, drawn above the run's checkpoints


def test_checkpoint_page_shows_tensors_and_which_rank_holds_what(page_as, srv):
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
    # rank colours are never the status colours: not the failed red, not the verified green
    status = {_colour(page, page.evaluate(f"getComputedStyle(document.documentElement).getPropertyValue('{v}')"))
              for v in ("--ok", "--bad")}
    assert status == {_colour(page, "#1f8a4c"), _colour(page, "#c62828")}  # the timeline's bars too
    fills = [r.get_attribute("fill") for r in page.locator("rect.seg, #rank-bytes rect").all()]
    swatches = page.locator(".legend .swatch").evaluate_all("els => els.map((e) => getComputedStyle(e).backgroundColor)")
    assert len(fills) > 8 and swatches
    for c in fills + swatches:
        assert _colour(page, c) not in status, c
    # files: sizes as the CLI prints them, and under the table a count, never "null"
    files = httpx.get(f"{srv.url}/v1/ui/checkpoints/alpha/20", headers=_h(READER), timeout=10).json()["files"]
    cells = [r.locator("td").all_inner_texts() for r in page.locator("#files tbody tr").all()]
    assert [c[1] for c in cells] == [human(f["size"]) for f in files] and len(files) == 4
    linked = sum(f["linked"] is not None for f in files)
    assert page.inner_text("#files-note") == (f"4 files, {human(sum(f['size'] for f in files))}, {linked} linked "
                                              "from earlier checkpoints") and linked == 2
    page.fill("#tensor-filter", "frozen")
    page.press("#tensor-filter", "Enter")
    page.locator("#tensors .tensor[data-tensor='model.w']").wait_for(state="detached")
    assert page.locator("#tensors .tensor").get_attribute("data-tensor") == "model.frozen"


def test_live_page_shows_uploads_jobs_and_gc_and_refreshes_without_a_reload(page_as, srv):
    page = page_as(READER, "/live/alpha")
    _ready(page)
    assert sorted(c.get_attribute("data-name") for c in page.locator("#uploads .upload").all()) == ["30", "40", "50"]
    card = page.locator("#uploads .upload[data-name='30']")
    assert "1 of 2 ranks done" in card.inner_text()
    assert card.locator("[data-state]").inner_text() == "open"
    assert card.locator("[data-stale]").count() == 0 and "stale" not in card.inner_text()
    ranks = card.locator(".rank").all_inner_texts()
    assert ranks[0].startswith(f"rank 0: 1 file, {human(1000)}") and "index ✓" in ranks[0]
    assert ranks[1].startswith("rank 1: 0 files") and "index pending" in ranks[1]
    assert re.search(r"last writer activity (just now|\d+ s ago|\d+ min ago)", card.locator(".holds").inner_text())
    # the save whose ranks died: what it holds (rank 1's unfinished write too), and that it is stale
    dead = page.locator("#uploads .upload[data-name='40']")
    holds = dead.locator(".holds").inner_text()
    assert holds.startswith(f"holds {human(1000 + PARTIAL)}: 1 file of {human(1000)} stored, and {human(PARTIAL)} in "
                            "1 unfinished write · last writer activity"), holds
    assert dead.locator("[data-state]").inner_text() == "open" and dead.locator("[data-stale]").inner_text() == "stale"
    assert "stale: opened more than the session TTL (6 h" in dead.inner_text()
    assert dead.locator(".stale-note").get_attribute("data-reason") == "expired"
    # the save whose ranks stopped: stale well before the TTL, and the page says why
    stopped = page.locator("#uploads .upload[data-name='50']")
    assert stopped.locator("[data-stale]").inner_text() == "stale"
    assert stopped.locator(".stale-note").get_attribute("data-reason") == "idle"
    assert "stale: no rank was heard from for 5 min (CKPTD_DEAD_SESSION_AFTER)" in stopped.inner_text()
    dranks = dead.locator(".rank").all_inner_texts()
    assert dranks[1].startswith(f"rank 1: 0 files, 0 B + {human(PARTIAL)} unfinished"), dranks
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


def test_checkpoint_page_shows_its_verification_record(page_as):
    page = page_as(READER, "/ckpt/alpha/20")  # recorded by `ckptd verify --in-service`
    _ready(page)
    assert page.locator("#summary tbody tr td").nth(7).inner_text().startswith("✓ ok")
    rec = page.inner_text("#verification")
    assert rec.startswith("record\n✓ ok") and "verified at" in rec and "problems\nnone" in rec, rec
    assert re.search(r"4 files, 4 tensors, \d+ chunks: [\d.]+ kB read in [\d.]+ s", rec), rec
    page.goto(page.url.split("#")[0] + "#/ckpt/alpha/20-full")  # passed `ckptd verify --root`: no record
    page.locator("#summary tr[data-name='20-full']").wait_for()
    _ready(page)
    assert page.locator("#summary tbody tr td").nth(7).inner_text() == "no record"
    rec = page.inner_text("#verification")
    assert rec.startswith("record\nno record") and "ckptd verify --root" in rec, rec


def test_a_commit_record_shows_on_every_page_for_another_token(page_as):
    page = page_as(ADMIN, "/ckpt/beta/5")  # recorded by its commit only
    _ready(page)
    assert page.locator("#summary tbody tr td").nth(7).inner_text().startswith("✓ ok")
    assert page.inner_text("#verification").startswith("record\n✓ ok")
    page.goto(page.url.split("#")[0] + "#/run/beta")
    page.locator("#checkpoints tr[data-name='5']").wait_for()
    _ready(page)
    assert page.locator("#checkpoints tr[data-name='5'] td").nth(7).inner_text().startswith("✓ ok")
    assert page.locator("#timeline g.ckpt title").text_content().endswith("verification: ✓ ok")


def test_the_view_formats_bytes_as_the_cli_does_and_keeps_ranks_off_status_hues(page_as):
    page = page_as(READER, "/")
    _ready(page)
    sizes = [0, 1, 999, 1000, 1049, 1050, 1250, 1350, 2250, 999_949, 999_950, 999_999, 10**6, 1_250_000,
             12_345_678, 987_654_321, 5 * 10**12, 123_456_789_012_345]
    got = page.evaluate("async (xs) => { const m = await import('/ui/static/dom.js'); return xs.map((n) => m.bytes(n)); }",
                        sizes)
    assert got == [human(n) for n in sizes]
    hues = page.evaluate("async () => { const m = await import('/ui/static/dom.js'); "
                         "return Array.from({length: 1024}, (_, r) => m.rankColour(r)); }")
    status = [colorsys.rgb_to_hls(*(x / 255 for x in _colour(page, c)))[0] * 360 for c in ("#1f8a4c", "#c62828")]
    arcs = page.evaluate("async () => (await import('/ui/static/dom.js')).RANK_HUES")
    assert not any(lo <= h <= hi for h in status for lo, hi in arcs)  # the palette excludes green and red
    for c in hues:
        h = float(re.match(r"hsl\(([\d.]+),", c)[1])
        assert any(lo <= h <= hi for lo, hi in arcs), c
        assert all(min(abs(h - x), 360 - abs(h - x)) > 30 for x in status), c  # far from both, all around the circle
    assert len(set(hues)) == len(hues)  # every rank of a 1,024-rank save its own colour


def test_an_unknown_run_says_so(page_as):
    page = page_as(ADMIN, "/run/nosuchrun")
    _ready(page, "error")
    assert page.inner_text("#no-such-run") == "no such run: nosuchrun"
    assert page.locator("#error").get_attribute("data-status") == "404"
    assert page.locator("#checkpoints").count() == 0
    page.goto(page.url.split("#")[0] + "#/ckpt/nosuchrun/10")
    page.locator("#crumbs span", has_text="10").wait_for()  # this page's, not the last one's
    _ready(page, "error")
    assert page.inner_text("#no-such-run") == "no such run: nosuchrun"
    page.goto(page.url.split("#")[0] + "#/live/nosuchrun")
    _ready(page)
    assert page.inner_text("#uploads #no-such-run") == "no such run: nosuchrun"


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
