// llama-fleet dashboard: polls api/status every second, keeps the last few minutes of samples and
// draws them as SVG polylines. No framework, no build step.
"use strict";
const POLL_MS = 1000, JOBS_EVERY = 3, KEEP = 180;  // samples kept: 3 minutes at 1/s
const COLORS = ["#4fc3f7", "#ffb74d", "#81c784", "#e57373", "#ba68c8", "#fff176", "#4db6ac", "#f06292"];
const series = { toks: new Map(), depth: new Map() };  // name -> [[t, value], ...]
let jobKind = "recent", tick = 0, openJob = null;

const $ = (sel) => document.querySelector(sel);
const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
  '"': "&quot;", "'": "&#39;"}[c]));
const num = (v, d = 0) => (v === null || v === undefined || v === "") ? "-" :
  Number(v).toLocaleString(undefined, {minimumFractionDigits: d, maximumFractionDigits: d});
function dur(s) {
  if (s === null || s === undefined) return "-";
  s = Math.max(0, s);
  if (s < 60) return s < 10 ? s.toFixed(1) + "s" : Math.round(s) + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0");
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0");
  return Math.floor(s / 86400) + "d" + Math.floor(s % 86400 / 3600) + "h";
}
const ms = (v) => v === null || v === undefined ? "-" : num(v) + " ms";

function push(kind, name, t, v) {
  if (!series[kind].has(name)) series[kind].set(name, []);
  const pts = series[kind].get(name);
  pts.push([t, v]);
  while (pts.length > KEEP) pts.shift();
}

