// The experiment's context page (#/context): its config (secrets redacted), search space,
// tuner, assessor and platforms, and, while a coordinator runs it, the actions that steer it:
// new limits, a trial of the user's own parameters, the failed trials run again. Uses app.js's
// helpers (api, esc, num, dur, when, status, toast, token, askToken, main, BASE).
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  if (BASE) document.getElementById("home-link").hidden = false; // a page of the experiments home
});

// An action with a JSON body, the token in its header; resolves to its answer, or null.
async function sendAction(path, body, what) {
  if (!token()) { askToken(); return null; }
  try {
    const answer = await api(path, {method: "POST", body: JSON.stringify(body),
      headers: {"Authorization": "Bearer " + token(), "Content-Type": "application/json"}});
    toast(what(answer));
    return answer;
  } catch (e) { toast(e.message); return null; }
}

// "90", "90s", "30m", "2h", "1d" -> seconds; NaN when it is none of these.
function seconds(text) {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$/.exec(text || "");
  return m ? parseFloat(m[1]) * {"": 1, s: 1, m: 60, h: 3600, d: 86400}[m[2]] : NaN;
}

function jsonText(v) { return esc(typeof v === "object" && v !== null ? JSON.stringify(v) : v); }

function contextPage() {
  main.innerHTML = `<h1 id="ctx-title">Context</h1><div class="cards" id="ctx-cards"></div>
    <div id="ctx-why" class="muted" style="margin-top:10px"></div>
    <div class="grid2" id="ctx-steer" style="margin-top:6px">
      <form id="limits-form" class="panel" autocomplete="off"><h2>Limits</h2>
        <label>trialConcurrency <input id="limit-concurrency" type="number" min="1" step="1"></label>
        <label>maxTrialNumber <input id="limit-max-trials" type="number" min="1" step="1" placeholder="none"></label>
        <label>maxExperimentDuration <input id="limit-duration" placeholder="none (90s, 30m, 2h)"></label>
        <button id="limits-save" type="submit">Update</button></form>
      <form id="submit-form" class="panel" autocomplete="off"><h2>Run a trial of your own parameters</h2>
        <div id="submit-fields"></div><button id="submit-trial" type="submit">Submit trial</button>
        <h2>Failed trials</h2><button id="rerun-failed" type="button">Run every failed trial again</button></form>
    </div>
    <div class="grid2"><div><h2>Search space</h2><table class="plain" id="ctx-space"></table>
      <h2>Tuner, assessor</h2><table class="plain" id="ctx-algorithms"></table>
      <h2>Trials</h2><table class="plain" id="ctx-trial"></table></div>
      <div><h2>Platforms</h2><table class="plain" id="ctx-platforms"></table></div></div>
    <h2>Config <span id="ctx-redacted" class="muted" style="font-weight:400"></span></h2><pre class="log" id="ctx-config"></pre>`;
  let drawnOnce = false, space = [];
  const limits = document.getElementById("limits-form"), submit = document.getElementById("submit-form");

  limits.addEventListener("submit", async ev => {
    ev.preventDefault();
    const asked = {}, concurrency = document.getElementById("limit-concurrency").value,
      trials = document.getElementById("limit-max-trials").value, duration = document.getElementById("limit-duration").value;
    if (concurrency !== "") asked.trialConcurrency = Number(concurrency);
    if (trials !== "") asked.maxTrialNumber = Number(trials);
    if (duration.trim() !== "") {
      asked.maxExperimentDuration = seconds(duration);
      if (!(asked.maxExperimentDuration > 0)) { toast(`maxExperimentDuration: ${duration} is not a duration (90s, 30m, 2h)`); return; }
    }
    if (!Object.keys(asked).length) { toast("nothing to update"); return; }
    if (await sendAction("/api/experiment/update", {limits: asked}, a => "limits updated: " + Object.entries(a.limits)
      .map(([k, v]) => `${k} ${v === null ? "none" : v}`).join(", "))) refresh().catch(() => {});
  });
  submit.addEventListener("submit", async ev => {
    ev.preventDefault();
    const parameters = {};
    for (const p of space) {
      const field = document.getElementById("param-" + p.name), raw = field.value;
      if (p.type === "choice") { parameters[p.name] = (p.values || [])[Number(raw)]; continue; }
      let v;
      try { v = JSON.parse(raw); } catch (e) { v = raw; }
      if (raw.trim() === "") { toast(`${p.name}: a value is needed`); field.focus(); return; }
      parameters[p.name] = v;
    }
    await sendAction("/api/experiment/submit", {parameters}, a => `submitted trial ${a.done.join(" ")}`);
  });
  document.getElementById("rerun-failed").addEventListener("click", async () => {
    if (!confirm("Run every FAILED trial again, each as a new trial with the same parameters?")) return;
    await sendAction("/api/experiment/rerun", {failed: true}, a => a.rerun.map(([o, n]) => `${o} runs again as ${n}`).join("; "));
  });

  function drawFields(c) {
    space = c.search_space;
    document.getElementById("submit-fields").innerHTML = space.length ? space.map(p => `<label>${esc(p.name)} ${
      p.type === "choice"
        ? `<select id="param-${esc(p.name)}">${(p.values || []).map((v, i) => `<option value="${i}">${jsonText(v)}</option>`).join("")}</select>`
        : `<input id="param-${esc(p.name)}" placeholder="${esc(p.type)} ${jsonText(p.values)}">`}</label>`).join("")
      : `<span class="muted">no search space: the trial gets no parameters</span>`;
    const l = c.limits;
    document.getElementById("limit-concurrency").value = l.trialConcurrency ?? "";
    document.getElementById("limit-max-trials").value = l.maxTrialNumber ?? "";
    document.getElementById("limit-duration").value = l.maxExperimentDuration ? l.maxExperimentDuration + "s" : "";
  }
  async function refresh() {
    const c = await api("/api/context");
    document.getElementById("ctx-title").textContent = `Context of experiment ${c.id}${c.name ? " \u2014 " + c.name : ""}`;
    const l = c.limits;
    const cards = [["Status", status(c.status) + (c.reason ? `<div class="muted" style="font-size:12px">${esc(c.reason)}</div>` : "")], ["Started", esc(when(c.started_at))],
      ["Trials submitted", `${c.submitted}${l.maxTrialNumber ? " / " + l.maxTrialNumber : ""}`],
      ["Concurrency", esc(l.trialConcurrency)], ["Max duration", l.maxExperimentDuration ? dur(l.maxExperimentDuration) : "none"],
      ["Optimize", esc(c.optimize_mode)]];
    document.getElementById("ctx-cards").innerHTML = cards.map(([k, v]) =>
      `<div class="card"><div class="label">${esc(k)}</div><div class="value" data-card="${esc(k)}">${v}</div></div>`).join("");
    document.getElementById("ctx-steer").style.display = c.actions ? "" : "none";
    document.getElementById("ctx-why").textContent = c.actions ? "" : c.actions_why;
    if (!drawnOnce) { drawFields(c); drawnOnce = true; } // later refreshes leave what is being typed alone
    document.getElementById("ctx-space").innerHTML = "<tr><th>parameter</th><th>type</th><th>values</th></tr>" + c.search_space.map(p =>
      `<tr data-param="${esc(p.name)}"><td>${esc(p.name)}</td><td>${esc(p.type)}</td><td>${jsonText(p.values)}</td></tr>`).join("");
    document.getElementById("ctx-algorithms").innerHTML = [["tuner", c.tuner], ["assessor", c.assessor], ["advisor", c.advisor]]
      .filter(([, a]) => a).map(([k, a]) => `<tr><th>${k}</th><td id="ctx-${k}">${esc(a.name)}${a.builtin ? "" : " <span class='muted'>(class)</span>"}</td>
        <td>${jsonText(a.class_args)}</td></tr>`).join("") || `<tr><td class="muted">none</td></tr>`;
    document.getElementById("ctx-trial").innerHTML = Object.entries(c.trial).map(([k, v]) =>
      `<tr><th>${esc(k)}</th><td>${jsonText(v)}</td></tr>`).join("")
      + `<tr><th>experiment directory</th><td id="ctx-directory">${esc(c.directory)}</td></tr>`;
    document.getElementById("ctx-platforms").innerHTML = "<tr><th>platform</th><th>settings</th></tr>" + c.platforms.map(p =>
      `<tr><td>${esc(p.platform)}</td><td>${Object.entries(p.settings).map(([k, v]) => `${esc(k)}: ${jsonText(v)}`).join("<br>")}</td></tr>`).join("");
    document.getElementById("ctx-redacted").textContent = c.redacted.length ? `(secrets shown as ***: ${c.redacted.join(", ")})` : "";
    document.getElementById("ctx-config").textContent = JSON.stringify(c.config, null, 2);
  }
  return {name: "context", refresh};
}
