// The experiments home (trialkeeper ui --dir DIR): every experiment of a directory with its
// status, progress, best result and start; each opens at /x/NAME/; two or more picked are
// compared: best result as their trials ended, and each parameter's distribution.
"use strict";

const picked = new Set();
let compared = null, curves = null, dist = null;

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function num(v) { return v === null || v === undefined ? "" : (typeof v === "number" ? Number(v.toPrecision(6)).toString() : String(v)); }
function toast(text) {
  const t = document.getElementById("toast");
  t.textContent = text; t.classList.add("show");
  clearTimeout(toast.timer); toast.timer = setTimeout(() => t.classList.remove("show"), 4000);
}
async function get(path) {
  let res;
  try { res = await fetch(path, {credentials: "same-origin"}); } catch (e) {
    const banner = document.getElementById("banner");
    banner.textContent = "The dashboard has stopped: this page shows what it last read and no longer updates.";
    banner.hidden = false;
    throw e;
  }
  document.getElementById("banner").hidden = true;
  const body = await res.json().catch(() => null);
  if (res.status === 401) document.getElementById("token").focus();
  if (!res.ok) throw new Error((body && body.error) || res.statusText);
  return body;
}

// Bound beyond this machine, reads need the token: traded once for the session's cookie.
document.getElementById("token-form").addEventListener("submit", async ev => {
  ev.preventDefault();
  const field = document.getElementById("token"), value = field.value.trim();
  field.value = "";
  const res = await fetch("/api/login", {method: "POST", credentials: "same-origin",
    headers: {"Content-Type": "application/json"}, body: JSON.stringify({token: value})}).catch(() => null);
  toast(res && res.ok ? "token accepted" : "wrong token");
  if (res && res.ok) { field.placeholder = "token set"; refresh().catch(e => toast(e.message)); }
});

function progress(e) {
  if (!e.max_trials) return `${e.ended} of ${e.trial_count} ended`;
  const share = Math.min(1, e.ended / e.max_trials);
  return `<span class="progress" title="${Math.round(share * 100)}%"><span style="width:${share * 100}%"></span></span> ${e.ended} / ${e.max_trials}`;
}

// The rows the status filter and the search leave.
function shown(experiments) {
  const status = document.getElementById("home-status").value;
  const q = document.getElementById("home-search").value.trim().toLowerCase();
  return experiments.filter(e => (!status || e.status === status)
    && (!q || [e.key, e.id, e.name].some(v => String(v || "").toLowerCase().includes(q))));
}

let listed = null;
async function refresh() {
  listed = await get("/api/home");
  draw();
}
function draw() {
  const d = listed;
  if (!d) return;
  document.getElementById("home-dir").textContent = d.directory;
  const filter = document.getElementById("home-status"), chosen = filter.value;
  const statuses = [...new Set(d.experiments.map(e => e.status).filter(Boolean))].sort();
  filter.innerHTML = `<option value="">every status</option>` + statuses.map(s => `<option>${esc(s)}</option>`).join("");
  filter.value = statuses.includes(chosen) ? chosen : "";
  const rows = shown(d.experiments).map(e => e.error
    ? `<tr data-key="${esc(e.key)}"><td></td><td>${esc(e.key)}</td><td colspan="5" class="muted">${esc(e.error)}</td></tr>`
    : `<tr data-key="${esc(e.key)}" class="${picked.has(e.key) ? "picked" : ""}">
      <td><input type="checkbox" aria-label="pick ${esc(e.key)}" data-pick="${esc(e.key)}" ${picked.has(e.key) ? "checked" : ""}></td>
      <td><a href="/x/${encodeURIComponent(e.key)}/">${esc(e.id)}</a>${e.name ? ` <span class="muted">${esc(e.name)}</span>` : ""}
        ${e.key !== e.id ? `<div class="muted" style="font-size:12px">${esc(e.key)}</div>` : ""}</td>
      <td><span class="status ${esc(e.status)}">${esc(e.status)}</span>${e.reason ? `<div class="muted" style="font-size:12px">${esc(e.reason)}</div>` : ""}</td>
      <td data-col="progress">${progress(e)}</td>
      <td data-col="best">${e.best ? `<b>${esc(num(e.best.final_metric))}</b> <span class="muted">(${esc(e.optimize_mode)}, ${esc(e.best.id)})</span>` : `<span class="muted">none yet</span>`}</td>
      <td>${esc(e.started_at ? new Date(e.started_at * 1000).toLocaleString() : "")}</td></tr>`);
  document.getElementById("experiments").innerHTML = "<tr><th></th><th>experiment</th><th>status</th><th>progress</th><th>best</th><th>started</th></tr>"
    + (rows.join("") || `<tr><td colspan="6" class="muted">${d.experiments.length ? "none matches" : "no experiment in " + esc(d.directory)}</td></tr>`);
  document.querySelectorAll("[data-pick]").forEach(box => box.addEventListener("change", () => {
    if (box.checked) picked.add(box.dataset.pick); else picked.delete(box.dataset.pick);
    box.closest("tr").classList.toggle("picked", box.checked);
    pickedChanged();
  }));
  pickedChanged();
}
function pickedChanged() {
  const button = document.getElementById("compare-picked");
  button.disabled = picked.size < 2 || picked.size > 8;
  document.getElementById("picked-note").textContent = picked.size < 2
    ? "pick two or more to compare their best results and parameters" : picked.size > 8 ? "8 at most" : `${picked.size} picked`;
}

