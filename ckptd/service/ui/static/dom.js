// DOM helpers: elements are built with createElement and textContent only (never innerHTML), so
// a name read from a checkpoint can never become markup.
const SVG = "http://www.w3.org/2000/svg";

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "text") el.textContent = String(v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** An HTML element: h("td", {class: "num"}, "12"). */
export const h = (tag, attrs, ...children) => build(document.createElement(tag), attrs, children);
/** el.replaceChildren(...children) without printing a null or false as text (replaceChildren()
 * turns null into the text "null"): skipped as h() skips them; arrays are flattened. */
export function fill(el, ...children) {
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

/** An SVG element. */
export const s = (tag, attrs, ...children) => build(document.createElementNS(SVG, tag), attrs, children);

/** A size as the CLI prints it (ckptd/cli/output.py, human()): decimal units (1 kB = 1000 B, then
 * MB, GB, TB), whole bytes under 1 kB, else one decimal rounded as Python's format rounds (the
 * exact value, halves to even). The view's one byte formatter: a page and `ckptd show` agree. */
export function bytes(n) {
  if (n === null || n === undefined) return "–";
  let v = Number(n);
  for (const unit of ["B", "kB", "MB", "GB", "TB"]) {
    if (Math.abs(v) < 1000 || unit === "TB") return unit === "B" ? `${Math.trunc(v)} B` : `${oneDecimal(v)} ${unit}`;
    v /= 1000;
  }
  return String(v);
}

/** Python's f"{x:.1f}": toFixed(1) rounds the exact value too, but a tie (x = odd / 4, exact in
 * binary) goes up there and to the even digit in Python. */
function oneDecimal(x) {
  const q = x * 4;  // exact: a power of two
  if (Number.isInteger(q) && Math.abs(q) % 2 === 1) {
    let m = Math.floor(x * 10);
    if (Math.abs(m) % 2 === 1) m += 1;
    return (m / 10).toFixed(1);
  }
  return x.toFixed(1);
}

export function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return isNaN(d) ? String(iso) : d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

export function ago(iso) {
  const sec = (Date.now() - new Date(iso).getTime()) / 1000;
  if (!isFinite(sec)) return "";
  if (sec < 5) return "just now";  // and a clock a little ahead of this one
  if (sec < 90) return `${Math.round(sec)} s ago`;
  if (sec < 5400) return `${Math.round(sec / 60)} min ago`;
  if (sec < 129600) return `${Math.round(sec / 3600)} h ago`;
  return `${Math.round(sec / 86400)} d ago`;
}

/** The colour of a rank, the same on every page (per-chunk bars, bytes per rank, upload cards).
 * The rank palette never uses the status colours' hues (ui.css: --ok green #1f8a4c at 145°, --bad
 * red #c62828 at 0°, --warn amber #b26a00 at 36°): its hues are only 180°–320° (cyan, blue, violet,
 * magenta) and 48°–66° (gold, yellow), 158° of hue, which successive ranks step through by the
 * golden ratio (neighbours far apart), at three lightnesses. */
export const RANK_HUES = [[180, 320], [48, 66]];
export function rankColour(r) {
  const span = RANK_HUES.reduce((a, [lo, hi]) => a + hi - lo, 0);
  let at = ((r * 0.6180339887498949) % 1) * span;
  let hue = RANK_HUES[0][0];
  for (const [lo, hi] of RANK_HUES) {
    if (at < hi - lo) { hue = lo + at; break; }
    at -= hi - lo;
  }
  return `hsl(${hue.toFixed(2)}, 62%, ${[50, 40, 60][r % 3]}%)`;
}

/** What a checkpoint's verification record says, the same words on every page (run table,
 * checkpoint page, timeline tooltip): "✓ ok", "✗ failed", or "no record". No record is not "not
 * verified": `ckptd verify --root` checks every byte and records nothing the service can see. */
export function verdict(v) {
  if (!v) {
    return {text: "no record", cls: "muted",
            title: "no verification record (VERIFIED.json) for this manifest; `ckptd verify --root` records " +
                   "nothing, `ckptd verify --in-service` and POST …/verify do"};
  }
  return {text: v.ok ? "✓ ok" : "✗ failed", cls: v.ok ? "ok" : "bad",
          title: v.problems.length ? v.problems.join("\n") : `verified ${when(v.verified_at)}`};
}

export const link = (hash, text) => h("a", {href: hash}, text);
export const enc = encodeURIComponent;
export const shape = (sh) => `[${sh.join(", ")}]`;

/** A progress bar: done / total. */
export function bar(done, total, title) {
  const frac = total > 0 ? Math.min(done / total, 1) : 0;
  const fill = h("span");
  fill.style.width = `${(frac * 100).toFixed(1)}%`;
  return h("div", {class: "bar", title: title || `${(frac * 100).toFixed(0)}%`, role: "progressbar",
                   "aria-valuenow": Math.round(frac * 100), "aria-valuemin": 0, "aria-valuemax": 100}, fill);
}

/** A "previous / next" pager over an answer {total, offset, limit}; go(offset) loads another page. */
export function pager(ans, go, what) {
  const last = Math.min(ans.offset + ans.limit, ans.total);
  return h("div", {class: "pager"},
    h("button", {type: "button", disabled: ans.offset <= 0, onclick: () => go(Math.max(ans.offset - ans.limit, 0))},
      "‹ newer"),
    h("span", {class: "pager-range"}, ans.total ? `${ans.offset + 1}–${last} of ${ans.total} ${what}` : `no ${what}`),
    h("button", {type: "button", disabled: last >= ans.total, onclick: () => go(ans.offset + ans.limit)}, "older ›"));
}

export function table(headers, rows, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {class: x.endsWith("#") ? "num" : null},
      x.replace(/#$/, ""))))),
    h("tbody", {}, rows));
}
