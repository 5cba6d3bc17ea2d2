// The trialkeeper dashboard: plain JavaScript, no build step. Pages are drawn from the JSON
// API (see README) and redrawn when the live stream (/api/events) says something changed.
"use strict";

const main = document.getElementById("main");
// Where this experiment's pages and API are: "" at the root, "/x/ID" in the experiments home (home.js).
const BASE = location.pathname.replace(/\/+$/, "");
const STATUSES = ["WAITING", "RUNNING", "PAUSED", "SUCCEEDED", "FAILED", "USER_CANCELED", "EARLY_STOPPED", "SYS_CANCELED"];
// Which statuses each trial action applies to (as the server checks).
const ACTIONS = {cancel: ["WAITING", "RUNNING", "PAUSED"], pause: ["WAITING", "RUNNING"], continue: ["PAUSED"]};
const ROW_H = 28;
let current = null; // the page shown: {name, refresh(), dispose()}
let charts = [];

// ---- helpers -----------------------------------------------------------------------------

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function num(v) { return v === null || v === undefined ? "" : (typeof v === "number" ? Number(v.toPrecision(6)).toString() : String(v)); }
function dur(s) {
  if (s === null || s === undefined) return "";
  s = Math.max(0, s);
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
}
function when(t) { return t ? new Date(t * 1000).toLocaleString() : ""; }
function gib(b) { return b === null || b === undefined ? "" : (b / 2 ** 30).toFixed(1) + " GiB"; }
function size(b) {
  if (b === null || b === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return (i ? b.toFixed(1) : String(b)) + " " + units[i];
}
function status(s) { return `<span class="status ${esc(s)}">${esc(s || "UNREADABLE")}</span>`; }
function toast(text) {
  const t = document.getElementById("toast");
  t.textContent = text; t.classList.add("show");
  clearTimeout(toast.timer); toast.timer = setTimeout(() => t.classList.remove("show"), 4000);
}

async function api(path, options) {
  let res;
  try {
    res = await fetch(BASE + path, Object.assign({credentials: "same-origin"}, options || {}));
  } catch (e) { // no answer at all: the dashboard's server has gone
    serverLost();
    throw new ApiError(0, "the dashboard is not answering");
  }
  serverBack();
  let body = null;
  try { body = await res.json(); } catch (e) { body = null; }
  if (res.status === 401) { askToken(); throw new ApiError(401, (body && body.error) || "token needed"); }
  if (!res.ok) throw new ApiError(res.status, (body && body.error) || res.statusText);
  return body;
}
class ApiError extends Error { constructor(status, message) { super(message); this.status = status; } }

function token() { return sessionStorage.getItem("trialkeeper-token") || ""; }
function askToken() { document.getElementById("token").focus(); toast("enter the experiment's token (top right)"); }
document.getElementById("token-form").addEventListener("submit", async ev => {
  ev.preventDefault();
  const value = document.getElementById("token").value.trim();
  document.getElementById("token").value = "";
  try {
    await api("/api/login", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({token: value})});
    sessionStorage.setItem("trialkeeper-token", value);
    document.getElementById("token").placeholder = "token set";
    toast("token accepted"); connect(); route();
  } catch (e) { toast(e.message); }
});
if (token()) document.getElementById("token").placeholder = "token set";

async function act(path, what) {
  if (!token()) { askToken(); return; }
  try {
    await api(path, {method: "POST", headers: {"Authorization": "Bearer " + token()}});
    toast(what);
  } catch (e) { toast(e.message); }
}

// Charts follow the system's colour scheme (prefers-color-scheme), as the page does.
const DARK = window.matchMedia("(prefers-color-scheme: dark)");
DARK.addEventListener("change", () => route()); // the page's charts drawn again in the other scheme
function chart(el, option) {
  const c = echarts.init(el, DARK.matches ? "dark" : null, {renderer: "canvas"});
  c.setOption(Object.assign({backgroundColor: "transparent"}, option));
  charts.push(c);
  return c;
}
function lineOption(title, series, opts) {
  opts = opts || {};
  return {
    animation: false, title: {text: title, left: 10, top: 6, textStyle: {fontSize: 13}},
    grid: {left: 60, right: 20, top: 40, bottom: opts.xName ? 46 : 30}, tooltip: {trigger: opts.item ? "item" : "axis"},
    legend: opts.legend ? {top: 6, right: 10, type: "scroll", width: "55%"} : undefined,
    xAxis: {type: opts.xType || "time", name: opts.xName || "", nameLocation: "middle", nameGap: 26, scale: true,
      minInterval: opts.integer ? 1 : undefined},
    yAxis: {type: "value", scale: true, name: opts.yName || "", nameLocation: "middle", nameGap: 44},
    series: series,
  };
}
window.addEventListener("resize", () => charts.forEach(c => c.resize()));

