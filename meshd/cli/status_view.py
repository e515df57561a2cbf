"""Render the daemon's status reply as text (pure: dict in, str out).

The coverage map is a table of layer spans x peers, one per model: each row
is a span [A, B) with the peers serving it and a bar over the model's layers;
the last line counts peers per layer and names the gaps. Under our own
model's table, a line says what closes its gaps: the tracker moving ranges,
or how much memory the pool lacks ("short    need 410MiB more for layers
21:26: one more node with --memory 420MiB, or raise a node's budget").
"""
from __future__ import annotations

import time

from dht.compat.registry import render_library

# Bars wider than this are scaled down so a 120-layer model fits a terminal.
MAX_BAR_CHARS = 64
# Connected peers listed by name; the rest are counted.
MAX_PEERS_LISTED = 8


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 20 else peer_id[:12] + "…" + peer_id[-6:]


def _bar(start: int, end: int, num_layers: int) -> str:
    width = min(num_layers, MAX_BAR_CHARS)
    cells = []
    for i in range(width):
        lo, hi = i * num_layers / width, (i + 1) * num_layers / width
        cells.append("#" if start < hi and end > lo else ".")
    return "".join(cells)


def coverage_table(digest: str, entries: list[dict]) -> list[str]:
    if not entries:
        return [f"coverage of {digest}: no live records"]
    num_layers = max(e["num_layers"] for e in entries)
    spans: dict[tuple[int, int], list[str]] = {}
    for e in entries:
        spans.setdefault((e["start"], e["end"]), []).append(e["peer_id"])
    per_layer = [sum(1 for e in entries if e["start"] <= layer < e["end"]) for layer in range(num_layers)]
    gaps = _gaps(per_layer)
    model_id = next((e["model_id"] for e in entries if e.get("model_id")), "")
    head = f"coverage of {digest}" + (f" ({model_id})" if model_id else "")
    head += f": {num_layers} layers, {len({e['peer_id'] for e in entries})} peers, "
    head += "complete" if not gaps else "gaps at " + ", ".join(f"{a}:{b}" for a, b in gaps)
    span_w = max([len("peers"), len("span")] + [len(f"{a}:{b}") for a, b in spans]) + 2
    label = f"layers 0..{num_layers - 1}"
    bar_w = max(min(num_layers, MAX_BAR_CHARS), len(label)) + 2
    rows = [head, f"  {'span'.ljust(span_w)}{label.ljust(bar_w)}peers"]
    for (a, b), peers in sorted(spans.items()):
        rows.append(f"  {f'{a}:{b}'.ljust(span_w)}{_bar(a, b, num_layers).ljust(bar_w)}"
                    + ", ".join(_short(p) for p in sorted(peers)))
    if num_layers <= MAX_BAR_CHARS:
        rows.append(f"  {'peers'.ljust(span_w)}" + "".join(str(min(c, 9)) for c in per_layer))
    return rows


def _gaps(per_layer: list[int]) -> list[tuple[int, int]]:
    gaps, start = [], None
    for i, count in enumerate(per_layer + [1]):
        if count == 0 and start is None:
            start = i
        elif count and start is not None:
            gaps.append((start, i))
            start = None
    return gaps


def failure_lines(failure: dict, log_path: str = "", now: float | None = None) -> list[str]:
    """The worker's last failure: when, how it ended, the last lines of its stderr, where its log is."""
    now = time.time() if now is None else now
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(failure["at_unix_s"]))
    ago = max(0, round(now - failure["at_unix_s"]))
    how = failure["message"] + ("" if failure.get("was_ready") else " before it was ready")
    lines = [f"  failed   {when} ({ago} s ago): {how}"]
    lines += [f"           {line}" for line in failure.get("stderr_tail") or []]
    if log_path:
        lines.append(f"  log      {log_path}")
    return lines


def render_http(http: dict | None) -> list[str]:
    """The API's HTTP library (Hypercorn), its adjustment and the connection slots."""
    if not http:
        return []
    rows = http.get("adjustments") or []
    conns = http.get("connections") or {}
    closed = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in (conns.get("closed") or {}).items() if n)
    lines = [f"http       {http.get('url') or 'API off'}: hypercorn {http.get('version') or '?'}, "
             f"{conns.get('open', 0)} of {conns.get('max', 0)} connections open "
             f"({conns.get('per_address', 0)} per address)" + (f"; closed: {closed}" if closed else "")]
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        lines.append(f"  {'on ' if r['applied'] else 'off'}  {r['name'].ljust(width)}  {r['reason']}")
    return lines


