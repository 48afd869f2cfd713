// Page 4: what is happening in a run now: open upload sessions (per-rank progress), reshard jobs
// (progress, plan) and the last gc decisions (with reasons). Polled every few seconds, no reload.
import {get} from "./api.js";
import {ago, bar, bytes, enc, fill, h, link, rankColour, table, when} from "./dom.js";

const POLL_MS = 3000;

const plural = (n, what) => `${n} ${what}${n === 1 ? "" : "s"}`;

/** A duration in seconds, as the TTL setting is given: "6 h", "90 min", "45 s". */
function duration(sec) {
  if (sec >= 7200 && sec % 3600 === 0) return `${sec / 3600} h`;
  if (sec >= 120 && sec % 60 === 0) return `${sec / 60} min`;
  return sec >= 7200 ? `${(sec / 3600).toFixed(1)} h` : `${Math.round(sec)} s`;
}

/** What the session holds on storage: its stored data files and, on a local root, the writes not
 * finished (a rank killed mid-file leaves one); and whether this replica is receiving files of it now,
 * else when a writer was last heard from (a rank's write or keep-alive; the opening when none since). */
function holdings(u) {
  const partial = u.partial_bytes ? `, and ${bytes(u.partial_bytes)} in ${plural(u.partial_files, "unfinished write")}` : "";
  const rx = u.receiving || {files: 0, bytes: 0};
  const last = rx.files
    ? h("span", {class: "last-activity receiving", title: u.last_activity ? when(u.last_activity) : ""},
      `receiving ${plural(rx.files, "file")} now (${bytes(rx.bytes)} so far)`)
    : u.last_activity
    ? h("span", {class: "last-activity", title: when(u.last_activity)}, `last writer activity ${ago(u.last_activity)}`)
    : h("span", {class: "last-activity muted"}, "last activity unknown (no session record)");
  return h("div", {class: "holds", dataset: {bytes: u.bytes + (u.partial_bytes || 0)}},
    `holds ${bytes(u.bytes + (u.partial_bytes || 0))}: ${plural(u.files, "file")} of ${bytes(u.bytes)} stored${partial} · `, last);
}

function uploadCard(u) {
  const ranks = u.ranks.map((r) => h("div", {class: `rank${r.index ? " done" : ""}`, dataset: {rank: r.rank}},
    (() => { const sw = h("span", {class: "swatch"}); sw.style.background = rankColour(r.rank); return sw; })(),
    `rank ${r.rank}: ${plural(r.files, "file")}, ${bytes(r.bytes)}`,
    r.partial_bytes ? h("span", {class: "warn"}, ` + ${bytes(r.partial_bytes)} unfinished`) : null,
    r.index ? h("span", {class: "ok"}, " · index ✓") : h("span", {class: "muted"}, " · index pending")));
  return h("div", {class: `card upload${u.stale ? " stale" : ""}`, dataset: {name: u.name, session: u.session}},
    h("div", {}, h("strong", {}, u.name), ` session ${u.session} · `,
      h("span", {class: u.state === "failed" ? "bad" : "warn", "data-state": u.state}, u.state),
      u.stale ? [" · ", h("span", {class: "bad", "data-stale": ""}, "stale")] : null,
      u.step !== null ? ` · step ${u.step}` : "",
      u.created_at ? h("span", {title: when(u.created_at)}, ` · opened ${ago(u.created_at)}`) : ""),
    holdings(u),
    u.stale ? h("p", {class: "bad stale-note", dataset: {reason: u.reclaim_reason}},
      (u.reclaim_reason === "idle"
        ? `stale: no rank was heard from for ${duration(u.dead_after_seconds)} (CKPTD_DEAD_SESSION_AFTER): its writers stopped; `
        : `stale: opened more than the session TTL (${duration(u.ttl_seconds)}, CKPTD_STALE_SESSION_TTL) ago; `) +
      "the service's next sweep deletes it and what it holds, unless every rank's index is in (then it commits)")
      : u.reclaim_at ? h("p", {class: "muted", dataset: {reason: u.reclaim_reason}},
        `the service deletes it after ${when(u.reclaim_at)} unless it commits or a rank is heard from`) : null,
    h("div", {class: "progress"}, `${u.ranks_done} of ${u.world_size} ranks done`,
      bar(u.ranks_done, u.world_size, `${u.ranks_done}/${u.world_size} rank indexes`)),
    h("div", {class: "ranks"}, ranks),
    u.other_files ? h("p", {class: "muted"}, `${plural(u.other_files, "file")} not named by rank, ${bytes(u.other_bytes)}`) : null,
    u.error ? h("p", {class: "error"}, u.error.message) : null);
}