// ---- live updates ------------------------------------------------------------------------

let source = null;
let pending = false;
let lost = false; // the server stopped answering: the page shows what it last read, and says so
function refreshNow() {
  // One refresh at a time: a burst of changes while one runs costs one more, not many.
  if (pending || !current) return;
  pending = true;
  Promise.resolve(current.refresh()).catch(() => {}).finally(() => { pending = false; });
}
function serverLost() {
  if (lost) return;
  lost = true;
  const live = document.getElementById("live");
  live.textContent = "\u25CF stopped"; live.classList.remove("on");
  const banner = document.getElementById("banner");
  banner.textContent = "The dashboard has stopped: this page shows what it last read and no longer updates. "
    + "It comes back by itself when the dashboard serves again (trialkeeper ui EXP_DIR).";
  banner.hidden = false;
}
function serverBack() {
  if (!lost) return;
  lost = false;
  document.getElementById("banner").hidden = true;
  refreshNow();
}
// Whether the server still answers at all (an answer of any status will do).
async function probe() {
  const abort = new AbortController(), timer = setTimeout(() => abort.abort(), 5000);
  try { await fetch(BASE + "/", {method: "HEAD", cache: "no-store", signal: abort.signal}); serverBack(); }
  catch (e) { serverLost(); }
  finally { clearTimeout(timer); }
}
function connect() {
  if (source) source.close();
  const live = document.getElementById("live");
  source = new EventSource(BASE + "/api/events");
  source.addEventListener("open", () => serverBack());
  source.addEventListener("change", () => {
    live.textContent = "\u25CF live"; live.classList.add("on");
    refreshNow();
  });
  source.onerror = () => {
    if (!lost) { live.textContent = "\u25CF reconnecting"; live.classList.remove("on"); }
    probe(); // a stream that broke is tried again by the browser; a stopped server shows in the probe
  };
}

// ---- overview ----------------------------------------------------------------------------

function overviewPage() {
  main.innerHTML = `<h1 id="exp-title">Experiment</h1>
    <div class="toolbar"><button class="danger" id="stop" style="display:none">Stop experiment</button>
      <span id="actions-why" class="muted"></span></div><div class="cards" id="cards"></div>
    <h2>Best trial</h2><div id="best" class="muted">none yet</div>
    <div class="grid2" style="margin-top:14px"><div class="chart" id="finished-chart"></div><div class="chart" id="best-chart"></div></div>`;
  document.getElementById("stop").addEventListener("click", () => {
    if (confirm("Stop the experiment? Its running trials pause at their next checkpoint (those that save none are canceled); resume continues them."))
      act("/api/experiment/stop", "experiment: stop asked");
  });
  const finished = chart(document.getElementById("finished-chart"), lineOption("Trials ended over time", [], {xName: "time", yName: "trials ended"}));
  const best = chart(document.getElementById("best-chart"), lineOption("Best final metric over time", [], {xName: "time", yName: "best final metric"}));
  async function refresh() {
    const e = await api("/api/experiment");
    document.getElementById("exp-title").textContent = `Experiment ${e.id}${e.name ? " \u2014 " + e.name : ""}`;
    document.getElementById("stop").style.display = e.actions && e.status === "RUNNING" ? "" : "none";
    document.getElementById("actions-why").textContent = e.actions ? "" : e.actions_why || "";
    const cards = [["Status", status(e.status) + (e.reason ? `<div class="muted" style="font-size:12px">${esc(e.reason)}</div>` : "")],
      ["Trials", `<span id="count-total">${e.trial_count}</span>${e.max_trials ? " / " + e.max_trials : ""}`],
      ...STATUSES.filter(s => e.trials[s]).map(s => [s.toLowerCase().replace("_", " "), `<span data-count="${s}">${e.trials[s]}</span>`]),
      ["Elapsed", dur(e.elapsed_s)], ...(e.ended_at ? [] : [["ETA", e.eta_s === null ? "\u2014" : dur(e.eta_s)]]),
      ["Metrics stored", e.metrics], ["Environments", e.environments]];
    document.getElementById("cards").innerHTML = cards.map(([l, v]) =>
      `<div class="card"><div class="label">${esc(l)}</div><div class="value">${v}</div></div>`).join("");
    document.getElementById("best").innerHTML = e.best
      ? `<a href="#/trial/${encodeURIComponent(e.best.id)}">${esc(e.best.id)}</a>: <b>${num(e.best.final_metric)}</b> (${esc(e.optimize_mode)}) ${esc(JSON.stringify(e.best.parameters))}`
      : "none yet";
    const since = {xAxis: {min: e.started_at ? e.started_at * 1000 : undefined}}; // time from the experiment's start
    finished.setOption(since); best.setOption(since);
    finished.setOption({series: [{type: "line", step: "end", showSymbol: false, name: "ended", data: e.finished_over_time.map(([t, n]) => [t * 1000, n])}]});
    best.setOption({series: [{type: "line", step: "end", showSymbol: false, name: "best", data: e.best_over_time.map(([t, v]) => [t * 1000, v])}]});
  }
  return {name: "overview", refresh};
}

