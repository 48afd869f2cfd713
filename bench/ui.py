"""The web view's run page over a run of thousands of checkpoints: how long until its table is shown.

    .venv/bin/python -m bench.ui --checkpoints 2000 --repeat 5 --out bench/results/ui.json
    .venv/bin/python -m bench.ui --checkpoints 300 --repeat 1 --screenshots docs/img   # the docs' pictures

Goal (the issue of the web view): the run page of a run with 2,000 checkpoints renders in under a
second. Not a timed test: a measurement, written to ``--out``.

What one run does:

1. Starts a real ``ckptd serve`` with tokens (tests/support.py ``ServerProcess``) on a root in a
   temporary work directory, and saves one real checkpoint of ``--ranks`` gloo ranks through
   ``CheckpointClient`` (DTensor ``Shard(0)`` and ``Shard(1)`` tensors, a replicated one, an object).
2. Replicates it to ``--checkpoints`` checkpoints of the run, fast and without the service: each
   copy hard-links the seed's data files into a session of its own, writes the seed's manifest
   with its own name, step and session (so a new digest) and a ``COMMITTED`` marker naming that
   digest. The visibility rule (``ckptd/store/visibility.py``: a marker that parses and names the
   digest of a manifest that parses and agrees with it on ref, session, step, ``derived_from`` and
   ``parent``) holds for each copy, so the service lists them like any commit (a copy is not
   checked by a commit: the benchmark needs many checkpoints, not many saves). Every 100th step
   also gets a derived copy (``derived_from``), for the lineage graph.
3. Through the service: verifies the newest checkpoints, leases one, runs a gc dry run, starts a
   reshard job of the seed, and leaves an upload session half done, so every page has content.
4. In headless Chromium (Debian's ``chromium``, driven by Playwright), ``--repeat`` times, each in a
   fresh browser context (no cache): opens ``/ui#/run/RUN`` and times, from navigation start
   (``performance.now()`` in the page), until the first frame painted after the page put its
   checkpoint table (100 rows) and timeline into the document (the page's ``ckptd-page-painted``
   mark); the first load is cold for the service (it parses the page's manifests), the later ones
   warm. Also when the shell arrived, when the page started, the JSON calls it made (the page
   records each), the time Playwright saw the table (``observed_ms``, later by its polling), and
   the same JSON calls from Python (httpx).
5. With ``--screenshots DIR``: PNGs of the four pages (``ui-runs.png``, ``ui-run.png``,
   ``ui-checkpoint.png``, ``ui-live.png``).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from bench._report import add_workdir_args, git_state, work_dir, write_report

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess, run_ranks  # noqa: E402  (tests/support.py)

RUN = "bench"
TOKEN = "bench-ui-admin-token-0123456789"
GOAL_MS = 1000.0
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# -- the root ---------------------------------------------------------------------------------------

def save_seed(rank: int, world: int, url: str, ref: str) -> None:
    """One real checkpoint of ``world`` ranks, through the client (runs in each gloo rank)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptd_client import CheckpointClient

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {"model": {}, "optim": {"state": {}}, "sched": {"epoch": 3, "milestones": [10, 20]}}
    for i in range(4):
        for part, shape, place in (("attn.wq.weight", (64, 48), Shard(0)), ("attn.wo.weight", (48, 64), Shard(1)),
                                   ("mlp.w1.weight", (96, 48), Shard(0))):
            t = torch.randn(*shape, generator=g)
            sd["model"][f"layers.{i}.{part}"] = distribute_tensor(t, mesh, [place])
            sd["optim"]["state"][f"layers.{i}.{part}"] = {"exp_avg": distribute_tensor(t / 10, mesh, [place])}
    sd["model"]["norm.weight"] = torch.ones(48)  # replicated: saved once
    client = CheckpointClient(url, token=TOKEN)
    client.save(sd, ref).wait()
    client.close()


def replicate(root: Path, run: str, seed: str, steps: list[int], derived_every: int = 100) -> int:
    """Copies of the committed ``run/seed`` at ``steps`` (see the module docstring); returns how many."""
    from datetime import datetime, timezone

    from ckptd.storage import LocalStorage
    from ckptd_schemas.filedigest import xxh3_hex
    from ckptd_schemas.loadtree import LoadTree
    from ckptd.store.paths import Paths
    from ckptd.store.visibility import Visibility, manifest_file_name

    storage = LocalStorage(root, durable=False)
    c = Visibility(storage).resolve(run, seed)
    manifest = Visibility(storage).manifest(c)
    made = 0
    t0 = datetime.now(timezone.utc)
    for i, step in enumerate(steps):
        copies = [(str(step), None)] + ([(f"{step}-full", f"{run}/{step}")] if step % derived_every == 0 else [])
        for name, derived in copies:
            sid = f"copy{step:09d}{'d' if derived else 's'}"
            src_dir = Path(storage.local_path(Paths.session(run, seed, c.session)) or "") / "files"
            dst_dir = Path(storage.local_path(Paths.session(run, name, sid)) or "") / "files"
            dst_dir.mkdir(parents=True, exist_ok=True)
            for f in manifest.files:
                os.link(src_dir / f, dst_dir / f)
            when = t0 - timedelta(seconds=len(steps) - i)  # in the past, one second apart, oldest first
            m = manifest.model_copy(update={"name": name, "step": step, "session": sid, "created_at": when,
                                            "derived_from": derived})
            raw = m.model_dump_json().encode()
            digest = xxh3_hex(raw)
            storage.put(Paths.manifest(run, name, sid, digest), raw)
            marker = c.marker.model_copy(update={"ref": f"{run}/{name}", "session": sid, "step": step,
                                                 "derived_from": derived, "committed_at": when,
                                                 "manifest": manifest_file_name(digest), "manifest_xxh3": digest,
                                                 "load_tree": LoadTree(m).root})
            assert storage.create_if_absent(Paths.marker(run, name), marker.model_dump_json().encode())
            made += 1
    return made


