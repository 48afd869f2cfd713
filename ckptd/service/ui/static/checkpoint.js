// Page 3: one checkpoint: its figures, the manifest as a tree of tensors with each rank's part of
// each tensor, objects, param groups and files.
import {get} from "./api.js";
import {bytes, enc, fill, h, link, pager, rankColour, s, shape, table, when} from "./dom.js";
import {checkpointRow, verification} from "./run.js";

const TENSORS = 50;

/** One SVG bar per tensor: a coloured rectangle per chunk, where its rank's part of the tensor lies. */
export function rankBar(t) {
  const W = 300, H = 18;
  const svg = s("svg", {class: "rankbar", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
                        "aria-label": `ranks of ${t.name}`});
  svg.append(s("rect", {x: 0, y: 0, width: W, height: H, fill: "#f4f6f8", stroke: "#d9dee4"}));
  for (const [rank, x0, x1, y0, y1] of t.segments) {
    svg.append(s("rect", {class: "seg", dataset: {rank}, x: x0 * W, y: y0 * H, width: Math.max((x1 - x0) * W, 0.6),
                          height: Math.max((y1 - y0) * H, 0.6), fill: rankColour(rank), stroke: "#fff",
                          "stroke-width": 0.5},
                 s("title", {}, `rank ${rank}: ${(x0 * 100).toFixed(1)}–${(x1 * 100).toFixed(1)}% of dim 0` +
                   (t.shape.length > 1 ? `, ${(y0 * 100).toFixed(1)}–${(y1 * 100).toFixed(1)}% of dim 1` : ""))));
  }
  return svg;
}

function chunkTable(t) {
  const rows = t.chunks.map((c) => h("tr", {},
    h("td", {class: "num"}, c.rank),
    h("td", {}, c.kind === "flat" ? `flat ${c.start}+${c.numel}` : `at ${shape(c.offsets)} size ${shape(c.sizes)}`),
    h("td", {}, c.file), h("td", {class: "num"}, c.offset), h("td", {class: "num"}, bytes(c.length)),
    h("td", {}, c.codec), h("td", {}, h("code", {}, c.xxh3))));
  return h("details", {class: "chunks"},
    h("summary", {}, `${t.chunk_count} chunk${t.chunk_count === 1 ? "" : "s"}` +
                     (t.chunk_count > t.chunks.length ? ` (first ${t.chunks.length} listed)` : "")),
    table(["rank#", "region", "file", "offset#", "stored#", "codec", "xxh3"], rows));
}

function tensorLeaf(t, label) {
  return h("div", {class: "tensor", dataset: {tensor: t.name}},
    h("div", {}, h("code", {title: t.name}, label), chunkTable(t)),
    h("span", {class: "shape"}, shape(t.shape)),
    h("span", {class: "dtype"}, t.dtype),
    h("span", {class: "num", title: `ranks ${t.ranks.join(", ")}`}, `${t.ranks.length} rank${t.ranks.length === 1 ? "" : "s"}`),
    h("span", {class: "muted", title: "layout-independent digest"}, t.digest ? t.digest : `${bytes(t.logical_bytes)}`),
    rankBar(t));
}

/** The page's tensors as a tree on the dots of their names. */
function tensorTree(items) {
  const root = {kids: new Map(), leaves: []};
  for (const t of items) {
    const parts = t.name.split(".");
    let node = root;
    for (const p of parts.slice(0, -1)) {
      if (!node.kids.has(p)) node.kids.set(p, {kids: new Map(), leaves: []});
      node = node.kids.get(p);
    }
    node.leaves.push([parts[parts.length - 1], t]);
  }
  const render = (node) => [
    ...[...node.kids].map(([name, kid]) => h("details", {open: true},
      h("summary", {}, h("code", {}, name)), render(kid))),
    ...node.leaves.map(([label, t]) => tensorLeaf(t, label))];
  return h("div", {class: "tree", id: "tensors"}, render(root));
}

function rankChart(rankBytes) {
  const W = 960, H = 70, n = rankBytes.length, peak = Math.max(1, ...rankBytes), bw = (W - 40) / Math.max(n, 1);
  const svg = s("svg", {id: "rank-bytes", viewBox: `0 0 ${W} ${H + 16}`, width: "100%", role: "img",
                        "aria-label": "stored bytes per rank"});
  rankBytes.forEach((b, r) => {
    const hh = (b / peak) * H;
    svg.append(s("rect", {x: 20 + r * bw, y: H - hh, width: Math.max(bw - 1, 0.5), height: hh, fill: rankColour(r),
                          dataset: {rank: r}}, s("title", {}, `rank ${r}: ${bytes(b)} stored`)));
  });
  svg.append(s("text", {x: 20, y: H + 14}, `stored bytes per writing rank (rank 0 … ${n - 1}), peak ${bytes(peak)}`));
  return svg;
}

async function tensorsSection(run, name, box, offset, q) {
  const ans = await get(`checkpoints/${enc(run)}/${enc(name)}/tensors`, {offset, limit: TENSORS, q});
  const ranks = [...new Set(ans.items.flatMap((t) => t.ranks))].sort((a, b) => a - b);
  const legend = h("p", {class: "legend"}, ranks.slice(0, 64).map((r) => h("span", {},
    (() => { const sw = h("span", {class: "swatch"}); sw.style.background = rankColour(r); return sw; })(), `rank ${r}`)));
  fill(box,
    pager(ans, (o) => tensorsSection(run, name, box, o, q), q ? `tensors matching “${q}”` : "tensors"),
    legend, tensorTree(ans.items));
}