// ---- trials: table.js ------------------------------------------------------------------------

// ---- one trial -----------------------------------------------------------------------------

function shownValue(v) { return typeof v === "object" ? JSON.stringify(v) : num(v); }
// A dict final result (NNI's {"default": ..., "loss": ...}): a row per key, as NNI's web UI shows.
function resultRows(result) {
  if (result === null || typeof result !== "object" || Array.isArray(result)) return "";
  return Object.entries(result).map(([k, v]) =>
    `<tr><th>final ${esc(k)}</th><td>${esc(shownValue(v))}</td></tr>`
  ).join("");
}
// The intermediate curve, and one more per numeric key of dict results ("default" first).
function resultCurves(d) {
  const line = (name, data) => ({type: "line", name, showSymbol: data.length < 60, data});
  const curves = [line(d.result_keys.length ? "default" : "intermediate", d.intermediate)];
  for (const key of d.result_keys.filter(k => k !== "default")) {
    const data = d.intermediate_results
      .filter(([, r]) => r !== null && typeof r === "object" && typeof r[key] === "number")
      .map(([i, r]) => [i, r[key]]);
    if (data.length) curves.push(line(key, data));
  }
  return curves;
}

// A trial's output as the page shows it: its last lines (LOG_WINDOW of them), followed live,
// with earlier parts loaded on request. The lines beyond the window are dropped as new ones
// come, so a trial that prints without end costs the page no more than the window.
const LOG_WINDOW = 2000;
const LOG_CHARS = 4 * 2 ** 20; // and no more than this much text, however long the lines
const LOG_JUMP = 4 * 2 ** 20; // this far behind, the page goes to the end rather than read it all
function logWindow(id, stream) {
  const base = `/api/trials/${encodeURIComponent(id)}/log?stream=${stream}`;
  // This page's own elements: a read that ends after the page was left writes into nothing shown.
  const el = document.getElementById(stream), button = document.getElementById(stream + "-earlier");
  const note = document.getElementById(stream + "-note");
  const pre = () => el;
  // blocks: {node, offset, end, lines, exact} in file order; start: where the first begins, end: where to read on.
  let blocks = [], start = 0, end = null, total = 0, lines = 0, chars = 0, following = true;
  let allowance = LOG_WINDOW, charAllowance = LOG_CHARS; // grown by what is asked for with "earlier"
  // Every read of this stream runs one after the other (a follow begun twice would read the
  // same offset twice and show its lines twice), and a follow asked for while one waits is that one.
  let chain = Promise.resolve(), queued = null;
  function serial(fn) { const p = chain.then(fn); chain = p.catch(() => {}); return p; }
  const count = text => { let n = 0; for (let i = text.indexOf("\n"); i >= 0; i = text.indexOf("\n", i + 1)) n++; return n; };
  function block(part) {
    return {node: document.createTextNode(part.text), offset: part.offset, end: part.next_offset, lines: count(part.text), exact: part.exact};
  }
  function add(b, first) {
    const el = pre();
    if (first) { el.insertBefore(b.node, el.firstChild); blocks.unshift(b); start = b.offset; }
    else {
      const atEnd = el.scrollTop + el.clientHeight >= el.scrollHeight - 4;
      el.appendChild(b.node); blocks.push(b); end = b.end;
      if (atEnd) el.scrollTop = el.scrollHeight; // kept at the end while it is read there
    }
    lines += b.lines; chars += b.node.length;
  }
  function drop() { // the lines beyond the window, oldest first
    while (blocks.length) {
      const b = blocks[0], excess = lines - allowance, over = chars - charAllowance;
      if (excess <= 0 && over <= 0) break;
      if (blocks.length > 1 && (b.lines <= excess || over > 0)) {
        blocks.shift(); b.node.remove(); lines -= b.lines; chars -= b.node.length; start = blocks[0].offset; continue;
      }
      if (!b.exact || excess <= 0 || excess >= b.lines) break;
      let cut = -1; // after the excess-th newline: the block's text is its bytes, so the new offset is known
      for (let n = 0; n < excess; n++) cut = b.node.data.indexOf("\n", cut + 1);
      const gone = b.node.data.slice(0, cut + 1);
      b.offset += new TextEncoder().encode(gone).length; b.node.deleteData(0, gone.length);
      b.lines -= excess; lines -= excess; chars -= gone.length; start = b.offset;
    }
  }
  function show() {
    button.style.display = start > 0 ? "" : "none";
    button.textContent = `Load earlier output (${size(start)} before)`;
    note.textContent = start > 0 ? `the last ${lines} lines of ${size(total)} shown` : "";
  }
  async function tail() {
    const part = await api(`${base}&tail=${LOG_WINDOW}`);
    pre().textContent = ""; blocks = []; lines = 0; chars = 0; allowance = LOG_WINDOW; charAllowance = LOG_CHARS;
    add(block(part), false); start = part.offset; total = part.size; following = part.following;
    pre().scrollTop = pre().scrollHeight;
  }
  async function followNow() {
    if (end === null) await tail();
    for (let i = 0; i < 50; i++) { // a chunk at a time, up to a bounded amount per call
      const part = await api(`${base}&offset=${end}`);
      total = part.size; following = part.following;
      if (part.size - end > LOG_JUMP) { await tail(); continue; }
      const moved = part.next_offset > end;
      if (part.text) add(block(part), false);
      end = part.next_offset;
      drop();
      if (part.next_offset >= part.size || !moved) break; // not moved: a result line not yet complete
    }
    show();
    return following;
  }
  return {
    follow() {
      if (!queued) queued = serial(() => { queued = null; return followNow(); });
      return queued;
    },
    earlier: () => serial(async () => {
      if (!start) return;
      const part = await api(`${base}&before=${start}`);
      const b = block(part);
      allowance += b.lines; charAllowance += b.node.length; // what was asked for stays while the end is followed
      add(b, true); show();
    }),
  };
}

