// The trials table: virtualised (only the rows in view are drawn), sorted, filtered and paged
// by the server; columns chosen from the parameters and the keys of dict results; trials picked
// to compare; what it shows exported as CSV or JSON. Uses app.js's helpers (api, esc, num, ...).
"use strict";

const TABLE_PAGE = 200;
// Columns every table has: [key (also its sort key), label, width, whether shown at first].
const TABLE_FIXED = [["sequence", "#", "56px", true], ["id", "trial", "96px", true], ["status", "status", "132px", true],
  ["metric", "metric", "110px", true], ["latest", "latest intermediate", "176px", true],
  ["duration", "duration", "100px", true], ["started", "started", "176px", true], ["ended", "ended", "176px", true],
  ["environment", "environment", "130px", true]];
const UNSORTABLE = new Set(["latest"]);

function latestShown(t) {
  const v = t.latest_intermediate;
  if (v === null || v === undefined) return "";
  const text = typeof v === "object" ? (typeof v.default === "number" ? num(v.default) : JSON.stringify(v)) : num(v);
  return `${esc(text)} <span class="muted">@${esc(t.latest_index)}</span>`;
}
// A time as the table shows it: local, to the second, in a fixed width.
function stamp(t) {
  if (!t) return "";
  const d = new Date(t * 1000), two = n => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
}
function resultShown(t, key) {
  const r = t.final_metric_value;
  return r !== null && typeof r === "object" && !Array.isArray(r) ? esc(shownValue(r[key])) : "";
}