def decorate(url: str, run: str, seed: str, newest: list[str]) -> dict[str, Any]:
    """Verifications, a lease, a gc dry run, a reshard job and a half-done upload, through the service."""
    h = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=h, timeout=600) as c:
        for name in newest:
            assert c.post(f"/v1/checkpoints/{run}/{name}/verify").json()["ok"], name
        assert c.put(f"/v1/checkpoints/{run}/{newest[-1]}/leases/dashboard").status_code == 200
        gc = c.post(f"/v1/runs/{run}/gc", json={"keep_last": 1000, "keep_every": 500, "dry_run": True})
        assert gc.status_code == 200, gc.text
        job = c.post("/v1/reshard", json={"source": f"{run}/{seed}", "to": "fsdp2:dp=3", "out": f"{run}/seed-dp3",
                                          "jobs": 2})
        assert job.status_code == 202, job.text
        base = f"/v1/checkpoints/{run}/open/sessions/s-live"
        assert c.post(f"/v1/checkpoints/{run}/open/sessions", json={"session": "s-live", "world_size": 4}).status_code == 200
        import xxhash

        for rank in (0, 2):
            data = bytes(range(256)) * (64 * (rank + 1))
            r = c.put(f"{base}/files/r{rank:06d}-0000.bin", content=data,
                      headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 300
        while c.get(f"/v1/jobs/{job.json()['id']}").json()["state"] in ("queued", "running"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        return {"gc_deleted_if_run": len(gc.json()["delete"]), "job": job.json()["id"]}


# -- the browser ------------------------------------------------------------------------------------

def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise SystemExit("bench.ui needs Debian's chromium on PATH (apt-get install chromium)")
    return path


def time_run_page(browser: Any, url: str, run: str, rows: int) -> dict[str, Any]:
    """Open the run page in a fresh context; ms from navigation start until its table is rendered."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.add_init_script(f"sessionStorage.setItem('ckptd.token', {TOKEN!r})")
    page = ctx.new_page()
    try:
        page.goto(f"{url}/ui#/run/{run}", wait_until="commit")
        page.wait_for_selector("main[data-state=ready][data-page=run]", timeout=60_000)
        observed = page.evaluate("performance.now()")
        deadline = time.monotonic() + 10  # polled from here: the page's CSP forbids Playwright's in-page polling
        while not page.evaluate("performance.getEntriesByName('ckptd-page-painted').length") \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        marks = page.evaluate("""() => {
            const nav = performance.getEntriesByType("navigation")[0];
            const mark = (n) => (performance.getEntriesByName(n).slice(-1)[0] || {}).startTime;
            return {shell_response_end: nav.responseEnd, dom_content_loaded: nav.domContentLoadedEventEnd,
                    page_start: mark("ckptd-page-start"), page_ready: mark("ckptd-page-ready"),
                    page_painted: mark("ckptd-page-painted")};
        }""")
        shown = page.locator("#checkpoints tbody tr").count()
        assert shown == rows, (shown, rows)
        calls = page.evaluate("window.__ckptdTimings")
        return {"rendered_ms": marks["page_painted"], "observed_ms": observed, "rows": shown, "marks_ms": {k: round(v, 1) for k, v in marks.items() if v},
                "calls": [{"url": c["url"], "ms": round(c["ms"], 1), "status": c["status"]} for c in calls]}
    finally:
        ctx.close()


def time_json(url: str, run: str, repeat: int) -> dict[str, float]:
    """The run page's JSON calls from Python, warm: median ms of ``repeat``."""
    h = {"Authorization": f"Bearer {TOKEN}"}
    out = {}
    with httpx.Client(base_url=url, headers=h, timeout=60) as c:
        for path, params in ((f"/v1/ui/runs/{run}/checkpoints", {"limit": 100}),
                             (f"/v1/ui/runs/{run}/steps", {"limit": 5000}), ("/v1/ui/runs", {"limit": 100})):
            times = []
            for _ in range(max(repeat, 1)):
                t0 = time.perf_counter()
                r = c.get(path, params=params)
                times.append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, r.text
            out[path] = round(statistics.median(times), 1)
    return out


def screenshots(browser: Any, url: str, run: str, seed: str, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    ctx = browser.new_context(viewport={"width": 1280, "height": 860}, device_scale_factor=1)
    ctx.add_init_script(f"sessionStorage.setItem('ckptd.token', {TOKEN!r})")
    page = ctx.new_page()
    saved = []
    for file, hash_ in (("ui-runs.png", "/"), ("ui-run.png", f"/run/{run}"), ("ui-checkpoint.png", f"/ckpt/{run}/{seed}"),
                        ("ui-live.png", f"/live/{run}")):
        page.goto(f"{url}/ui#{hash_}")
        page.wait_for_selector("main[data-state=ready]", timeout=60_000)
        if file == "ui-checkpoint.png":
            page.evaluate("document.getElementById('tensors').scrollIntoView()")
        if file == "ui-live.png":
            page.locator("#jobs button").first.click()
            page.wait_for_selector("#plan .plan")
        page.screenshot(path=str(out / file))
        saved.append(str(out / file))
    ctx.close()
    return saved


# -- the report -------------------------------------------------------------------------------------

def markdown(res: dict) -> str:
    s = res["summary"]
    lines = ["| measure | ms |", "| --- | --- |",
             f"| run page rendered, cold service (first load) | {s['cold_ms']:.0f} |",
             f"| run page rendered, warm (median of {len(res['loads']) - 1}) | "
             f"{s['warm_ms']:.0f} |" if s["warm_ms"] is not None else "| run page rendered, warm | – |"]
    for path, ms in res["json_ms"].items():
        lines.append(f"| GET {path} (httpx, warm) | {ms:.0f} |")
    lines.append(f"\n{res['config']['checkpoints']} checkpoints of run {RUN!r}; goal: under {GOAL_MS:.0f} ms "
                 f"({'met' if s['goal_met'] else 'NOT met'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=2000, help="trainer checkpoints of the run (plus derived)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks of the seed checkpoint")
    ap.add_argument("--repeat", type=int, default=5, help="loads of the run page (the first is cold)")
    ap.add_argument("--screenshots", type=Path, default=None, help="also save PNGs of the four pages here")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ui.json")
    add_workdir_args(ap)
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    exe = chromium()
    with work_dir("ckptd-bench-ui-", args.workdir, args.keep) as work:
        root = work / "ckptd-root"
        t_start = time.perf_counter()
        server = ServerProcess(root, env={"CKPTD_TOKENS": f"bench {TOKEN} admin"}, log=work / "server.log")
        try:
            server.start()
            t0 = time.perf_counter()
            seed = "10"
            run_ranks(save_seed, args.ranks, server.url, f"{RUN}/{seed}", tmp=work)
            seed_s = time.perf_counter() - t0
            steps = [10 * i for i in range(2, args.checkpoints + 1)]
            t0 = time.perf_counter()
            made = replicate(root, RUN, seed, steps)
            replicate_s = time.perf_counter() - t0
            newest = [str(s) for s in steps[-3:]] if steps else [seed]
            extra = decorate(server.url, RUN, seed, newest)
            visible = httpx.get(f"{server.url}/v1/ui/runs", headers={"Authorization": f"Bearer {TOKEN}"},
                                timeout=60).json()["items"][0]["checkpoints"]
            print(f"work dir {work}; seed of {args.ranks} ranks in {seed_s:.1f} s; {made} copies in "
                  f"{replicate_s:.1f} s; {visible} visible checkpoints", flush=True)
            rows = min(visible, 100)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=exe, args=ARGS)
                try:
                    loads = [time_run_page(browser, server.url, RUN, rows) for _ in range(args.repeat)]
                    shots = screenshots(browser, server.url, RUN, seed, args.screenshots) if args.screenshots else []
                finally:
                    browser.close()
            for i, ld in enumerate(loads):
                print(f"load {i}: table rendered at {ld['rendered_ms']:.0f} ms; {ld['marks_ms']}; calls "
                      + ", ".join(f"{c['url'].split('?')[0]} {c['ms']:.0f} ms" for c in ld["calls"]), flush=True)
            json_ms = time_json(server.url, RUN, args.repeat)
            cold = loads[0]["rendered_ms"]
            warm = statistics.median(ld["rendered_ms"] for ld in loads[1:]) if len(loads) > 1 else None
            result = {
                "command": "python -m bench.ui " + " ".join(sys.argv[1:] if argv is None else argv),
                "config": {"checkpoints": args.checkpoints, "visible": visible, "ranks": args.ranks,
                           "repeat": args.repeat, "rows_per_page": rows, "workdir": str(work), "chromium": exe},
                "git": git_state(),
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
                "seed_s": seed_s, "replicate_s": replicate_s, "decorate": extra,
                "summary": {"cold_ms": cold, "warm_ms": warm, "goal_ms": GOAL_MS,
                            "goal_met": max(cold, warm or 0) < GOAL_MS},
                "loads": loads, "json_ms": json_ms, "screenshots": shots,
                "wall_s": time.perf_counter() - t_start,
            }
            write_report(args.out, result, markdown(result))
            return 0
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