function trialPage(id) {
  main.innerHTML = `<h1>Trial <span id="trial-id"></span> <span id="trial-status"></span></h1>
    <div class="toolbar"><button id="pause" title="save a checkpoint and end, freeing the slot">Pause</button>
      <button id="continue" title="go on from the last checkpoint">Continue</button>
      <button class="danger" id="cancel">Cancel trial</button>
      <button id="rerun" title="a new trial with the same parameters">Run again</button>
      <span id="trial-reason" class="muted"></span><span id="actions-why" class="muted"></span></div>
    <div class="grid2"><div><h2>Parameters</h2><table class="plain" id="params"></table>
      <h2>Status history</h2><table class="plain" id="history"></table>
      <h2>Checkpoints</h2><table class="plain" id="checkpoints"></table></div>
      <div><div class="chart" id="curve-chart"></div><div class="chart small" id="gpu-chart" style="margin-top:12px" hidden></div></div></div>
    ${["stdout", "stderr"].map(s => `<h2>${s} <a class="download" id="${s}-download" download
        href="${BASE}/api/trials/${encodeURIComponent(id)}/log/download?stream=${s}">download</a></h2>
      <div class="log-head"><button id="${s}-earlier" style="display:none">Load earlier output</button>
        <span id="${s}-note" class="muted"></span></div><pre class="log" id="${s}"></pre>`).join("")}`;
  document.getElementById("trial-id").textContent = id;
  for (const action of [...Object.keys(ACTIONS), "rerun"]) {
    document.getElementById(action).addEventListener("click", () => {
      if (action === "cancel" && token() && !confirm(`Cancel trial ${id}? A running trial is stopped (SIGTERM, then SIGKILL) and ends USER_CANCELED.`)) return;
      act(`/api/trials/${encodeURIComponent(id)}/${action}`, `trial ${id}: ${action} asked`).then(() => refresh().catch(() => {}));
    });
  }
  const curve = chart(document.getElementById("curve-chart"), lineOption("Intermediate results", [], {xType: "value", xName: "report", yName: "result", integer: true}));
  const gpu = chart(document.getElementById("gpu-chart"), lineOption("GPU utilisation (%)", [], {legend: true, xName: "time"}));
  const logs = {stdout: logWindow(id, "stdout"), stderr: logWindow(id, "stderr")};
  for (const stream of Object.keys(logs)) {
    document.getElementById(stream + "-earlier").addEventListener("click", () => logs[stream].earlier().catch(e => toast(e.message)));
  }
  let following = true, timer = null, disposed = false;
  async function follow(stream) { following = await logs[stream].follow(); }
  async function refresh() {
    const d = await api(`/api/trials/${encodeURIComponent(id)}`);
    const t = d.trial;
    document.getElementById("trial-status").innerHTML = status(t.status) + (t.stopping ? " <span class='muted'>(stopping)</span>" : "");
    document.getElementById("trial-reason").textContent = [d.failure_summary || t.reason || t.waiting_reason, t.final_metric !== null ? "final metric " + num(t.final_metric) : ""].filter(Boolean).join(" \u2014 ");
    for (const [action, states] of Object.entries(ACTIONS)) {
      document.getElementById(action).style.display = d.actions && states.includes(t.status) && !t.stopping ? "" : "none";
    }
    document.getElementById("rerun").style.display = d.actions ? "" : "none";
    document.getElementById("actions-why").textContent = d.actions ? "" : d.actions_why || "";
    document.getElementById("params").innerHTML = Object.entries(t.parameters || {}).map(([k, v]) =>
      `<tr><th>${esc(k)}</th><td>${esc(typeof v === "object" ? JSON.stringify(v) : v)}</td></tr>`).join("")
      + `<tr><th>environment</th><td>${esc(t.environment_id || "")}</td></tr><tr><th>duration</th><td>${dur(t.duration_s)}</td></tr>`
      + (t.ranks || []).map(r => `<tr><th>rank ${r.rank}</th><td>${esc(r.environment_id)}`
        + `${r.gpu_indices.length ? ", GPUs " + esc(r.gpu_indices.join(",")) : ""}: ${esc(r.state)}</td></tr>`).join("");
    document.getElementById("params").innerHTML += resultRows(d.final_result);
    document.getElementById("history").innerHTML = "<tr><th>when</th><th>from</th><th>to</th><th>why</th></tr>" + d.history.map(h =>
      `<tr><td>${esc(when(h.at))}</td><td>${esc(h.old)}</td><td>${esc(h.new)}</td><td>${esc(h.reason)}</td></tr>`).join("");
    document.getElementById("checkpoints").innerHTML = d.checkpoints.length
      ? "<tr><th>step</th><th>size</th><th>saved</th><th>where</th></tr>" + d.checkpoints.map(c =>
        `<tr data-step="${esc(c.step)}"><td>${esc(c.step)}</td><td>${esc(size(c.size_bytes))}</td><td>${esc(when(c.saved_at))}</td><td>${esc(c.where)}</td></tr>`).join("")
      : `<tr><td class="muted">none saved</td></tr>`;
    const keyed = d.result_keys.length > 1;
    curve.setOption({legend: keyed ? {top: 6, right: 10, type: "scroll", width: "55%"} : undefined,
      series: resultCurves(d)}, {replaceMerge: ["series"]});
    const gpuBox = document.getElementById("gpu-chart"), hadGpus = !gpuBox.hidden;
    gpuBox.hidden = !d.gpu_series.length; // no empty frame for a trial that held no GPU
    if (!gpuBox.hidden && !hadGpus) gpu.resize();
    gpu.setOption({title: {text: "GPU utilisation (%) and memory (GiB)"}, xAxis: {min: t.started_at ? t.started_at * 1000 : undefined},
      yAxis: [{type: "value", name: "%", min: 0, max: 100}, {type: "value", name: "GiB", min: 0}],
      series: d.gpu_series.flatMap(g => [
        {type: "line", showSymbol: false, name: g.uuid.slice(0, 12) + " %", data: g.utilization.map(([at, u]) => [at * 1000, u])},
        {type: "line", showSymbol: false, yAxisIndex: 1, lineStyle: {type: "dashed"}, name: g.uuid.slice(0, 12) + " GiB",
          data: g.memory_used_bytes.map(([at, b]) => [at * 1000, b / 2 ** 30])}])}, {replaceMerge: ["series", "yAxis"]});
    document.getElementById("gpu-chart").dataset.samples = d.gpu_usage.samples;
    if (!disposed) { await follow("stdout"); await follow("stderr"); }
  }
  // Output is not a store change: while the trial runs, its logs are polled each second.
  async function tick() {
    if (disposed) return;
    try { if (following) { await follow("stdout"); await follow("stderr"); } } catch (e) { /* shown on the next refresh */ }
    timer = setTimeout(tick, 1000);
  }
  refresh().then(() => { drawn(); tick(); }).catch(e => {
    if (e.status !== 404) { toast(e.message); return; }
    disposed = true; // no such trial: a page that says so, and nothing more
    main.innerHTML = `<h1>No trial ${esc(id)}</h1><p class="muted">This experiment has no trial of that id.
      <a href="#/trials">See its trials</a>.</p>`;
    drawn();
  });
  return {name: "trial", refresh, dispose: () => { disposed = true; clearTimeout(timer); }};
}

