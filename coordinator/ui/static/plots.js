// The comparison page: intermediate curves of chosen trials (coloured by status or by final
// metric, filtered by status), each parameter against the metric on the axis its search space
// gives it (categories for a choice, log for the log types), parallel coordinates, parameter
// importance, a contour of two parameters, the final metric's distribution and, for several
// objectives, the Pareto front. Uses app.js's helpers (api, chart, esc, num, ...).
"use strict";

const STATUS_COLOURS = {SUCCEEDED: "#1e9e5a", FAILED: "#d0443b", EARLY_STOPPED: "#e08a1e", RUNNING: "#2f6fde",
  WAITING: "#c48a0e", PAUSED: "#7b4fc9", USER_CANCELED: "#8a8f99", SYS_CANCELED: "#b06060"};
const RAMP = ["#d0443b", "#f0c040", "#1e9e5a"]; // worst to best
const CONTOUR_BINS = 10;

// A parameter's value on its axis: a category's name (the server's, matched by value), else the number.
function onAxis(axis, v) {
  if (v === undefined || v === null) return null;
  if (axis.kind === "category") {
    const key = JSON.stringify(v);
    const i = axis.options.findIndex(o => JSON.stringify(o) === key);
    return i >= 0 ? axis.categories[i] : (typeof v === "string" ? v : key);
  }
  return typeof v === "number" ? v : null;
}
function axisType(axis, logParams) {
  return axis.kind === "category" ? "category" : axis.kind === "log" && logParams ? "log" : "value";
}
function axisName(axis, logParams) { return axis.name + (axis.kind === "log" && logParams ? " (log)" : ""); }
// A colour from worst (red) to best (green) for a metric between lo and hi.
function rampColour(v, lo, hi, maximize) {
  if (v === null || v === undefined || !(hi > lo)) return v === null || v === undefined ? "#9aa0aa" : RAMP[2];
  let f = (v - lo) / (hi - lo);
  if (!maximize) f = 1 - f;
  const mix = (a, b, t) => {
    const pa = [1, 3, 5].map(i => parseInt(a.slice(i, i + 2), 16)), pb = [1, 3, 5].map(i => parseInt(b.slice(i, i + 2), 16));
    return "#" + pa.map((x, i) => Math.round(x + (pb[i] - x) * t).toString(16).padStart(2, "0")).join("");
  };
  return f < 0.5 ? mix(RAMP[0], RAMP[1], f * 2) : mix(RAMP[1], RAMP[2], (f - 0.5) * 2);
}
function titled(text, extra) { return Object.assign({text, left: 10, top: 6, textStyle: {fontSize: 13}}, extra || {}); }

