// Page 1: the runs this token may read.
import {get} from "./api.js";
import {ago, enc, fill, h, link, pager, table, when} from "./dom.js";

export async function runsPage(view, params) {
  const offset = Number(params.get("offset") || 0);
  const ans = await get("runs", {offset, limit: 100});
  const rows = ans.items.map((r) => h("tr", {dataset: {run: r.run}},
    h("td", {}, link(`#/run/${enc(r.run)}`, r.run)),
    h("td", {class: "num"}, r.checkpoints),
    h("td", {}, r.latest ? link(`#/ckpt/${enc(r.run)}/${enc(r.latest)}`, r.latest) : "–"),
    h("td", {class: "num"}, r.newest_step ?? "–"),
    h("td", {title: when(r.last_commit)}, r.last_commit ? ago(r.last_commit) : "–"),
    h("td", {}, link(`#/live/${enc(r.run)}`, "live"))));
  fill(view,
    h("h1", {}, "Runs"),
    table(["run", "checkpoints#", "latest", "newest step#", "last commit", ""], rows, {id: "runs"}),
    pager(ans, (o) => { location.hash = `#/?offset=${o}`; }, "runs"));
}