// ---- comparison: plots.js --------------------------------------------------------------------

// ---- environments --------------------------------------------------------------------------

function environmentsPage(params) {
  main.innerHTML = `<h1>Environments</h1>
    <div class="toolbar"><button id="envs-prev">Previous</button><button id="envs-next">Next</button>
      <span id="envs-shown" class="muted"></span></div><table class="plain" id="envs"></table>
    <div id="gpu-section" hidden><h2 id="gpu-title">GPUs over time</h2><div class="grid2"><div class="chart small" id="env-util"></div><div class="chart small" id="env-mem"></div></div></div>
    <h2>Waiting trials</h2><div id="waiting-total" class="muted"></div><table class="plain" id="waiting"></table>`;
  let selected = params.get("env") || "";
  // A page of environments at a time: a thousand of them, each with its GPUs, are too many for one answer.
  let offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0), total = 0;
  const ENV_PAGE = 100;
  const turn = by => { offset = Math.max(0, offset + by); refresh().catch(e => toast(e.message)); };
  document.getElementById("envs-prev").addEventListener("click", () => turn(-ENV_PAGE));
  document.getElementById("envs-next").addEventListener("click", () => turn(ENV_PAGE));
  const util = chart(document.getElementById("env-util"), lineOption("Utilisation (%)", [], {legend: true, xName: "time", yName: "%"}));
  const mem = chart(document.getElementById("env-mem"), lineOption("Memory used (GiB)", [], {legend: true, xName: "time", yName: "GiB"}));
  async function refresh() {
    const d = await api(`/api/environments?offset=${offset}&limit=${ENV_PAGE}`);
    total = d.total;
    if (offset && offset >= total) { offset = Math.max(0, Math.floor((total - 1) / ENV_PAGE) * ENV_PAGE); return refresh(); }
    document.getElementById("envs-shown").textContent = total
      ? `${offset + 1}\u2013${offset + d.environments.length} of ${total}` : "none yet";
    document.getElementById("envs-prev").disabled = offset === 0;
    document.getElementById("envs-next").disabled = offset + d.environments.length >= total;
    if (!selected && d.environments.length) selected = d.environments[0].id;
    document.getElementById("envs").innerHTML = "<tr><th>environment</th><th>platform</th><th>host</th><th>state</th><th>agent</th><th>GPUs</th><th>trials</th></tr>"
      + d.environments.map(e => `<tr data-env="${esc(e.id)}"><td><a href="#/environments?env=${encodeURIComponent(e.id)}">${esc(e.id)}</a></td>
        <td>${esc(e.platform)}</td><td>${esc(e.hostname || e.platform_id)}</td><td>${status(e.status)} <span class="muted">${esc(e.reason)}</span></td>
        <td>${e.connected ? "connected" : "not connected"}</td>
        <td>${e.gpus.length ? e.gpus.map(g => `GPU${esc(g.index)} ${esc(g.name)} ${g.utilization_percent === null ? "" : num(g.utilization_percent) + "%"} ${gib(g.memory_used_bytes)}/${gib(g.memory_total_bytes)}${g.held_by.length ? " [" + g.held_by.map(esc).join(" ") + "]" : ""}`).join("<br>") : `<span class="muted">${esc(e.gpu_unavailable_reason || "none")}</span>`}</td>
        <td>${e.trial_count} (${e.running_trials.length} active) <a href="#/trials?environment=${encodeURIComponent(e.id)}">list</a></td></tr>`).join("");
    document.getElementById("waiting-total").textContent = d.waiting_total ? `${d.waiting_total} waiting` : "none waiting";
    document.getElementById("waiting").innerHTML = d.waiting.length ? "<tr><th>trial</th><th>why it waits</th></tr>" + d.waiting.map(w =>
      `<tr><td><a href="#/trial/${encodeURIComponent(w.id)}">${esc(w.id)}</a></td><td>${esc(w.reason)}</td></tr>`).join("") : "";
    if (selected) {
      document.getElementById("gpu-title").textContent = `GPUs of ${selected} over time`;
      const g = await api(`/api/environments/${encodeURIComponent(selected)}/gpus`);
      const section = document.getElementById("gpu-section"), had = !section.hidden;
      section.hidden = !g.gpus.length; // no empty frames where no GPU was sampled
      if (g.gpus.length && !had) { util.resize(); mem.resize(); }
      util.setOption({series: g.gpus.map(s => ({type: "line", showSymbol: false, name: s.uuid.slice(0, 12), data: s.utilization.map(([t, v]) => [t * 1000, v])}))}, {replaceMerge: ["series"]});
      mem.setOption({series: g.gpus.map(s => ({type: "line", showSymbol: false, name: s.uuid.slice(0, 12), data: s.memory_used_bytes.map(([t, v]) => [t * 1000, v / 2 ** 30])}))}, {replaceMerge: ["series"]});
    }
  }
  return {name: "environments", refresh};
}

// ---- routing -------------------------------------------------------------------------------

function route() {
  if (current && current.dispose) current.dispose();
  charts.forEach(c => c.dispose()); charts = [];
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, qs] = hash.split("?");
  const params = new URLSearchParams(qs || "");
  const parts = path.split("/");
  let name = parts[0] || "overview";
  if (name === "trial" && parts[1]) current = trialPage(decodeURIComponent(parts.slice(1).join("/")));
  else if (name === "trials") current = trialsPage(params);
  else if (name === "compare") current = comparePage(params);
  else if (name === "environments") current = environmentsPage(params);
  else if (name === "context") current = contextPage(params);
  else { name = "overview"; current = overviewPage(); }
  document.querySelectorAll("nav a").forEach(a => a.classList.toggle("active", a.dataset.page === (name === "trial" ? "trials" : name)));
  delete document.body.dataset.drawn;
  if (current.name !== "trials" && current.name !== "trial") Promise.resolve(current.refresh()).then(drawn, e => toast(e.message));
}
// Marks the page drawn once its first data is in (what the screenshot script waits for).
function drawn() { if (current) document.body.dataset.drawn = current.name; }
window.addEventListener("hashchange", route);
route();
connect();
