// meshd dashboard: polls the node's status JSON (/meshd/status) and renders it.
// No third-party code, no inline script (the page's CSP forbids both). Peer
// data comes from signed DHT records of other nodes: it is written with
// textContent only, never as HTML.
"use strict";

const POLL_MS = 1000;   // a gone node shows within a second of the daemon noticing
let apiKey = sessionStorage.getItem("meshd-api-key") || "";
const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");  // #key=... never reaches the server
if (fromHash) { apiKey = fromHash; sessionStorage.setItem("meshd-api-key", apiKey); history.replaceState(null, "", location.pathname); }

const $ = (id) => document.getElementById(id);
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k.startsWith("data-")) node.setAttribute(k, v); else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
const short = (id) => (id || "").length > 14 ? "…" + id.slice(-10) : (id || "");
function size(bytes) {
  if (bytes == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0, v = Number(bytes);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return v.toFixed(v >= 10 || i === 0 ? 0 : 1) + " " + units[i];
}
const num = (v, unit = "") => v == null ? "–" : String(v) + unit;

const gone = (status) => new Set(status.gone || []);

function renderCoverage(status) {
  const table = $("coverage"); table.replaceChildren();
  const n = (status.model && status.model.num_layers) || 0;
  const peers = status.peers || [], dead = gone(status);
  const counts = new Array(n).fill(0);
  for (const p of peers) if (!dead.has(p.peer_id)) for (let l = p.start; l < p.end && l < n; l++) counts[l]++;
  const head = el("tr", {}, el("th", {}, "peer [layers)"));
  for (let l = 0; l < n; l++) head.append(el("th", { class: "layer" }, l));
  table.append(el("thead", {}, head));
  const body = el("tbody");
  for (const p of peers) {
    const isGone = dead.has(p.peer_id);
    const row = el("tr", { class: "peer" + (p.self ? " self" : "") + (isGone ? " gone" : ""), "data-peer": p.peer_id,
                           "data-range": `${p.start}:${p.end}`, "data-state": p.live.state },
      el("td", { class: "label", title: p.peer_id }, `${short(p.peer_id)} [${p.start}:${p.end})${p.self ? " (this node)" : ""}${isGone ? " — gone" : ""}`));
    for (let l = 0; l < n; l++) row.append(el("td", { class: "cell" + (l >= p.start && l < p.end ? " on" : "") + (counts[l] ? "" : " gapcol") }));
    body.append(row);
  }
  const count = el("tr", { class: "count" }, el("td", { class: "label" }, "peers per layer"));
  for (let l = 0; l < n; l++) count.append(el("td", { class: "cell" + (counts[l] ? "" : " gap"), "data-layer": l }, counts[l]));
  body.append(count);
  table.append(body);
  const gaps = $("gaps"); gaps.replaceChildren();
  let start = null;
  const spans = [];
  for (let l = 0; l <= n; l++) {
    if (l < n && counts[l] === 0) { if (start === null) start = l; }
    else if (start !== null) { spans.push([start, l]); start = null; }
  }
  if (!n) gaps.append(el("li", { class: "ok" }, "no coverage information yet"));
  else if (!spans.length) gaps.append(el("li", { class: "ok", "data-covered": "true" }, `every layer 0:${n} is served`));
  for (const [a, b] of spans) gaps.append(el("li", { class: "gap", "data-gap": `${a}:${b}` }, `gap: layers ${a}:${b} are served by no live peer`));
  const sf = status.shortfall;   // meshd/swarm/view.py pool_status: the tracker moves ranges, or the pool is short
  if (sf && sf.message) {
    gaps.append(el("li", { class: "shortfall", id: "shortfall", "data-short": sf.short ? "true" : "false",
                           "data-need": sf.need_bytes ?? "", "data-node-memory": sf.node_memory_bytes ?? "" },
      sf.short ? `memory shortfall: ${sf.message}` : sf.message));
  }
}

function hops(route, dead) {
  const span = el("span", { class: "label" });
  (route || []).forEach((h, i) => {
    const [peer, a, b] = h.split(":");
    const isDead = dead.has(peer);
    if (i) span.append(" → ");
    span.append(el("span", { class: "hop" + (isDead ? " dead" : ""), "data-peer": peer, ...(isDead ? { "data-dead": "true" } : {}) },
      `${short(peer)}[${a}:${b})${isDead ? " ✕ gone" : ""}`));
  });
  if (!(route || []).length) span.append("–");
  return span;
}

function renderRoutes(gen, status) {
  const dead = gone(status);
  $("gen-summary").textContent = `${gen.running} running (of ${gen.max_running}), ${gen.deferred} waiting`;
  for (const [id, rows, state] of [["live-routes", gen.live, "running"], ["done-routes", gen.recent, "done"]]) {
    const body = $(id).tBodies[0]; body.replaceChildren();
    if (!rows.length) body.append(el("tr", {}, el("td", { colSpan: 6 }, state === "running" ? "none running" : "none yet")));
    for (const g of rows) {
      body.append(el("tr", { class: "route " + state, "data-route": (g.route || []).join(" ") },
        el("td", {}, g.edge), el("td", {}, hops(g.route, dead)), el("td", {}, g.tokens),
        el("td", {}, num(g.decode_tokens_per_s)), el("td", {}, g.ttft_s == null ? "–" : g.ttft_s + " s"),
        el("td", {}, (g.finish_reason || (state === "running" ? "…" : "–")) + (g.failovers ? ` (${g.failovers} failover)` : ""))));
    }
  }
}

function bar(value, max, label) {
  const wrap = el("span", { class: "bar" });
  if (value == null || !max) { wrap.append("–"); return wrap; }
  wrap.append(el("meter", { min: 0, max: max, value: Math.min(value, max) }), " " + label);
  return wrap;
}

function spark(history) {
  const NS = "http://www.w3.org/2000/svg", w = 120, h = 24;
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("class", "spark"); svg.setAttribute("width", w); svg.setAttribute("height", h);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`); svg.setAttribute("data-points", history.length);
  const top = Math.max(1, ...history.map((p) => p[1]));
  const pts = history.map((p, i) => `${history.length > 1 ? (i * w) / (history.length - 1) : 0},${h - 1 - (p[1] / top) * (h - 2)}`).join(" ");
  const line = document.createElementNS(NS, "polyline");
  line.setAttribute("points", pts || `0,${h - 1} ${w},${h - 1}`); line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#2d6cdf"); line.setAttribute("stroke-width", "1.5");
  svg.append(line);
  const title = document.createElementNS(NS, "title");
  title.textContent = history.length ? `decode tokens/s, one point per 5 s; peak ${top}` : "no steps yet";
  svg.append(title);
  return svg;
}

function renderNodes(status) {
  const body = $("nodes").tBodies[0]; body.replaceChildren();
  const dead = gone(status);
  for (const p of status.peers || []) {
    const reach = p.relayed ? "relayed via " + (p.relays.map(short).join(", ") || "?") : (p.endpoint || "direct");
    const state = dead.has(p.peer_id) ? "gone" : p.live.state;
    const since = p.live.since_ms ? ` since ${new Date(p.live.since_ms).toLocaleTimeString()}` : "";
    const kvUsed = p.kv_tokens_used, kvMax = p.kv_budget_tokens;
    const recent = p.recent || {}, val = p.validation || {};
    body.append(el("tr", { class: "node " + state, "data-peer": p.peer_id, "data-state": state,
                           "data-rss": p.rss_bytes == null ? "" : p.rss_bytes, "data-since": p.live.since_ms || "" },
      el("td", { class: "label", title: p.peer_id }, short(p.peer_id) + (p.self ? " (this node)" : "")),
      el("td", { class: "state " + state }, state + since),
      el("td", {}, `${p.start}:${p.end}`),
      el("td", {}, p.cpu_cores ? `${p.cpu_cores} cores, ${size(p.machine_memory_bytes)}` : "–"),
      el("td", { class: "memory" }, bar(p.rss_bytes, p.machine_memory_bytes, `${size(p.rss_bytes)} worker RSS` +
        (p.memory_budget_bytes ? ` of ${size(p.memory_budget_bytes)} budget` : " (fixed range: no budget)"))),
      el("td", {}, bar(kvUsed, kvMax, kvMax ? `${kvUsed} / ${kvMax} tokens` : "")),
      el("td", {}, recent.decode_tokens_per_s != null ? `${recent.decode_tokens_per_s} tok/s (recent steps)` :
        `${num(val.decode_tokens_per_s)} tok/s (startup validation)`),
      el("td", {}, recent.prefill_tokens_per_s != null ? `${recent.prefill_tokens_per_s} tok/s (recent chunks)` :
        `${num(val.prefill_tokens_per_s)} tok/s (startup validation)`),
      el("td", {}, spark(p.live.history || [])),
      el("td", {}, reach), el("td", {}, num(p.expires_in_s, " s"))));
  }
}

function renderSelf(status) {
  const dl = $("self"); dl.replaceChildren();
  const n = status.node || {}, w = n.worker || {}, h = w.health || {}, r = n.reachability || {}, t = status.throughput || {};
  const facts = [
    ["peer id", status.peer_id], ["layers", n.layers ? n.layers.join(":") : "none yet"],
    ["worker", `${w.state || "none"}${w.restarts ? `, ${w.restarts} restarts` : ""}`],
    ["KV", h.kv_budget_tokens ? `${h.kv_tokens_used} of ${h.kv_budget_tokens} tokens (${Math.round((h.kv_pressure || 0) * 100)}%), ${h.active_sessions || 0} sessions` : "–"],
    ["worker memory", size(h.resident_bytes)],
    ["throughput", `${num(t.predicted_tokens_per_s)} tok/s generated, ${num(t.prompt_tokens_per_s)} tok/s prompt (averages over this entry's generations), ${t.tokens_predicted_total || 0} tokens so far`],
    ["reachability", `${r.verdict || "?"} (mode ${r.mode || "?"})`],
    ["relayed addresses", (r.relayed_addrs || []).join(" ") || "none"],
    ["relays known", (r.relays_known || []).map(short).join(", ") || "none"],
    ["connected peers", n.connected_peers], ["tracker", status.tracker ? short(status.tracker) + (status.on_duty ? " (this node)" : "") : "none"],
  ];
  for (const [k, v] of facts) dl.append(el("dt", {}, k), el("dd", {}, v == null ? "–" : v));
}

function render(status) {
  const m = status.model || {};
  $("model").textContent = m.id || "(no model)";
  const cov = m.coverage;
  const live = (status.peers || []).filter((p) => !gone(status).has(p.peer_id)).length;
  $("summary").textContent = cov ? (cov.fully_covered ? `all ${m.num_layers} layers covered by ${live} live peers` :
    `${cov.gaps.length} gap(s) in ${m.num_layers} layers`) : "waiting for the swarm view";
  renderCoverage(status); renderRoutes(status.generations, status); renderNodes(status); renderSelf(status);
  $("updated").textContent = "updated " + new Date(status.time_ms).toLocaleTimeString();
  document.body.dataset.state = "loaded";
}

async function poll() {
  try {
    const res = await fetch("/meshd/status", { headers: apiKey ? { Authorization: "Bearer " + apiKey } : {}, cache: "no-store" });
    if (res.status === 401) { $("keyform").hidden = false; $("error").hidden = false; $("error").textContent = "this node needs its API key"; document.body.dataset.state = "needs-key"; return; }
    if (!res.ok) throw new Error(`status ${res.status}`);
    $("error").hidden = true; $("keyform").hidden = true;
    render(await res.json());
  } catch (err) {
    $("error").hidden = false; $("error").textContent = "cannot reach the node: " + err.message;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("keyform").addEventListener("submit", (e) => {
  e.preventDefault(); apiKey = $("key").value.trim(); sessionStorage.setItem("meshd-api-key", apiKey);
});
poll();