// An experiment's name in a legend: its id, and its directory's name where that differs.
function label(e) { return e.key === e.id ? e.id : `${e.id} (${e.key})`; }

async function compare() {
  const keys = [...picked];
  compared = await get("/api/home/compare?keys=" + keys.map(encodeURIComponent).join(","));
  document.getElementById("comparison").hidden = false;
  document.getElementById("comparison-title").textContent = "Comparison of " + compared.experiments.map(label).join(", ");
  if (!curves) {
    curves = echarts.init(document.getElementById("best-curves"));
    dist = echarts.init(document.getElementById("distribution"));
    window.addEventListener("resize", () => { curves.resize(); dist.resize(); });
  }
  drawCurves();
  const names = [...new Set(compared.experiments.flatMap(e => e.trials.flatMap(t => Object.keys(t.parameters))))];
  const pick = document.getElementById("dist-param"), keep = pick.value;
  pick.innerHTML = names.map(n => `<option>${esc(n)}</option>`).join("");
  if (names.includes(keep)) pick.value = keep;
  drawDistribution();
  document.body.dataset.drawn = "home-compare";
}

// Each experiment's best final metric so far, by trials ended or by time since it started.
function drawCurves() {
  const byTime = document.getElementById("curve-x").value === "time";
  curves.setOption({
    animation: false, title: {text: `Best final metric so far, by ${byTime ? "time since each started" : "trials ended"}`,
      left: 10, top: 6, textStyle: {fontSize: 13}},
    legend: {top: 6, right: 10}, tooltip: {trigger: "axis"}, grid: {left: 60, right: 20, top: 40, bottom: 46},
    xAxis: {type: "value", name: byTime ? "seconds since its start" : "trials ended", nameLocation: "middle", nameGap: 26,
      minInterval: byTime ? 0 : 1},
    yAxis: {type: "value", scale: true},
    series: compared.experiments.map(e => ({type: "line", step: "end", showSymbol: false, name: label(e),
      data: e.best_curve.map(([n, best, at]) => [byTime ? Math.max(0, at - (e.started_at || at)) : n, best])})),
  }, {replaceMerge: ["series"]});
}

// Each experiment's share of its sampled trials per value (a choice, or any text) or per bin
// (numbers: 12 bins over all of them, on a log scale where the search space says log).
function drawDistribution() {
  const p = document.getElementById("dist-param").value;
  const values = compared.experiments.map(e => e.trials.map(t => t.parameters[p]).filter(v => v !== undefined && v !== null));
  const all = values.flat();
  const numeric = all.length && all.every(v => typeof v === "number");
  const log = numeric && all.every(v => v > 0) && compared.experiments.some(e => /^q?log/.test(e.space[p] || ""));
  let labels, count;
  if (numeric) {
    const f = log ? Math.log10 : (x => x), inv = log ? (x => 10 ** x) : (x => x);
    const lo = Math.min(...all.map(f)), hi = Math.max(...all.map(f)), bins = hi > lo ? 12 : 1, width = (hi - lo) / bins || 1;
    const short = x => String(Number(x.toPrecision(3))); // a bin's edges, short enough to read
    labels = [...Array(bins).keys()].map(i => `${short(inv(lo + i * width))}\u2013${short(inv(lo + (i + 1) * width))}`);
    count = vs => { const c = Array(bins).fill(0); vs.forEach(v => c[Math.min(bins - 1, Math.floor((f(v) - lo) / width))]++); return c; };
  } else {
    labels = [...new Set(all.map(v => typeof v === "object" ? JSON.stringify(v) : String(v)))];
    count = vs => labels.map(l => vs.filter(v => (typeof v === "object" ? JSON.stringify(v) : String(v)) === l).length);
  }
  document.getElementById("dist-note").textContent = numeric ? (log ? "log-spaced bins" : "even bins") : "";
  dist.setOption({
    animation: false, title: {text: `${p}: share of each experiment's trials`, left: 10, top: 6, textStyle: {fontSize: 13}},
    legend: {top: 6, right: 10}, tooltip: {trigger: "axis"},
    grid: {left: 30, right: 30, top: 40, bottom: 30, containLabel: true}, // rotated bin labels stay inside
    xAxis: {type: "category", data: labels, name: p, nameLocation: "middle", nameGap: numeric ? 60 : 30,
      axisLabel: {rotate: numeric ? 20 : 0}},
    yAxis: {type: "value", max: 1},
    series: compared.experiments.map((e, i) => {
      const c = count(values[i]), total = values[i].length || 1;
      return {type: "bar", name: label(e), data: c.map(n => n / total)};
    }),
  }, {replaceMerge: ["series", "xAxis"]});
}

document.getElementById("compare-picked").addEventListener("click", () => compare().catch(e => toast(e.message)));
document.getElementById("dist-param").addEventListener("change", drawDistribution);
document.getElementById("curve-x").addEventListener("change", () => { if (compared) drawCurves(); });
document.getElementById("home-status").addEventListener("change", draw);
document.getElementById("home-search").addEventListener("input", draw);
async function tick() {
  try { await refresh(); document.body.dataset.drawn = document.body.dataset.drawn || "home"; }
  catch (e) { if (e instanceof Error && !(e instanceof TypeError)) toast(e.message); } // a lost server: the banner says so
  setTimeout(tick, 5000);
}
tick();