function draw(svgId, legendId, kind) {
  const svg = $("#" + svgId), W = 600, H = 160, PAD = 18;
  const all = [...series[kind].entries()];
  let tMin = Infinity, tMax = -Infinity, vMax = 0;
  for (const [, pts] of all) for (const [t, v] of pts) {
    tMin = Math.min(tMin, t); tMax = Math.max(tMax, t); vMax = Math.max(vMax, v);
  }
  const top = vMax > 0 ? niceCeil(vMax) : 1, span = Math.max(tMax - tMin, 1);
  let out = "";
  for (let i = 0; i <= 4; i++) {
    const y = PAD + (H - 2 * PAD) * i / 4;
    out += `<line class="grid" x1="0" x2="${W}" y1="${y}" y2="${y}"/>`;
    out += `<text x="2" y="${y - 2}">${num(top * (4 - i) / 4, top < 4 ? 1 : 0)}</text>`;
  }
  let legend = "";
  all.forEach(([name, pts], i) => {
    const color = COLORS[i % COLORS.length];
    const points = pts.map(([t, v]) =>
      `${((t - tMin) / span * W).toFixed(1)},${(H - PAD - v / top * (H - 2 * PAD)).toFixed(1)}`).join(" ");
    out += `<polyline data-series="${esc(name)}" stroke="${color}" points="${points}"/>`;
    legend += `<i style="background:${color}"></i>${esc(name)}`;
  });
  svg.innerHTML = out;
  svg.dataset.max = String(vMax);
  svg.dataset.samples = String(Math.max(0, ...all.map(([, p]) => p.length)));
  $("#" + legendId).innerHTML = legend;
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function renderTotals(s) {
  const t = s.totals, j = t.jobs;
  const cells = [["workers", t.workers], ["slots busy", `${t.busy}/${t.slots}`], ["tok/s", num(t.tok_s, 1)],
    ["prefill tok/s", num(t.tok_s_prefill)], ["queued", t.queued], ["running", t.running],
    ["failed 1h", t.failed_1h], ["tokens generated", num(t.tokens_generated)],
    ["prompt tokens cached", `${num(t.cached_tokens)} / ${num(t.prompt_tokens)}`],
    ["jobs ok / failed", `${num(j.finished)} / ${num(j.failed)}`]];
  $("#totals").innerHTML = cells.map(([k, v]) => `<div><b>${esc(v)}</b><span>${esc(k)}</span></div>`).join("");
}

function bar(done, total) {
  if (!total) return `${num(done)} tok`;
  const pct = Math.min(100, Math.round(100 * done / total));
  return `<span class="bar"><i style="width:${pct}%"></i></span>${num(done)}/${num(total)}`;
}

function renderWorkers(s) {
  const rows = s.workers.map((w) => {
    const jobs = (w.jobs || []).map((jb) => `<div>${esc(jb.id.slice(0, 8))} ${bar(jb.tokens, jb.max_tokens)}</div>`)
      .join("");
    const health = w.backend_health || "ok";
    const node = w.numa_node === "" || w.numa_node === null || w.numa_node === undefined ? "" : "/n" + esc(w.numa_node);
    // a catalogue worker's loaded models, each with its RAM
    const models = ((w.backend_stats || {}).models || [])
      .map((m) => `<div class="model">${esc(m.name)} ${num(m.memory_mb)}M</div>`).join("");
    return `<tr data-worker="${esc(w.name)}"><td>${esc(w.name)}</td><td class="${esc(w.state)}">${esc(w.state)}</td>` +
      `<td class="num">${esc(w.inflight)}/${esc(w.slots)}</td><td class="num">${num(w.tok_s, 1)}</td>` +
      `<td class="num">${num(w.tok_s_prefill)}</td><td class="num">${num(w.cpu_pct)}</td>` +
      `<td class="num">${num(w.rss_mb)}M</td><td>${esc(w.cpus || "all")}${node}</td>` +
      `<td>${esc(w.backend)} <span class="${esc(health)}">${esc(health)}</span>${models}</td>` +
      `<td class="num">${dur(s.at - (w.started_at || s.at))}</td><td>${jobs}</td></tr>`;
  });
  $("#workers tbody").innerHTML = rows.join("") || `<tr><td colspan="11">no live workers</td></tr>`;
}

function renderQueues(s) {
  $("#queues tbody").innerHTML = s.queues.map((q) =>
    `<tr><td>${esc(q.queue)}</td><td class="num">${num(q.depth)}</td><td class="num">${dur(q.oldest_age_s)}</td>` +
    `<td class="num">${num(q.running)}</td><td class="num ${q.failed_1h ? "failed" : ""}">${num(q.failed_1h)}</td>` +
    `<td class="num">${num(q.finished)}</td><td class="num">${num(q.failed)}</td></tr>`).join("");
}

function renderTenants(usage) {
  $("#tenants tbody").innerHTML = Object.entries(usage).map(([t, c]) => {
    const refused = Object.entries(c).filter(([k, v]) => k.startsWith("rejected_") && v)
      .map(([k, v]) => `${num(v)} ${k.slice(9)}`).join(", ");
    return `<tr data-tenant="${esc(t)}"><td>${esc(t)}</td><td class="num">${num(c.requests)}</td>` +
      `<td class="num">${num(c.prompt_tokens)}</td><td class="num">${num(c.cached_tokens)}</td>` +
      `<td class="num">${num(c.completion_tokens)}</td>` +
      `<td class="num ${c.failed ? "failed" : ""}">${num(c.failed)}</td><td>${esc(refused || "-")}</td></tr>`;
  }).join("");
}

function renderJobs(list) {
  const now = Date.now() / 1000;
  $("#jobs tbody").innerHTML = list.map((r) => {
    const end = r.end || {}, t = end.timings || {}, a = (r.attempts || []).slice(-1)[0] || {};
    const p = r.params || {};
    const what = end.error || p.prompt || p.last_message || "";
    const total = t.total_ms !== undefined && t.total_ms !== null ? ms(t.total_ms) :
      (r.enqueued_at ? dur(now - r.enqueued_at) : "-");
    return `<tr class="clickable" data-job="${esc(r.id)}"><td>${esc(r.id.slice(0, 12))}</td>` +
      `<td class="${esc(r.state)}">${esc(r.state)}</td><td>${esc(end.worker || a.worker || "-")}</td>` +
      `<td class="num">${esc(end.attempt || a.attempt || "-")}</td><td class="num">${ms(t.ttft_ms)}</td>` +
      `<td class="num">${total}</td><td class="wrap">${esc(what)}</td></tr>`;
  }).join("") || `<tr><td colspan="7">none</td></tr>`;
}

function renderDetail(r) {
  const box = $("#job-detail"), end = r.end || {}, t = end.timings || {}, u = end.usage || {};
  const rows = [["job", r.id], ["state", r.state], ["queue", r.queue]];
  for (const [k, v] of Object.entries(r.params || {})) rows.push([k, typeof v === "object" ? JSON.stringify(v) : v]);
  if (r.end) {
    rows.push(["worker", `${end.worker} (${end.backend || "?"})`],
      ["timings", `queue ${ms(t.queue_ms)} · ttft ${ms(t.ttft_ms)} · ${num(t.tokens_per_s, 1)} tok/s · total ${ms(t.total_ms)}`]);
    if (u.prompt_tokens !== undefined) rows.push(["tokens", `${u.prompt_tokens} prompt (${u.cached_tokens || 0} cached), ${u.completion_tokens} generated (${end.finish_reason})`]);
    if (end.error) rows.push(["error", end.error]);
  }
  for (const a of r.attempts || []) {
    const lost = a.lost ? ` — lost: ${a.lost.reason}` : "";
    rows.push([`attempt ${a.attempt}`, `${a.worker || "?"} (${a.backend || "?"})${lost}`]);
  }
  box.innerHTML = `<dl>${rows.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("")}</dl>`;
  box.hidden = false;
}

// The gateway's API key, if it has keys: typed in once per tab, kept in sessionStorage (gone with
// the tab) and sent on every request of the page.
const KEY_ITEM = "llama-fleet-dashboard-key";
function authHeaders() {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? {Authorization: "Bearer " + key} : {};
}
$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("#key").value.trim();
  if (key) sessionStorage.setItem(KEY_ITEM, key); else sessionStorage.removeItem(KEY_ITEM);
  $("#key").value = "";
  $("#key").placeholder = key ? "API key set for this tab" : "API key (if the gateway has keys)";
});
if (sessionStorage.getItem(KEY_ITEM)) $("#key").placeholder = "API key set for this tab";

