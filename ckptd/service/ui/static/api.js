// The one way the view reads data: fetch() of the service's /v1/ui JSON routes, with the bearer
// token this tab holds (sessionStorage: gone when the tab closes, never a cookie).
const KEY = "ckptd.token";
export const timings = [];  // {url, ms, status} per call, read by bench/ui.py
window.__ckptdTimings = timings;

export const token = {
  get: () => sessionStorage.getItem(KEY),
  set: (t) => sessionStorage.setItem(KEY, t),
  clear: () => sessionStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || "http";
    this.details = e.details || {};
  }
}

/** GET a /v1/ui route (path and query), parsed; throws ApiError (the page asks for a token on 401). */
export async function get(path, params) {
  const q = params ? "?" + new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null)) : "";
  const url = `/v1/ui/${path}${q}`;
  const headers = {Accept: "application/json"};
  const t = token.get();
  if (t) headers.Authorization = `Bearer ${t}`;
  const t0 = performance.now();
  const r = await fetch(url, {headers, cache: "no-store", credentials: "omit"});
  let body = null;
  try { body = await r.json(); } catch (_) { /* not JSON */ }
  timings.push({url, ms: performance.now() - t0, status: r.status});
  if (timings.length > 500) timings.splice(0, timings.length - 500);
  if (!r.ok) throw new ApiError(r.status, body);
  return body;
}