function comparePage(params) {
  const ids = (params.get("ids") || "").split(",").filter(Boolean);
  main.innerHTML = `<h1>Comparison</h1>
    <div id="compare-note" class="muted"></div>
    <div class="toolbar" style="margin-top:8px">
      <label>colour by <select id="colour-by"><option value="status">status</option><option value="metric">final metric</option></select></label>
      <label>status <select id="curve-status"><option value="">every status</option>${STATUSES.map(s => `<option value="${s}">${s}</option>`).join("")}</select></label>
      <label><input type="checkbox" id="log-params" checked> log axes for log-distributed parameters</label>
      <label><input type="checkbox" id="log-metric"> log scale for the metric</label>
      <span id="selection-note" class="muted"></span></div>
    <div class="chart" id="curves-chart" style="height:340px"></div><div id="metric-scale" class="scale" hidden></div>
    <h2 id="slice-title">Each parameter against the final metric</h2><div class="grid3" id="slice-grid"></div>
    <div class="grid2" style="margin-top:14px"><div class="chart" id="parallel-chart"></div>
      <div><div class="chart" id="importance-chart"></div><div id="importance-note" class="muted"></div></div></div>
    <div class="toolbar" style="margin-top:14px"><label>contour of <select id="contour-x" aria-label="contour x"></select></label>
      <label>and <select id="contour-y" aria-label="contour y"></select></label></div>
    <div class="grid2"><div class="chart" id="contour-chart"></div><div class="chart" id="edf-chart"></div></div>
    <div class="chart" id="pareto-chart" style="margin-top:14px" hidden></div>`;
  const curves = chart(document.getElementById("curves-chart"), {animation: false});
  const parallel = chart(document.getElementById("parallel-chart"), {animation: false});
  const importance = chart(document.getElementById("importance-chart"), {animation: false});
  const contour = chart(document.getElementById("contour-chart"), {animation: false});
  const edf = chart(document.getElementById("edf-chart"), {animation: false});
  let pareto = null, slices = [], sliceKey = "", data = null, gone = false; // gone: the page was left
  curves.on("click", p => { if (p.seriesId) location.hash = "#/trial/" + encodeURIComponent(p.seriesId); });
  const control = id => document.getElementById(id);
  for (const id of ["colour-by", "curve-status", "log-params", "log-metric", "contour-x", "contour-y"]) control(id).addEventListener("change", draw);

  const logParams = () => control("log-params").checked;
  function metricAxis(values, name) {
    const log = control("log-metric").checked && values.length && values.every(v => v > 0);
    return {type: log ? "log" : "value", scale: true, name, nameLocation: "middle", nameGap: 46};
  }
  function shownTrials() {
    const s = control("curve-status").value;
    return data.trials.filter(t => !s || t.status === s);
  }

  function drawCurves() {
    const byMetric = control("colour-by").value === "metric", s = control("curve-status").value;
    const shown = data.curves.filter(c => !s || c.status === s);
    const finals = shown.map(c => c.final_metric).filter(v => v !== null);
    const lo = Math.min(...finals), hi = Math.max(...finals), maximize = data.optimize_mode === "maximize";
    const series = shown.map(c => {
      const colour = byMetric ? rampColour(c.final_metric, lo, hi, maximize) : STATUS_COLOURS[c.status] || "#9aa0aa";
      const stopped = c.status === "EARLY_STOPPED";
      return {type: "line", id: c.id, name: byMetric ? c.id : (c.status || "UNREADABLE"), showSymbol: false, color: colour,
        lineStyle: {color: colour, width: 1.5, type: stopped ? "dashed" : "solid"}, itemStyle: {color: colour},
        data: c.values.map((v, i) => [i, v]),
        // An early-stopped trial's last result, marked where its curve ends.
        markPoint: stopped ? {symbol: "triangle", symbolSize: 9, label: {show: false}, itemStyle: {color: colour},
          data: [{coord: [c.values.length - 1, c.values[c.values.length - 1]], name: "stopped early"}]} : undefined};
    });
    const statuses = [...new Set(shown.map(c => c.status || "UNREADABLE"))];
    const all = shown.flatMap(c => c.values);
    curves.setOption({
      title: titled(data.curves_title + (s ? ` \u2014 ${s} only` : ""),
        {subtext: "x: report number; dashed, \u25B2 at the end: stopped early", subtextStyle: {fontSize: 11}}),
      grid: {left: 70, right: 24, top: 64, bottom: 46},
      legend: byMetric ? {show: false} : {show: true, top: 6, right: 10, data: statuses},
      tooltip: {trigger: "item", formatter: p => `${esc(p.seriesId)} (${esc((data.curves.find(c => c.id === p.seriesId) || {}).status)}): report ${esc(p.value ? p.value[0] : "")}, ${num(p.value ? p.value[1] : null)}`},
      xAxis: {type: "value", name: "report", nameLocation: "middle", nameGap: 26, minInterval: 1, min: 0},
      yAxis: metricAxis(all, "intermediate result"),
      series,
    }, {replaceMerge: ["series", "legend"]});
    const scale = control("metric-scale");
    scale.hidden = !byMetric || !finals.length;
    if (byMetric && finals.length) {
      const [worst, best] = maximize ? [lo, hi] : [hi, lo];
      scale.innerHTML = `final metric: <span class="ramp"></span> ${esc(num(worst))} (worst) \u2192 ${esc(num(best))} (best); grey: none yet`;
    }
  }

  function drawSlices() {
    const grid = control("slice-grid"), key = data.axes.map(a => a.name).join("\n");
    if (key !== sliceKey) { // one chart per parameter, made again only when the parameters change
      slices.forEach(c => { c.dispose(); charts = charts.filter(x => x !== c); });
      grid.innerHTML = data.axes.map((a, i) => `<div class="chart small" id="slice-${i}" data-parameter="${esc(a.name)}"></div>`).join("");
      slices = data.axes.map((a, i) => chart(document.getElementById(`slice-${i}`), {animation: false}));
      slices.forEach(c => c.on("click", p => { if (p.value && p.value[2]) location.hash = "#/trial/" + encodeURIComponent(p.value[2]); }));
      sliceKey = key;
    }
    const trials = shownTrials();
    const values = trials.map(t => t.value).filter(v => v !== null);
    control("slice-title").textContent = `Each parameter against the final metric (${trials.length} trials${data.sampled ? ", spread evenly over all" : ""}; \u25B2 stopped early: its last intermediate result)`;
    data.axes.forEach((a, i) => {
      const points = trials.filter(t => t.value !== null && onAxis(a, t.parameters[a.name]) !== null)
        .map(t => [onAxis(a, t.parameters[a.name]), t.value, t.id, t.stopped]);
      slices[i].setOption({
        title: titled(`${a.name} (${a.source}) against the metric`),
        grid: {left: 64, right: 16, top: 36, bottom: 44}, tooltip: {trigger: "item",
          formatter: p => `${esc(p.value[2])}: ${esc(a.name)} = ${esc(num(p.value[0]))}, ${p.value[3] ? "last intermediate" : "final"} ${num(p.value[1])}`},
        xAxis: Object.assign({type: axisType(a, logParams()), name: axisName(a, logParams()), nameLocation: "middle", nameGap: 26},
          a.kind === "category" ? {data: [...a.categories]} : {scale: true, minInterval: a.integer ? 1 : undefined}),
        yAxis: Object.assign(metricAxis(values, "metric"), {nameGap: 42}),
        series: [
          {type: "scatter", name: "final metric", symbolSize: 6, data: points.filter(p => !p[3]), itemStyle: {opacity: 0.7}},
          {type: "scatter", name: "stopped early", symbol: "triangle", symbolSize: 8, data: points.filter(p => p[3]), itemStyle: {color: STATUS_COLOURS.EARLY_STOPPED}},
        ],
      }, {replaceMerge: ["xAxis", "yAxis", "series"]});
    });
  }

  function drawParallel() {
    const trials = shownTrials().filter(t => t.value !== null);
    const dims = data.axes.map((a, i) => Object.assign({dim: i, name: axisName(a, logParams()), type: axisType(a, logParams())},
      a.kind === "category" ? {data: [...a.categories]} : {scale: true}));
    dims.push({dim: dims.length, name: "metric", scale: true});
    const rows = trials.map(t => ({value: [...data.axes.map(a => onAxis(a, t.parameters[a.name])), t.value],
      lineStyle: t.stopped ? {type: "dashed"} : undefined}));
    const metrics = trials.map(t => t.value);
    const maximize = data.optimize_mode === "maximize";
    parallel.setOption({
      title: titled(`Parameters of ${trials.length} trials, coloured by the metric (dashed: stopped early)`),
      parallel: {left: 50, right: 120, top: 60, bottom: 30}, parallelAxis: dims,
      visualMap: metrics.length ? {min: Math.min(...metrics), max: Math.max(...metrics), dimension: dims.length - 1, right: 0, top: 40,
        calculable: true, precision: 3, inRange: {color: maximize ? RAMP : [...RAMP].reverse()}} : undefined,
      series: [{type: "parallel", lineStyle: {width: 1, opacity: 0.5}, data: rows}],
    }, {replaceMerge: ["parallelAxis", "series", "visualMap"]});
  }

  async function drawImportance() {
    const imp = await api("/api/importance");
    if (gone) return;
    const names = imp.importances.map(([n]) => n).reverse(); // the most important at the top
    importance.setOption({
      title: titled(imp.error ? "Parameter importance" : `Parameter importance for the final metric (${imp.evaluator}, ${imp.trials} of ${imp.of} trials)`),
      grid: {left: 110, right: 30, top: 40, bottom: 40}, tooltip: {trigger: "item", formatter: p => `${esc(p.name)}: ${num(p.value)}`},
      xAxis: {type: "value", min: 0, max: 1, name: "importance (all add up to 1)", nameLocation: "middle", nameGap: 26},
      yAxis: {type: "category", data: names},
      series: [{type: "bar", name: "importance", data: imp.importances.map(([, v]) => v).reverse(), itemStyle: {color: "#2f6fde"}}],
    }, {replaceMerge: ["series", "yAxis"]});
    control("importance-chart").dataset.ranked = imp.importances.map(([n]) => n).join(",");
    control("importance-note").textContent = imp.error;
  }

  // Binned in each axis's own space: a category a bin of its own, a log axis in equal ratios.
  function bins(axis, values) {
    if (axis.kind === "category") return {labels: [...axis.categories], index: v => axis.categories.indexOf(v)};
    const nums = values.filter(v => typeof v === "number" && (axis.kind !== "log" || v > 0));
    if (!nums.length) return {labels: [], index: () => -1};
    const lo0 = Math.min(...nums), hi0 = Math.max(...nums);
    if (axis.integer && hi0 - lo0 < 2 * CONTOUR_BINS) { // a bin for each whole number
      return {labels: Array.from({length: hi0 - lo0 + 1}, (_, i) => String(lo0 + i)), index: v => typeof v === "number" ? Math.round(v) - lo0 : -1};
    }
    const log = axis.kind === "log" && logParams();
    const f = log ? Math.log10 : x => x, g = log ? x => 10 ** x : x => x;
    const lo = f(Math.min(...nums)), hi = f(Math.max(...nums)), width = (hi - lo) / CONTOUR_BINS || 1;
    const n = hi > lo ? CONTOUR_BINS : 1;
    return {labels: Array.from({length: n}, (_, i) => num(Number(g(lo + (i + 0.5) * width).toPrecision(3)))),
      index: v => typeof v !== "number" || (log && v <= 0) ? -1 : Math.min(n - 1, Math.floor((f(v) - lo) / width))};
  }
  function drawContour() {
    const xs = control("contour-x"), ys = control("contour-y");
    const names = data.axes.map(a => a.name);
    if (xs.dataset.names !== names.join("\n")) {
      const keepX = xs.value, keepY = ys.value;
      xs.innerHTML = ys.innerHTML = names.map(n => `<option>${esc(n)}</option>`).join("");
      xs.value = names.includes(keepX) ? keepX : names[0] || "";
      ys.value = names.includes(keepY) ? keepY : names[1] || names[0] || "";
      xs.dataset.names = names.join("\n");
    }
    const ax = data.axes.find(a => a.name === xs.value), ay = data.axes.find(a => a.name === ys.value);
    if (!ax || !ay) { contour.setOption({title: titled("Contour: no parameters")}); return; }
    const trials = shownTrials().filter(t => t.value !== null);
    const bx = bins(ax, trials.map(t => onAxis(ax, t.parameters[ax.name]))), by = bins(ay, trials.map(t => onAxis(ay, t.parameters[ay.name])));
    const sums = new Map();
    for (const t of trials) {
      const i = bx.index(onAxis(ax, t.parameters[ax.name])), j = by.index(onAxis(ay, t.parameters[ay.name]));
      if (i < 0 || j < 0) continue;
      const cell = sums.get(i + "," + j) || [0, 0];
      cell[0] += t.value; cell[1] += 1; sums.set(i + "," + j, cell);
    }
    const cells = [...sums].map(([k, [s, n]]) => [...k.split(",").map(Number), s / n, n]);
    const means = cells.map(c => c[2]), maximize = data.optimize_mode === "maximize";
    const scale = (axis, labels, name) => ({type: "category", data: labels, name: axisName(axis, logParams()), nameLocation: "middle", nameGap: name});
    contour.setOption({
      title: titled(`Mean metric by ${ax.name} and ${ay.name} (${trials.length} trials; blank: none tried there)`),
      grid: {left: 96, right: 80, top: 40, bottom: 50}, tooltip: {trigger: "item",
        formatter: p => `${esc(ax.name)} \u2248 ${esc(bx.labels[p.value[0]])}, ${esc(ay.name)} \u2248 ${esc(by.labels[p.value[1]])}: mean ${num(p.value[2])} of ${p.value[3]} trial(s)`},
      xAxis: scale(ax, bx.labels, 28), yAxis: scale(ay, by.labels, 72),
      visualMap: means.length ? {min: Math.min(...means), max: Math.max(...means), dimension: 2, right: 0, top: 40, calculable: true, precision: 3,
        inRange: {color: maximize ? RAMP : [...RAMP].reverse()}} : undefined,
      series: [{type: "heatmap", name: "mean metric", data: cells}],
    }, {replaceMerge: ["xAxis", "yAxis", "series", "visualMap"]});
  }

  function drawEdf() {
    const log = control("log-metric").checked && data.edf.length && data.edf.every(([v]) => v > 0);
    edf.setOption({
      title: titled(`Distribution of the final metric (${data.edf_trials} trials with one)`),
      grid: {left: 60, right: 24, top: 40, bottom: 46}, tooltip: {trigger: "axis"},
      xAxis: {type: log ? "log" : "value", scale: true, name: "final metric", nameLocation: "middle", nameGap: 26},
      yAxis: {type: "value", min: 0, max: 1, name: "fraction of trials at most x", nameLocation: "middle", nameGap: 36},
      series: [{type: "line", step: "end", showSymbol: false, name: "fraction of trials", data: data.edf}],
    }, {replaceMerge: ["series", "xAxis"]});
  }

  function drawPareto() {
    const box = control("pareto-chart"), p = data.pareto;
    box.hidden = !p;
    if (!p) return;
    if (!pareto) pareto = chart(box, {animation: false});
    const [kx, ky] = p.objectives;
    const front = p.points.filter(q => q[3]).sort((a, b) => a[1] - b[1]);
    pareto.setOption({
      title: titled(`Pareto front of ${kx} (${p.maximize[0] ? "max" : "min"}) and ${ky} (${p.maximize[1] ? "max" : "min"})`
        + ` among ${p.trials} trials${p.sampled ? " spread evenly over all" : ""}`
        + (p.all_objectives.length > 2 ? ` (the front of all ${p.all_objectives.length} objectives: ${p.all_objectives.join(", ")})` : "")),
      grid: {left: 70, right: 24, top: 40, bottom: 46}, legend: {top: 6, right: 10},
      tooltip: {trigger: "item", formatter: q => `${esc(q.value[2])}: ${esc(kx)} ${num(q.value[0])}, ${esc(ky)} ${num(q.value[1])}`},
      xAxis: {type: "value", scale: true, name: kx, nameLocation: "middle", nameGap: 26},
      yAxis: {type: "value", scale: true, name: ky},
      series: [
        {type: "scatter", name: "dominated", symbolSize: 5, itemStyle: {color: "#9aa0aa"}, data: p.points.filter(q => !q[3]).map(q => [q[1], q[2], q[0]])},
        {type: "line", name: "on the front", symbolSize: 8, itemStyle: {color: "#d0443b"}, data: front.map(q => [q[1], q[2], q[0]])},
      ],
    }, {replaceMerge: ["series"]});
    box.dataset.front = front.map(q => q[0]).join(",");
  }

  function draw() {
    if (!data) return;
    drawCurves(); drawSlices(); drawParallel(); drawContour(); drawEdf(); drawPareto();
  }
  async function refresh() {
    const answer = await api("/api/compare" + (ids.length ? "?ids=" + encodeURIComponent(ids.join(",")) : ""));
    if (gone) return;
    data = answer;
    control("compare-note").textContent = data.sampled
      ? `The parameter charts draw ${data.trials.length} trials spread evenly over all of them.` : `${data.trials.length} trials.`;
    control("selection-note").innerHTML = ids.length
      ? `${ids.length} selected in the trials table \u2014 <a href="#/compare">show the best and latest instead</a>`
      : `<a href="#/trials">pick trials to compare</a> in the trials table`;
    draw();
    await drawImportance();
  }
  return {name: "compare", refresh, dispose: () => { gone = true; }};
}