async function getJSON(path) {
  const res = await fetch(path, {cache: "no-store", headers: authHeaders()});
  if (res.status === 401) throw new Error("this gateway needs an API key: type it in above");
  if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
  return res.json();
}

async function pollJobs() {
  renderJobs(await getJSON(`api/jobs?kind=${jobKind}&limit=50`));
  renderTenants(await getJSON("api/usage"));
  if (openJob) renderDetail(await getJSON(`api/job/${encodeURIComponent(openJob)}`));
}

async function poll() {
  try {
    const s = await getJSON("api/status");
    const t = s.at;
    push("toks", "total", t, s.totals.tok_s);
    for (const w of s.workers) push("toks", w.name, t, w.tok_s || 0);
    for (const q of s.queues) push("depth", q.priority, t, q.depth);
    draw("chart-toks", "legend-toks", "toks");
    draw("chart-depth", "legend-depth", "depth");
    renderTotals(s); renderWorkers(s); renderQueues(s);
    if (tick++ % JOBS_EVERY === 0) await pollJobs();
    $("#conn").textContent = "live · " + new Date(t * 1000).toLocaleTimeString();
    $("#conn").className = "conn";
  } catch (e) {
    $("#conn").textContent = "disconnected: " + e.message;
    $("#conn").className = "conn bad";
  }
  setTimeout(poll, POLL_MS);
}

document.querySelectorAll(".tabs button").forEach((b) => b.addEventListener("click", () => {
  document.querySelectorAll(".tabs button").forEach((x) => x.classList.toggle("on", x === b));
  jobKind = b.dataset.kind;
  pollJobs().catch(() => {});
}));
$("#jobs").addEventListener("click", (ev) => {
  const row = ev.target.closest("tr[data-job]");
  if (!row) return;
  openJob = openJob === row.dataset.job ? null : row.dataset.job;
  if (openJob) getJSON(`api/job/${encodeURIComponent(openJob)}`).then(renderDetail).catch(() => {});
  else $("#job-detail").hidden = true;
});
poll();
