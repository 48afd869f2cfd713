// The view's router: #/ (runs), #/run/RUN, #/ckpt/RUN/NAME, #/live/RUN. Each page reads its data
// from the /v1/ui JSON routes (api.js) and marks <main data-state="ready"> once rendered.
import {token} from "./api.js";
import {enc, fill, h, link} from "./dom.js";
import {checkpointPage} from "./checkpoint.js";
import {livePage} from "./live.js";
import {runPage} from "./run.js";
import {runsPage} from "./runs.js";

const view = document.getElementById("app");
const form = document.getElementById("login");
const crumbs = document.getElementById("crumbs");
let cleanup = null;
let generation = 0;

function route() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const parts = (path || "/").split("/").filter(Boolean).map(decodeURIComponent);
  return {parts, params: new URLSearchParams(query || "")};
}

function askToken(message) {
  form.hidden = false;
  view.replaceChildren();
  view.dataset.state = "login";
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("token").focus();
}

async function show() {
  const mine = ++generation;
  if (cleanup) { cleanup(); cleanup = null; }
  const {parts, params} = route();
  const [page, run, name] = parts;
  fill(crumbs, link("#/", "runs"), run ? [" / ", link(`#/run/${enc(run)}`, run)] : [],
       name ? [" / ", h("span", {}, name)] : [], page === "live" ? [" / live"] : []);
  view.dataset.state = "loading";
  performance.mark("ckptd-page-start");
  try {
    let done;
    if (page === "run" && run) done = await runPage(view, params, run);
    else if (page === "ckpt" && run && name) done = await checkpointPage(view, params, run, name);
    else if (page === "live" && run) done = await livePage(view, params, run);
    else done = await runsPage(view, params);
    if (mine !== generation) { if (typeof done === "function") done(); return; }
    cleanup = typeof done === "function" ? done : null;
    performance.mark("ckptd-page-ready");
    requestAnimationFrame(() => requestAnimationFrame(() => performance.mark("ckptd-page-painted")));
    view.dataset.state = "ready";
    view.dataset.page = page || "runs";
  } catch (e) {
    if (mine !== generation) return;
    if (e.status === 401) return askToken(token.get() ? "The service did not accept this token." : "");
    // a run that is not under the root: the routes answer 404 not_found naming it (details.run)
    const noRun = e.status === 404 && e.code === "not_found" && e.details && e.details.run === run;
    fill(view, h("h1", {id: noRun ? "no-such-run" : null}, noRun ? `no such run: ${run}` : "Cannot show this page"),
      h("p", {class: "error", id: "error", "data-status": e.status || "", "data-code": e.code || ""},
        e.status ? `${e.status}: ${e.message}` : String(e)),
      noRun ? h("p", {}, link("#/", "the runs this token may read")) : null);
    view.dataset.state = "error";
  }
}

form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  token.set(document.getElementById("token").value.trim());
  document.getElementById("token").value = "";
  form.hidden = true;
  document.getElementById("logout").hidden = false;
  show();
});
document.getElementById("logout").addEventListener("click", () => {
  token.clear();
  document.getElementById("logout").hidden = true;
  askToken("");
});
document.getElementById("logout").hidden = !token.get();
window.addEventListener("hashchange", show);
show();