/** The checkpoint's verification record (VERIFIED.json), as the service stored it, or why there is none. */
function verificationSection(v) {
  const kv = (pairs) => h("dl", {class: "kv", id: "verification"}, pairs.flatMap(([k, x]) => [h("dt", {}, k), h("dd", {}, x)]));
  if (!v) {
    return kv([["record", verification(null)],
               ["why none", "No VERIFIED.json names this manifest: every commit records its own check, so this " +
                "checkpoint was committed before records existed, or its record was removed. `ckptd verify --root` " +
                "checks every byte but records nothing the service can see; `ckptd verify --in-service`, " +
                "POST /v1/checkpoints/RUN/NAME/verify and gc's own checks record."]]);
  }
  const more = v.problem_count > v.problems.length ? ` (first ${v.problems.length} of ${v.problem_count})` : "";
  return kv([["record", verification(v)], ["verified at", when(v.verified_at)],
             ["checked", `${v.files} file${v.files === 1 ? "" : "s"}, ${v.tensors} tensor${v.tensors === 1 ? "" : "s"}, ` +
                         `${v.chunks} chunk${v.chunks === 1 ? "" : "s"}: ${bytes(v.bytes_read)} read in ${v.seconds} s`],
             ["problems", v.problems.length ? h("ul", {class: "problems"}, v.problems.map((p) => h("li", {}, p)), more) : "none"]]);
}

async function objectsSection(run, name, box, offset) {
  const ans = await get(`checkpoints/${enc(run)}/${enc(name)}/objects`, {offset, limit: 100});
  const rows = ans.items.map((o) => h("tr", {},
    h("td", {}, h("code", {}, o.name)), h("td", {class: "num"}, o.rank ?? "all"), h("td", {}, o.encoding),
    h("td", {}, o.value !== null ? h("code", {}, o.value) : o.file ? `${o.file} (${bytes(o.length)})` : "–")));
  fill(box, table(["object", "rank#", "encoding", "value"], rows, {id: "objects"}),
       pager(ans, (o) => objectsSection(run, name, box, o), "objects"));
}

export async function checkpointPage(view, params, run, name) {
  const c = await get(`checkpoints/${enc(run)}/${enc(name)}`);
  const st = c.stats;
  const kv = (pairs) => h("dl", {class: "kv"}, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  const tensorsBox = h("div", {}), objectsBox = h("div", {});
  const filter = h("input", {type: "search", placeholder: "filter tensors by name", id: "tensor-filter"});
  filter.addEventListener("change", () => tensorsSection(run, c.name, tensorsBox, 0, filter.value));
  fill(view,
    h("h1", {}, `Checkpoint ${c.ref}`),
    table(["step#", "name", "written#", "unchanged#", "logical → stored#", "files#", "world / layout", "verification",
           "leases", "lineage", "committed"], [checkpointRow(run, c)], {id: "summary"}),
    h("h2", {}, "Details"),
    kv([["step", c.step ?? "–"], ["committed", when(c.committed_at)], ["session", c.session],
        ["manifest xxh3", h("code", {}, c.manifest_xxh3)],
        ["derived from", c.derived_from ? link(`#/ckpt/${c.derived_from.split("/").map(enc).join("/")}`, c.derived_from) : "–"],
        ["parent", c.parent ? link(`#/ckpt/${c.parent.split("/").map(enc).join("/")}`, c.parent) : "–"],
        ["derived here", c.derived.length ? c.derived.map((d, i) => [i ? ", " : "", link(`#/ckpt/${enc(run)}/${enc(d)}`, d)]) : "–"],
        ["tensors / chunks", st ? `${st.tensors} / ${st.chunks}` : "–"],
        ["objects / param groups", st ? `${st.objects} / ${st.param_groups}` : "–"],
        ["mesh", Object.entries(c.topology.mesh).map(([k, v]) => `${k}=${v}`).join(", ") || "–"]]),
    h("h2", {}, "Verification"), verificationSection(c.verification),
    h("h2", {}, "Per rank"), st ? rankChart(st.rank_bytes) : h("p", {class: "muted"}, "–"),
    h("h2", {}, "Tensors"), filter, tensorsBox,
    h("h2", {}, "Objects"), objectsBox,
    h("h2", {}, "Param groups"),
    table(["optimizer", "index#", "params#", "hyper-parameters"], c.param_groups.map((g) => h("tr", {},
      h("td", {}, g.optimizer), h("td", {class: "num"}, g.index), h("td", {class: "num", title: g.first_params.join(", ")}, g.params),
      h("td", {}, h("code", {}, JSON.stringify(g.hyperparams))))), {id: "param-groups"}),
    h("h2", {}, "Files"),
    table(["file", "size#", "linked from", "xxh3"], c.files.map((f) => h("tr", {},
      h("td", {}, f.file), h("td", {class: "num"}, bytes(f.size)), h("td", {}, f.linked || "–"),
      h("td", {}, h("code", {}, f.xxh3)))), {id: "files"}),
    // a note under the table, never the text "null" (fill(), not replaceChildren(), skips a null child)
    h("p", {class: "muted", id: "files-note"}, st && st.files > c.files.length ? `first ${c.files.length} of ${st.files} files`
      : `${c.files.length} file${c.files.length === 1 ? "" : "s"}, ${bytes(c.files.reduce((a, f) => a + f.size, 0))}` +
        (c.files.some((f) => f.linked) ? `, ${c.files.filter((f) => f.linked).length} linked from earlier checkpoints` : "")));
  await Promise.all([tensorsSection(run, c.name, tensorsBox, 0, ""), objectsSection(run, c.name, objectsBox, 0)]);
}
