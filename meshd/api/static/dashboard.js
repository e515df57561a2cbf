// meshd dashboard: polls the node's status JSON (/meshd/status) and renders it.
// No third-party code, no inline script (the page's CSP forbids both). Peer
// data comes from signed DHT records of other nodes: it is written with
// textContent only, never as HTML.
"use strict";

const POLL_MS = 2000;
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

function renderCoverage(status) {
  const table = $("coverage"); table.replaceChildren();
  const n = (status.model && status.model.num_layers) || 0;
  const peers = status.peers || [];
  const counts = new Array(n).fill(0);
  for (const p of peers) for (let l = p.start; l < p.end && l < n; l++) counts[l]++;
  const head = el("tr", {}, el("th", {}, "peer [layers)"));
  for (let l = 0; l < n; l++) head.append(el("th", { class: "layer" }, l));
  table.append(el("thead", {}, head));
  const body = el("tbody");
  for (const p of peers) {
    const row = el("tr", { class: "peer" + (p.self ? " self" : ""), "data-peer": p.peer_id, "data-range": `${p.start}:${p.end}` },
      el("td", { class: "label", title: p.peer_id }, `${short(p.peer_id)} [${p.start}:${p.end})${p.self ? " (this node)" : ""}`));
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
  for (const [a, b] of spans) gaps.append(el("li", { class: "gap", "data-gap": `${a}:${b}` }, `gap: layers ${a}:${b} are served by no peer`));
}

function renderRoutes(gen) {
  $("gen-summary").textContent = `${gen.running} running (of ${gen.max_running}), ${gen.deferred} waiting`;
  const body = $("routes").tBodies[0]; body.replaceChildren();
  const rows = [...gen.live.map((g) => ["running", g]), ...gen.recent.map((g) => ["done", g])];
  if (!rows.length) body.append(el("tr", {}, el("td", { colSpan: 7 }, "no generation yet")));
  for (const [state, g] of rows) {
    const route = (g.route || []).map((h) => { const [peer, a, b] = h.split(":"); return `${short(peer)}[${a}:${b})`; }).join(" → ");
    body.append(el("tr", { class: "route " + state, "data-route": (g.route || []).join(" ") },
      el("td", {}, state), el("td", {}, g.edge), el("td", { class: "label" }, route || "–"), el("td", {}, g.tokens),
      el("td", {}, num(g.decode_tokens_per_s)), el("td", {}, g.ttft_s == null ? "–" : g.ttft_s + " s"),
      el("td", {}, g.finish_reason || (state === "running" ? "…" : "–") + (g.failovers ? ` (${g.failovers} failover)` : ""))));
  }
}

function renderNodes(peers) {
  const body = $("nodes").tBodies[0]; body.replaceChildren();
  for (const p of peers) {
    const reach = p.relayed ? "relayed via " + (p.relays.map(short).join(", ") || "?") : (p.endpoint || "direct");
    body.append(el("tr", { class: "node", "data-peer": p.peer_id },
      el("td", { class: "label", title: p.peer_id }, short(p.peer_id) + (p.self ? " (this node)" : "")),
      el("td", {}, `${p.start}:${p.end}`), el("td", {}, size(p.memory_budget_bytes)), el("td", {}, `${p.free_kv_tokens} tokens`),
      el("td", {}, num(p.decode_tokens_per_s)), el("td", {}, num(p.prefill_tokens_per_s)), el("td", {}, reach),
      el("td", {}, num(p.expires_in_s, " s"))));
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
    ["throughput", `${num(t.predicted_tokens_per_s)} tok/s generated, ${num(t.prompt_tokens_per_s)} tok/s prompt, ${t.tokens_predicted_total || 0} tokens so far`],
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
  $("summary").textContent = cov ? (cov.fully_covered ? `all ${m.num_layers} layers covered by ${status.peers.length} peers` :
    `${cov.gaps.length} gap(s) in ${m.num_layers} layers`) : "waiting for the swarm view";
  renderCoverage(status); renderRoutes(status.generations); renderNodes(status.peers || []); renderSelf(status);
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