def render_fetch(f: dict | None) -> list[str]:
    """What this node holds and serves to fetching peers, and the fetch it runs (bytes, rate, ETA, peers)."""
    if not f:
        return []
    lines = []
    for h in f.get("holds", []):
        layers = f"layers {h['layers'][0]}:{h['layers'][1]}" if h.get("layers") else "all layers"
        lines.append(f"holds      {h['what']} ({layers}{', fetching' if h.get('fetching') else ''})")
    server = f.get("server") or {}
    if f.get("endpoint"):
        lines.append(f"fetch port {f['endpoint']}: {server.get('bytes_sent', 0) / 1e6:.1f} MB sent, "
                     f"{server.get('connections', 0)} connections, limit {f.get('upload_limit_mb_s')} MB/s")
    p = f.get("fetching")
    if p:
        eta = f", ETA {p['eta_s']:.0f} s" if p.get("eta_s") is not None else ""
        peers = ", ".join(f"{_short(k)} {v['bytes'] / 1e6:.1f} MB {v['state']}" for k, v in p["peers"].items())
        lines.append(f"fetching   {p['label']}: {p['bytes_done'] / 1e6:.1f} of {p['bytes_total'] / 1e6:.1f} MB, "
                     f"{p['rate_mb_s']} MB/s{eta}; peers: {peers or 'none yet'}")
    last = f.get("last_fetch")
    if last:
        lines.append(f"fetched    layers {last['layers'][0]}:{last['layers'][1]}: {last['bytes'] / 1e6:.1f} MB in "
                     f"{last['seconds']} s ({last['network_bytes'] / 1e6:.1f} MB from peers)")
    if f.get("blamed"):
        lines.append("blamed     " + ", ".join(_short(p) for p in f["blamed"]) + " (sent chunks failing the root)")
    return lines


def render_discovery(d: dict | None) -> list[str]:
    """The swarm this node is in, its mDNS (interfaces, peers found, what it ignored), foreign peers."""
    if not d:
        return []
    swarm, mdns = d.get("swarm") or {}, d.get("mdns") or {}
    lines = [f"swarm      {swarm.get('name', '?')} (tag {swarm.get('tag', '?')}, DHT {swarm.get('dht_protocol', '?')})"]
    if mdns.get("state") != "on":
        lines.append(f"mdns       {mdns.get('reason') or mdns.get('state', 'off')}")
    else:
        peers = mdns.get("peers") or []
        connected = sum(1 for p in peers if p["state"] == "connected")
        lines.append(f"mdns       on {', '.join(mdns.get('interfaces') or [])} as {mdns.get('instance', '')}: "
                     f"{len(peers)} peers of this swarm found ({connected} connected)")
        for p in peers[:MAX_PEERS_LISTED]:
            err = f" ({p['last_error']})" if p.get("last_error") else ""
            lines.append(f"           {_short(p['peer_id'])} {p['state']} {' '.join(p['addrs'])}{err}")
        ignored = mdns.get("ignored") or {}
        if ignored:
            lines.append("  ignored  " + ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in ignored.items()))
    foreign = d.get("foreign_peers") or []
    if foreign:
        lines.append(f"  {len(foreign)} connected peers of other swarms (no DHT with them): "
                     + ", ".join(_short(p) for p in foreign[:MAX_PEERS_LISTED]))
    return lines


def render_audits(a: dict | None) -> list[str]:
    """Our audits of the routes we drive (meshd/generate/audit.py) and the peers they excluded."""
    if not a:
        return []
    rate = a.get("verify_rate", 0.0)
    head = "off" if not rate else "every step" if rate >= 1 else f"{rate:.1%} of each hop's steps"
    lines = [f"audits     {head}: {a.get('audits', 0)} run, {a.get('mismatches', 0)} mismatches, "
             f"{a.get('unaudited', 0)} skipped (no replica)"]
    lines += [f"  excluded {peer}" for peer in a.get("excluded", [])[:MAX_PEERS_LISTED]]
    return lines


