// Page 2: a run's checkpoints, one page at a time, on the run's step timeline, with lineage.
import {get} from "./api.js";
import {ago, bytes, enc, fill, h, link, pager, table, verdict, when} from "./dom.js";
import {lineage, timeline} from "./timeline.js";

const LIMIT = 100;

async function allSteps(run) {
  const cols = {name: [], step: [], derived_from: []};
  for (let offset = 0, total = 1; offset < total && offset < 50000; offset += 5000) {
    const ans = await get(`runs/${enc(run)}/steps`, {offset, limit: 5000});
    total = ans.total;
    for (const k of Object.keys(cols)) cols[k].push(...ans.columns[k]);
  }
  return cols.name.map((name, i) => ({name, step: cols.step[i], derived_from: cols.derived_from[i]}));
}

function layout(st) {
  const mesh = Object.entries(st.mesh).map(([k, v]) => `${k}=${v}`).join(",");
  const groups = Object.entries(st.layouts).map(([g, l]) => `${g}: ${l}`).join("; ");
  return [h("div", {}, `${st.world_size} rank${st.world_size === 1 ? "" : "s"}${mesh ? ` (${mesh})` : ""}`),
          groups ? h("div", {class: "muted"}, groups) : null];
}

/** The verification cell: verdict() (the same words on every page) and how long ago. */
export function verification(v) {
  const d = verdict(v);
  return h("span", {class: `verdict ${d.cls}`, title: d.title, dataset: {verdict: v ? (v.ok ? "ok" : "failed") : "none"}},
           d.text, v ? [" ", h("span", {class: "muted"}, ago(v.verified_at))] : null);
}

export function checkpointRow(run, r) {
  const st = r.stats;
  const sizes = st ? [
    h("td", {class: "num", title: `${bytes(st.file_bytes)} in files, ${bytes(st.linked_bytes)} of them linked`},
      bytes(st.written_bytes)),
    // unchanged: the reused chunks' bytes (Manifest.unchanged_bytes, as `ckptd show`), not the linked files' sizes
    h("td", {class: "num", title: `in ${st.linked_files} linked file${st.linked_files === 1 ? "" : "s"} of ${bytes(st.linked_bytes)}`},
      bytes(st.unchanged_bytes)),
    h("td", {class: "num", title: `${st.chunks} chunks, ${st.compressed_chunks} compressed`},
      `${bytes(st.logical_bytes)} → ${bytes(st.stored_bytes)}`),
    h("td", {class: "num"}, st.files), h("td", {}, layout(st))]
    : [h("td", {colspan: 5, class: "muted"}, "no longer visible")];
  const lineageCell = [r.derived_from ? h("div", {}, "from ", r.derived_from) : null,
                       r.parent ? h("div", {}, "parent ", r.parent) : null];
  return h("tr", {dataset: {name: r.name, step: r.step ?? ""}},
    h("td", {class: "num"}, r.step ?? "–"),
    h("td", {}, link(`#/ckpt/${enc(run)}/${enc(r.name)}`, r.name)),
    ...sizes,
    h("td", {}, verification(r.verification)),
    h("td", {}, r.leases.length ? r.leases.join(", ") : h("span", {class: "muted"}, "–")),
    h("td", {}, lineageCell),
    h("td", {title: when(r.committed_at)}, ago(r.committed_at)));
}

export async function runPage(view, params, run) {
  const offset = Number(params.get("offset") || 0);
  const [ans, steps] = await Promise.all([get(`runs/${enc(run)}/checkpoints`, {offset, limit: LIMIT}), allSteps(run)]);
  const rows = ans.items.map((r) => checkpointRow(run, r));
  fill(view,
    h("h1", {}, `Run ${run}`),
    h("p", {class: "tabs"}, link(`#/live/${enc(run)}`, "live: uploads, reshard jobs, gc"),
      ans.latest ? link(`#/ckpt/${enc(run)}/${enc(ans.latest)}`, `latest: ${ans.latest}`) : null),
    steps.some((c) => c.step !== null) ? timeline(steps, ans.items) : h("p", {class: "muted"}, "No step to draw."),
    h("h2", {}, "Checkpoints"),
    pager(ans, (o) => { location.hash = `#/run/${enc(run)}?offset=${o}`; }, "checkpoints"),
    table(["step#", "name", "written#", "unchanged#", "logical → stored#", "files#", "world / layout", "verification",
           "leases", "lineage", "committed"], rows, {id: "checkpoints"}),
    h("h2", {}, "Lineage (this page)"),
    lineage(run, ans.items));
}
