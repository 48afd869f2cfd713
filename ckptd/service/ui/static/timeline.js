// The run page's pictures: the step timeline (every checkpoint of the run as a tick, the shown
// page's checkpoints as bars of bytes written and reused unchanged) and the lineage graph.
import {bytes, h, s, verdict} from "./dom.js";

const W = 960;

/** steps: {name, step, derived_from}[] of the whole run; rows: the shown page's checkpoint rows. */
export function timeline(steps, rows) {
  const known = steps.filter((c) => c.step !== null);
  const lo = Math.min(...known.map((c) => c.step)), hi = Math.max(...known.map((c) => c.step));
  const x = (step) => 40 + (hi > lo ? (step - lo) / (hi - lo) : 0.5) * (W - 60);
  const H = 160, base = 110;
  const peak = Math.max(1, ...rows.map((r) => (r.stats ? r.stats.file_bytes : 0)));
  const svg = s("svg", {id: "timeline", viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
                        "aria-label": "step timeline"});
  svg.append(s("line", {class: "axis", x1: 40, x2: W - 20, y1: base, y2: base}));
  // one path per kind, not one element per checkpoint: thousands of ticks stay cheap to lay out
  const ticks = (derived) => known.filter((c) => !!c.derived_from === derived)
    .map((c) => `M${x(c.step).toFixed(1)} ${derived ? base + 12 : base + 4}v8`).join("");
  svg.append(s("path", {class: "ticks", d: ticks(false) || "M0 0", stroke: "#66707c", "stroke-width": 1}),
             s("path", {class: "ticks derived", d: ticks(true) || "M0 0", stroke: "#b26a00", "stroke-width": 1}));
  for (const r of rows) {
    if (r.step === null || !r.stats) continue;
    const written = r.stats.written_bytes, unchanged = r.stats.unchanged_bytes;
    const bw = Math.max(1, Math.min(4, (W - 60) / known.length)), cx = x(r.step) - bw / 2;
    const hw = (written / peak) * 90, hl = (unchanged / peak) * 90;
    const v = r.verification;
    const colour = v ? (v.ok ? "#1f8a4c" : "#c62828") : "#2a5db0";  // ui.css --ok, --bad, --accent
    const g = s("g", {class: "ckpt", dataset: {step: r.step, name: r.name}},
      s("title", {}, `${r.name} (step ${r.step}): ${bytes(written)} written, ${bytes(unchanged)} unchanged` +
                     `, verification: ${verdict(v).text}`),
      s("rect", {x: cx, y: base - hw, width: bw, height: Math.max(hw, 1), fill: colour}),
      s("rect", {x: cx, y: base - hw - hl, width: bw, height: hl, fill: "#9fb3d1"}));
    svg.append(g);
  }
  svg.append(s("text", {x: 40, y: base + 34}, `step ${lo}`),
             s("text", {x: W - 20, y: base + 34, "text-anchor": "end"}, `step ${hi}`),
             s("text", {x: 40, y: 12}, `${steps.length} checkpoints (ticks: trainer above, derived below); bars: this page's bytes written (dark: green ✓ ok, red ✗ failed, blue no verification record) and unchanged (light), peak ${bytes(peak)}`));
  return svg;
}

/** Lineage among the page's checkpoints: derived_from (same run) and parent (another run). */
export function lineage(run, rows) {
  const byName = new Map(rows.map((r) => [r.name, r]));
  const edges = [];
  for (const r of rows) {
    if (r.derived_from) edges.push({from: r.derived_from, to: `${run}/${r.name}`, kind: "derived"});
    if (r.parent) edges.push({from: r.parent, to: `${run}/${r.name}`, kind: "parent"});
  }
  if (!edges.length) return h("p", {class: "muted", id: "lineage-none"}, "No lineage on this page (no checkpoint here is derived from another, or has a parent).");
  const refs = new Set(edges.flatMap((e) => [e.from, e.to]));
  const local = (ref) => ref.startsWith(`${run}/`) && byName.has(ref.slice(run.length + 1));
  const layer = (ref) => (!ref.startsWith(`${run}/`) ? 0 : local(ref) && byName.get(ref.slice(run.length + 1)).derived_from ? 2 : 1);
  const layers = [[], [], []];
  for (const ref of refs) layers[layer(ref)].push(ref);
  const stepOf = (ref) => (local(ref) ? byName.get(ref.slice(run.length + 1)).step ?? 0 : 0);
  layers.forEach((l) => l.sort((a, b) => stepOf(a) - stepOf(b) || a.localeCompare(b)));
  const cols = Math.max(...layers.map((l) => l.length));
  const w = Math.max(W, cols * 150), H = 3 * 70 + 10, pos = new Map();
  layers.forEach((l, li) => l.forEach((ref, i) => pos.set(ref, [75 + i * ((w - 150) / Math.max(l.length - 1, 1)), 30 + li * 70])));
  const svg = s("svg", {id: "lineage", viewBox: `0 0 ${w} ${H}`, width: "100%", role: "img", "aria-label": "lineage"});
  for (const e of edges) {
    const [x1, y1] = pos.get(e.from), [x2, y2] = pos.get(e.to);
    svg.append(s("line", {x1, y1: y1 + 10, x2, y2: y2 - 10, stroke: e.kind === "parent" ? "#b26a00" : "#2a5db0",
                          "stroke-width": 1.5, "stroke-dasharray": e.kind === "parent" ? "4 3" : null},
                 s("title", {}, `${e.from} → ${e.to} (${e.kind})`)));
  }
  for (const [ref, [x, y]] of pos) {
    const label = ref.startsWith(`${run}/`) ? ref.slice(run.length + 1) : ref;
    svg.append(s("g", {class: "node", dataset: {ref}},
      s("rect", {x: x - 65, y: y - 10, width: 130, height: 20, rx: 4, fill: local(ref) ? "#eef3fb" : "#fff4e5",
                 stroke: "#8a96a3"}),
      s("text", {x, y: y + 4, "text-anchor": "middle"}, label.length > 22 ? label.slice(0, 21) + "…" : label)));
  }
  return svg;
}