def render_status(s: dict) -> str:
    own, worker = s["own"], s["worker"]
    lines = [f"peer id    {s['peer_id']}"]
    if s["own"].get("role"):
        lines.append(f"role       {s['own']['role']}")
    for i, addr in enumerate(s["addresses"] or ["(none)"]):
        lines.append(f"{'addresses' if i == 0 else '':<11}{addr}")
    lines.append(f"peers      {len(s['peers'])} connected, routing table {s['routing_table']}")
    for peer in s["peers"][:MAX_PEERS_LISTED]:
        lines.append(f"           {peer}")
    if len(s["peers"]) > MAX_PEERS_LISTED:
        lines.append(f"           ... and {len(s['peers']) - MAX_PEERS_LISTED} more (meshd status --json)")
    lines += render_discovery(s.get("discovery"))
    reach = s.get("reachability")
    if reach:
        lines.append(f"reachable  {reach['verdict']} (mode {reach['mode']})")
        for addr in reach["relayed_addrs"]:
            lines.append(f"  relayed  {addr}")
        if reach.get("relay_losses"):
            lines.append(f"  relay connections lost: {reach['relay_losses']}"
                         " (re-reserved elsewhere when one was known)")
    if own["layers"]:
        state = "advertising" if own["advertising"] else "not advertising"
        extra = (f", seq {own['sequence']}, expires in {own['expires_in_s']} s, {own['acks']} remote stores acked"
                 if own["advertising"] else "")
        lines.append(f"own range  layers {own['layers'][0]}:{own['layers'][1]} of {own['model']} ({state}{extra})")
    elif own.get("role") == "client":
        lines.append(f"own range  none: client-only node of {own['model']} (generates through the swarm)")
    else:
        lines.append("own range  none (DHT-only node)")
    if worker.get("state") != "none":
        health = worker.get("health") or {}
        desc = f"{worker['state']}"
        if worker.get("pid"):
            desc += f", pid {worker['pid']}"
        desc += f", {worker.get('restarts', 0)} restarts"
        if health.get("state"):
            desc += f", {health['state']}, {health.get('active_sessions', 0)} sessions"
            if health.get("age_s") is not None:
                desc += f" (health {health['age_s']:.0f} s old)"
        elif health.get("error"):
            desc += f", health: {health['error']}"
        if worker.get("tls_endpoint"):
            desc += f", tls {worker['tls_endpoint']}"
        failure = worker.get("last_failure")
        if failure and failure.get("next_restart_in_s") is not None:
            desc += f", next start in {failure['next_restart_in_s']:.0f} s"
        lines.append(f"worker     {desc}")
        if failure:
            lines += failure_lines(failure, worker.get("log", ""))
        pushed = health.get("push_streams")
        if pushed:
            lines.append(f"push       streams to successors: {pushed['frames']} over frames,"
                         f" {pushed['grpc']} over gRPC")
        moe = health.get("experts")
        if moe:
            lines.append(f"experts    exchange {moe['bytes_sent_per_position']:.0f} B/position sent, "
                         f"{moe['bytes_received_per_position']:.0f} received, {moe['failovers']} failovers")
    lines += render_audits(s.get("audits"))
    lines += render_library(s.get("libp2p"))
    lines += render_http(s.get("http"))
    lines += render_fetch(s.get("fetch"))
    experts = s.get("experts")
    if experts:
        line = f"experts    {experts['role']}, holds {experts.get('experts') or 'all'}"
        if "advertising" in experts:
            line += ", advertised" if experts["advertising"] else ", not advertised yet"
        for peer in experts.get("peers", []):
            line += f"\n           peer {_short(peer['peer_id'])} {peer['experts']} at {peer['endpoint']}"
        lines.append(line)
    lines.append("")
    if not s["coverage"]:
        lines.append("coverage: no model seen in the DHT yet")
    for digest, entries in s["coverage"].items():
        lines += coverage_table(digest, entries)
        if digest == own.get("model_digest"):
            lines += pool_lines(s.get("pool"))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def pool_lines(pool: dict | None) -> list[str]:
    """What closes the gaps of our model (meshd/swarm/view.py pool_status): moves, or memory it lacks."""
    if not pool or not pool.get("message"):
        return []
    return [("  short    " if pool.get("short") else "  pool     ") + pool["message"]]