function trialsPage(params) {
  const state = {status: params.get("status") || "", q: params.get("q") || "", environment: params.get("environment") || "",
    sort: params.get("sort") || "sequence", order: params.get("order") || "asc", total: 0, pages: new Map(),
    columns: [], hidden: new Set(JSON.parse(sessionStorage.getItem("trialkeeper-hidden") || "[]")),
    parameters: [], resultKeys: [], version: 0, selected: new Set()};
  main.innerHTML = `<h1>Trials</h1><div class="toolbar">
      <select id="status-filter" aria-label="status"><option value="">every status</option>${STATUSES.map(s => `<option value="${s}">${s}</option>`).join("")}</select>
      <input id="search" type="search" placeholder="search id, parameters, environment" size="32" aria-label="search">
      <details class="chooser" id="column-chooser"><summary>Columns</summary><div id="column-list"></div></details>
      <span id="env-filter"></span><span id="trial-total" class="muted"></span>
      <span class="spacer"></span>
      <button id="compare-selected" disabled title="the selected trials' curves and parameters on the comparison page">Compare selected</button>
      <button id="clear-selected" disabled>Clear selection</button>
      <a class="button" id="export-csv" download>Export CSV</a><a class="button" id="export-json" download>Export JSON</a></div>
    <div class="vtable" id="vtable"><div class="head" id="vhead" role="row"></div><div id="vbody" style="position:relative"></div></div>`;
  const box = document.getElementById("vtable"), head = document.getElementById("vhead"), body = document.getElementById("vbody");
  function drawEnvFilter() {
    const box = document.getElementById("env-filter");
    box.innerHTML = state.environment ? `environment <b>${esc(state.environment)}</b> <button id="env-clear" title="every environment" aria-label="every environment">\u2715</button>` : "";
    if (state.environment) document.getElementById("env-clear").addEventListener("click", () => { state.environment = ""; drawEnvFilter(); reset(); });
  }
  drawEnvFilter();
  document.getElementById("status-filter").value = state.status;
  document.getElementById("search").value = state.q;
  document.getElementById("status-filter").addEventListener("change", ev => { state.status = ev.target.value; reset(); });
  let typing = null;
  document.getElementById("search").addEventListener("input", ev => {
    clearTimeout(typing); typing = setTimeout(() => { state.q = ev.target.value; reset(); }, 250);
  });
  box.addEventListener("scroll", () => draw());
  document.getElementById("compare-selected").addEventListener("click", () => {
    location.hash = "#/compare?ids=" + encodeURIComponent([...state.selected].join(","));
  });
  document.getElementById("clear-selected").addEventListener("click", () => { state.selected.clear(); drawSelection(); draw(); });
  body.addEventListener("change", ev => {
    const box = ev.target.closest("input[data-select]");
    if (!box) return;
    if (box.checked) state.selected.add(box.dataset.select); else state.selected.delete(box.dataset.select);
    drawSelection();
  });

  // Every column there can be: the fixed ones, then each parameter, then each key of dict results.
  function allColumns() {
    return [...TABLE_FIXED.map(([k, l, w]) => [k, l, w]), ...state.parameters.map(p => ["param:" + p, p, "124px"]),
      ...state.resultKeys.filter(k => k !== "default").map(k => ["result:" + k, "final " + k, "110px"])];
  }
  function drawChooser() {
    document.getElementById("column-list").innerHTML = allColumns().filter(c => c[0] !== "id").map(([key, label]) =>
      `<label><input type="checkbox" data-column="${esc(key)}" ${state.hidden.has(key) ? "" : "checked"}> ${esc(label)}</label>`).join("");
    document.querySelectorAll("#column-list input").forEach(i => i.addEventListener("change", () => {
      if (i.checked) state.hidden.delete(i.dataset.column); else state.hidden.add(i.dataset.column);
      sessionStorage.setItem("trialkeeper-hidden", JSON.stringify([...state.hidden]));
      state.columns = allColumns().filter(c => !state.hidden.has(c[0]));
      drawHead(); draw(); drawExport();
    }));
  }
  function template() { return ["34px", ...state.columns.map(c => c[2])].join(" "); }
  function drawHead() {
    const focused = head.contains(document.activeElement) ? document.activeElement.dataset.sort : null;
    head.style.gridTemplateColumns = template();
    head.innerHTML = `<div class="select" role="columnheader" aria-label="selected"></div>` + state.columns.map(([key, label]) => {
      const sorted = key === state.sort, sortable = !UNSORTABLE.has(key);
      const aria = sorted ? (state.order === "desc" ? "descending" : "ascending") : "none";
      return `<div role="columnheader" aria-sort="${aria}" data-sort="${esc(key)}" ${sortable ? `tabindex="0" title="sort by ${esc(label)}"` : ""}
        class="${sorted ? "sorted" + (state.order === "desc" ? " desc" : "") : ""}${sortable ? "" : " unsortable"}">${esc(label)}</div>`;
    }).join("");
    head.querySelectorAll("div[tabindex]").forEach(d => {
      const sortBy = () => {
        const key = d.dataset.sort;
        state.order = key === state.sort && state.order === "asc" ? "desc" : "asc";
        state.sort = key; reset();
      };
      d.addEventListener("click", sortBy);
      d.addEventListener("keydown", ev => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); sortBy(); } });
    });
    // Drawn again (a sort, a column chosen), the header that had the focus keeps it.
    const again = focused && head.querySelector(`[data-sort="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
  function filters() {
    const q = new URLSearchParams({sort: state.sort, order: state.order});
    if (state.status) q.set("status", state.status);
    if (state.environment) q.set("environment", state.environment);
    if (state.q) q.set("q", state.q);
    return q;
  }
  // The trials shown (filter, search, sort), or the ones ticked when there are any, with the columns shown.
  function drawExport() {
    const n = state.selected.size;
    for (const format of ["csv", "json"]) {
      const q = n ? new URLSearchParams({sort: state.sort, order: state.order, ids: [...state.selected].join(",")}) : filters();
      q.set("format", format); q.set("columns", state.columns.map(c => c[0]).join(","));
      const a = document.getElementById("export-" + format);
      a.href = BASE + "/api/trials/export?" + q;
      a.textContent = `Export ${format.toUpperCase()}${n ? ` (${n} selected)` : ""}`;
      a.title = n ? `the ${n} selected trial${n === 1 ? "" : "s"}` : `the ${state.total} trial${state.total === 1 ? "" : "s"} shown`;
      a.title += `, with the columns shown, as ${format.toUpperCase()}`;
    }
  }
  function drawSelection() {
    drawExport();
    const n = state.selected.size;
    const compare = document.getElementById("compare-selected");
    compare.disabled = n < 1 || n > 100; compare.textContent = n ? `Compare selected (${n})` : "Compare selected";
    document.getElementById("clear-selected").disabled = n === 0;
  }
  async function load(page, version) {
    const q = filters();
    q.set("offset", page * TABLE_PAGE); q.set("limit", TABLE_PAGE);
    const data = await api("/api/trials?" + q);
    if (version !== state.version || state.gone) return; // a newer read, or the page was left
    state.pages.set(page, data.trials);
    const keys = data.parameters.join("\n") + "\t" + data.result_keys.join("\n");
    if (data.total !== state.total || keys !== state.keys) {
      state.total = data.total; state.keys = keys;
      state.parameters = data.parameters; state.resultKeys = data.result_keys;
      state.columns = allColumns().filter(c => !state.hidden.has(c[0]));
      drawHead(); drawChooser();
    }
    document.getElementById("trial-total").textContent = `${data.total} trial${data.total === 1 ? "" : "s"}`;
    body.style.height = (state.total * ROW_H) + "px";
    drawExport(); draw();
  }
  function cell(t, key) {
    const p = t.parameters || {};
    if (key.startsWith("param:")) return esc(shownValue(p[key.slice(6)]));
    if (key.startsWith("result:")) return resultShown(t, key.slice(7));
    switch (key) {
      case "sequence": return esc(t.sequence_id);
      case "id": return `<a href="#/trial/${encodeURIComponent(t.id)}">${esc(t.id)}</a>`;
      case "status": return status(t.status);
      case "metric": return num(t.final_metric);
      case "latest": return latestShown(t);
      case "duration": return dur(t.duration_s);
      case "started": return `<span title="${esc(when(t.started_at))}">${esc(stamp(t.started_at))}</span>`;
      case "ended": return `<span title="${esc(when(t.ended_at))}">${esc(stamp(t.ended_at))}</span>`;
      case "environment": return esc(t.environment_id || "");
    }
    return "";
  }
  function draw() {
    const first = Math.max(0, Math.floor(box.scrollTop / ROW_H) - 5);
    const last = Math.min(state.total, first + Math.ceil(box.clientHeight / ROW_H) + 10);
    const rows = [];
    for (let i = first; i < last; i++) {
      const page = Math.floor(i / TABLE_PAGE), rows_ = state.pages.get(page);
      if (!rows_) { if (!state.pages.has(page)) { state.pages.set(page, null); load(page, state.version).catch(e => toast(e.message)); } continue; }
      const t = rows_[i - page * TABLE_PAGE];
      if (!t) continue;
      const picked = state.selected.has(t.id) ? "checked" : "";
      rows.push(`<div class="row${picked ? " picked" : ""}" data-id="${esc(t.id)}" style="top:${i * ROW_H}px;grid-template-columns:${template()}">`
        + `<div class="select"><input type="checkbox" data-select="${esc(t.id)}" aria-label="select ${esc(t.id)}" ${picked}></div>`
        + state.columns.map(c => `<div>${cell(t, c[0])}</div>`).join("") + "</div>");
    }
    body.innerHTML = rows.join("");
  }
  function reset() {
    state.version++; state.pages = new Map();
    if (state.columns.length) drawHead(); // the sorted column's mark
    const q = new URLSearchParams();
    for (const k of ["status", "environment", "q", "sort", "order"]) if (state[k]) q.set(k, state[k]);
    history.replaceState(null, "", "#/trials?" + q);
    box.scrollTop = 0;
    return load(0, state.version);
  }
  async function refresh() {
    // Live: reload the pages in view, keeping the scroll position.
    const version = ++state.version;
    const first = Math.floor(box.scrollTop / ROW_H / TABLE_PAGE);
    const keep = [first, first + 1].filter(p => p * TABLE_PAGE < Math.max(state.total, 1));
    state.pages = new Map();
    await Promise.all(keep.map(p => load(p, version)));
  }
  drawSelection();
  reset().then(drawn, e => toast(e.message));
  return {name: "trials", refresh, dispose: () => { state.gone = true; }};
}