function planView(p) {
  const per = p.per_rank.map((kinds, r) => h("tr", {}, h("td", {class: "num"}, r),
    h("td", {}, Object.entries(kinds).map(([k, n]) => `${k} ${bytes(n)}`).join(", "))));
  return h("div", {class: "card plan", dataset: {job: p.job}},
    h("div", {}, `Plan of ${p.source} → ${p.out} as `, h("code", {}, p.spec), `: ${p.units_total} work units, `,
      `${bytes(p.bytes_to_write)} to write, ${p.world_size} target ranks, `,
      `imbalance ${(p.imbalance * 100).toFixed(1)}%`),
    table(["target rank#", "bytes"], per, {class: "plan-ranks"}),
    table(["unit#", "rank#", "file", "chunks#", "size#"], p.units.map((u) => h("tr", {},
      h("td", {class: "num"}, u.index), h("td", {class: "num"}, u.rank), h("td", {}, u.file),
      h("td", {class: "num"}, u.chunks), h("td", {class: "num"}, bytes(u.size))))),
    p.units_total > p.units.length ? h("p", {class: "muted"}, `first ${p.units.length} of ${p.units_total} units`) : null);
}

function jobRow(run, j, showPlan) {
  const cls = {done: "ok", failed: "bad", running: "warn", queued: "muted"}[j.state];
  return h("tr", {dataset: {job: j.id}},
    h("td", {}, h("code", {}, j.id.slice(0, 12))),
    h("td", {}, h("span", {class: cls, "data-state": j.state}, j.state)),
    h("td", {}, j.source), h("td", {}, j.state === "done" ? link(`#/ckpt/${j.out.split("/").map(enc).join("/")}`, j.out) : j.out),
    h("td", {}, h("code", {}, j.spec)),
    h("td", {}, bar(j.bytes_done, j.bytes_total), `${bytes(j.bytes_done)} of ${bytes(j.bytes_total)}`),
    h("td", {title: when(j.updated_at)}, ago(j.updated_at)),
    h("td", {}, j.error ? h("span", {class: "error"}, j.error.message) : j.result ? `${j.result.units} units, ${j.result.seconds} s` : ""),
    h("td", {}, h("button", {type: "button", onclick: () => showPlan(j.id)}, "plan")));
}

function decisionCard(d) {
  const keep = Object.entries(d.keep).map(([name, why]) => h("tr", {dataset: {name}},
    h("td", {}, name), h("td", {class: "reason"}, why)));
  return h("div", {class: "card decision"},
    h("div", {}, h("strong", {}, when(d.at)), ` · ${d.source}${d.dry_run ? " (dry run)" : ""} · `,
      `newest verified: ${d.newest_verified ?? "–"}${d.verified_how ? ` (${d.verified_how})` : ""}`),
    h("div", {}, d.dry_run ? `would delete: ${d.delete.join(", ") || "nothing"}` : `deleted: ${d.deleted.join(", ") || "nothing"}`),
    Object.keys(d.failed_verification || {}).length
      ? h("div", {class: "bad"}, "did not verify: ", Object.entries(d.failed_verification).map(([n, w]) => `${n}: ${w}`).join("; ")) : null,
    table(["kept", "why"], keep));
}

export async function livePage(view, params, run) {
  const uploads = h("div", {id: "uploads"}), jobs = h("div", {id: "jobs"}), plan = h("div", {id: "plan"});
  const gc = h("div", {id: "retention"}), stamp = h("p", {class: "muted", id: "refreshed"});
  const showPlan = async (id) => {
    fill(plan, h("p", {class: "muted"}, "planning…"));
    try { fill(plan, planView(await get(`runs/${enc(run)}/jobs/${enc(id)}/plan`))); }
    catch (e) { fill(plan, h("p", {class: "error"}, e.message)); }
  };
  async function refresh() {
    const [u, j, d] = await Promise.all([get(`runs/${enc(run)}/uploads`, {limit: 20}),
      get(`runs/${enc(run)}/jobs`, {limit: 20}), get(`runs/${enc(run)}/retention`, {limit: 5})]);
    fill(uploads, u.run_exists === false && !j.items.length ? h("p", {class: "error", id: "no-such-run"}, `no such run: ${run}`) : null,
      ...(u.items.length ? u.items.map(uploadCard) : [h("p", {class: "muted"}, "No upload in progress.")]),
      u.total > u.items.length ? h("p", {class: "muted"}, `${u.items.length} of ${u.total} sessions shown`) : "");
    fill(jobs, j.items.length
      ? table(["job", "state", "source", "output", "to", "progress", "updated", "result", ""], j.items.map((x) => jobRow(run, x, showPlan)))
      : h("p", {class: "muted"}, "No reshard job touches this run."));
    fill(gc, ...(d.items.length ? d.items.map(decisionCard)
      : [h("p", {class: "muted"}, "No gc decision since the service started.")]));
    stamp.textContent = `refreshed ${new Date().toLocaleTimeString()}, every ${POLL_MS / 1000} s`;
  }
  fill(view, h("h1", {}, `Live: ${run}`), h("p", {}, link(`#/run/${enc(run)}`, "checkpoints of this run")), stamp,
    h("h2", {}, "Upload sessions"), uploads, h("h2", {}, "Reshard jobs"), jobs, plan, h("h2", {}, "Last gc decisions"), gc);
  await refresh();
  const timer = setInterval(() => refresh().catch((e) => { stamp.textContent = `refresh failed: ${e.message}`; }), POLL_MS);
  return () => clearInterval(timer);
}
