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
/** An SVG element. */
export const s = (tag, attrs, ...children) => build(document.createElementNS(SVG, tag), attrs, children);

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0, v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return i === 0 ? `${v} B` : `${v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0)} ${units[i]}`;
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

/** The colour of a rank: well spread hues (golden angle), the same on every page. */
export const rankColour = (r) => `hsl(${(r * 137.508) % 360}, 62%, 52%)`;

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
