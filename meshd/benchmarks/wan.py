"""``meshd bench swarm --rtt-ms N``: star vs push through real daemons across a delayed network.

    meshd bench swarm --rtt-ms 20 [--quick] [--json] [--model DIR] [--layers 0:10,10:20,20:30]

Topology (root; iproute2): a hub namespace that forwards, and one namespace
per daemon joined to it by a veth pair. The delay: this machine's kernel has
no ``sch_netem`` (``tc qdisc add ... netem`` -> "Specified qdisc kind is
unknown", no modules to load), so each daemon advertises its TLS endpoints
(gRPC and the framed fast path) at the hub's address on its link
(``--advertise-host 10.214.i.1``) and a delaying forwarder in the hub
(delay_proxy.py: RTT/2 per direction, pipelined) carries every hop-to-hop and
entry-to-hop connection to the daemon's worker: every round trip between two
namespaces takes RTT. No NAT: the daemons are public to each other
(``--reachability public``).

    ns n0 (10.214.1.2) --veth-- hub (10.214.i.1: forwarding + delay proxy) --veth-- ns n1 (10.214.2.2) ...
                                                                           --veth-- ns n3: the entry

One ``meshd join --layers A:B`` per range (default: three even ranges), each
in its namespace, bootstrapped from the first, and the entry: a client-only
``meshd join --layers none`` in one more namespace, the same RTT from every
daemon. It holds no layers, so every hop of its route is remote, as for a
user whose machine serves nothing. In the same run, alternating rounds after
a warm-up of each: a generation with ``topology: star``, the whole model in
this process (shard/model/reference.py, one thread like each worker: the compute
per token) and a generation with ``topology: push`` through the entry's
control socket (the generate op a user runs). Then the same daemons' figures
on loopback (a LocalSwarm of the same ranges plus a client-only entry, same
rounds).

Reported: ``push_vs_star_decode_ratio`` (best push decode tok/s / best star),
the legs per token each topology took, each topology's median decode step
split into wall, the hops' compute and the rest, ``arithmetic`` (the measured
decomposition below) and ``loopback`` (the same on loopback); every key is
in docs/benchmarks.md (swarm --rtt-ms N).
Every namespace and daemon is removed at the end.

Arithmetic. Per decode token the star crosses the network 2 x hops times. A
pushed route sends hops + 1 messages per token (``legs_per_token``, counted by
the hops in the frames); when it is looped (the default: the tail sends the
token straight to the head, push.py) the answer's leg to the entry is off the
token's path, so the next token waits for hops legs (``critical_legs_per_token``;
entry-fed push: hops + 1). The compute c is the same; each leg also costs some
software time s (serialization, the proxy's pumps, TLS). With three hops::

    looped:    ratio = (6 x RTT/2 + c + 6 s) / (3 x RTT/2 + c + 3 s)   -> 2 as c -> 0
    entry-fed: ratio = (6 x RTT/2 + c + 6 s) / (4 x RTT/2 + c + 4 s)   -> 1.5 as c -> 0

At 20 ms a looped route reaches 1.4 up to c = 45 ms (entry-fed: c <= 10 ms);
``compute_ms_for_1_4`` and ``rtt_ms_for_1_4`` give the bound for the legs measured.
``arithmetic`` splits the median decode step of each topology into its delay
(critical legs x RTT/2), the hops' own compute c in those steps and the software per
leg (what is left), and gives the ratio delay and compute alone predict,
with c and with the whole model's compute.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TextIO

SUBNET = "10.214"
# Names carry our pid so parallel runs never collide; interface names stay within 15 characters.
_TAG_MOD = 100000


class NetnsError(RuntimeError):
    """Namespaces or netem could not be set up here; the message says why."""


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")


class DelayedNet:
    """A hub namespace and ``count`` node namespaces; ``delay(endpoints)`` starts the hub's proxy."""

    def __init__(self, count: int, rtt_ms: float) -> None:
        self.tag = f"{os.getpid() % _TAG_MOD:05d}"
        self.count, self.rtt_ms = count, rtt_ms
        self.hub = f"mw{self.tag}-hub"
        self.nodes = [f"mw{self.tag}-n{i}" for i in range(count)]
        self.proxy: subprocess.Popen | None = None

    def hub_ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}.1"

    def delay(self, ports: dict[int, list[int]]) -> None:
        """Forward hub_ip(i):port -> ip(i):port for each node i and each of its ports, RTT/2 each way."""
        from meshd.daemon.local_swarm import REPO_ROOT, child_env

        pairs = [f"{self.hub_ip(i)}:{p}={self.ip(i)}:{p}" for i, ps in ports.items() for p in ps]
        self.proxy = subprocess.Popen(["ip", "netns", "exec", self.hub, sys.executable, "-m",
                                       "meshd.benchmarks.delay_proxy", f"{self.rtt_ms / 2:g}", *pairs],
                                      cwd=REPO_ROOT, env=child_env(1), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        line = self.proxy.stdout.readline()
        if line.strip() != "ready":
            raise NetnsError(f"the delay proxy did not start: {self.proxy.stderr.read()[-500:]}")

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}.2"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[i]]

    def up(self) -> DelayedNet:
        if os.geteuid() != 0:
            raise NetnsError("--rtt-ms needs root (network namespaces and tc netem)")
        for tool in ("ip",):
            if shutil.which(tool) is None:
                raise NetnsError(f"`{tool}` is not installed (apt-get install -y iproute2)")
        try:
            _run("ip", "netns", "add", self.hub)
            _run("ip", "-n", self.hub, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", self.hub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            for i, ns in enumerate(self.nodes):
                a, b = f"mw{self.tag}h{i}", f"mw{self.tag}n{i}"
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
                _run("ip", "link", "set", a, "netns", self.hub)
                _run("ip", "link", "set", b, "netns", ns)
                _run("ip", "-n", self.hub, "addr", "add", f"{SUBNET}.{i + 1}.1/24", "dev", a)
                _run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", b)
                _run("ip", "-n", self.hub, "link", "set", a, "up")
                _run("ip", "-n", ns, "link", "set", b, "up")
                _run("ip", "-n", ns, "route", "add", "default", "via", f"{SUBNET}.{i + 1}.1")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait(10)
        for ns in (*self.nodes, self.hub):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _ns_daemon(root: Path, name: str, model: Path, *, prefix: list[str], ip: str, advertise: str, layers: str,
               bootstrap: str | None, threads: int, record_ttl_s: float, kv_budget_tokens: int):
    """``meshd join`` in a namespace (``layers`` "none": the client-only entry)."""
    from meshd.daemon.local_swarm import REPO_ROOT, LocalDaemon, child_env

    d = LocalDaemon.__new__(LocalDaemon)
    d.name, d.data_dir, d.log = name, root / name, root / f"{name}.log"
    args = [*prefix, sys.executable, "-m", "meshd", "join", "--model", str(model), "--layers", layers,
            "--listen", f"/ip4/{ip}/tcp/0", "--advertise-host", advertise, "--data-dir", str(d.data_dir),
            "--record-ttl", str(record_ttl_s),
            "--reachability", "public", "--api-listen", "off", "--threads", str(threads),
            "--kv-budget-tokens", str(kv_budget_tokens),
            "--no-mdns"]   # the WAN under test is the bootstrapped one, not a LAN found by mDNS
    if bootstrap:
        args += ["--bootstrap", bootstrap]
    d._log_file = open(d.log, "w")
    d.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=child_env(threads), stdout=d._log_file,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return d


def _generate(daemon, prompt: str, n: int, topology: str) -> dict:
    done = None
    for event in daemon.generate(prompt, max_tokens=n, raw=True, topology=topology):
        if event.get("done"):
            done = event
        elif "error" in event:
            raise RuntimeError(f"{daemon.name}: {event['error']}")
    if done is None:
        raise RuntimeError(f"{daemon.name} ended the generation without a done event")
    return done


def compare(entry, prompt: str, new_tokens: int, rounds: int, progress, label: str, reference=None) -> dict:
    """Alternating star / push rounds after a warm-up of each, and a whole-model round in between when
    ``reference`` is given (daemon_runs.Reference, same thread count); the figures (module doc)."""
    me = (entry.query("ping") or {}).get("peer_id", "")
    for topology in ("star", "push"):
        _generate(entry, prompt, 4, topology)
    if reference is not None:
        reference.generate(prompt, 4)
    runs: dict[str, list[dict]] = {"star": [], "push": []}
    whole: list[float] = []
    for r in range(rounds):
        for topology in ("star", "push"):
            runs[topology].append(_generate(entry, prompt, new_tokens, topology))
            if reference is not None and topology == "star":
                whole.append(reference.generate(prompt, new_tokens)[1])
        _say(progress, f"{label} round {r + 1}/{rounds}: star {runs['star'][-1]['decode_tokens_per_s']} tok/s, "
                       f"push {runs['push'][-1]['decode_tokens_per_s']} tok/s"
                       + (f", whole model {whole[-1]:.2f} tok/s" if whole else ""))
    best = {t: max(d["decode_tokens_per_s"] or 0.0 for d in runs[t]) for t in runs}
    legs = {t: [x for d in runs[t] for x in d.get("step_legs", [])] for t in runs}
    tokens = [d["tokens"] for t in runs for d in runs[t]]
    looped = all(d.get("looped") for d in runs["push"])
    push_legs = statistics.median(legs["push"]) if legs["push"] else None
    out = {
        "star_decode_tok_s": round(best["star"], 3), "push_decode_tok_s": round(best["push"], 3),
        "push_vs_star_decode_ratio": round(best["push"] / best["star"], 3) if best["star"] else None,
        "legs_per_token": push_legs,
        # A looped route's token path: the tail's leg to the head and the hops' own, not the answer's
        # leg to the entry (off that path): hops legs. Entry-fed push: every leg, hops + 1.
        "looped": looped,
        "critical_legs_per_token": (push_legs - 1 if looped else push_legs) if push_legs else None,
        "star_legs_per_token": statistics.median(legs["star"]) if legs["star"] else None,
        "hops": len(runs["push"][-1]["route"]),
        "entry_serves_layers": any(h.split(":")[0] == me for d in runs["push"] + runs["star"] for h in d["route"]),
        "topologies_run": sorted({d.get("topology") for t in runs for d in runs[t]}),
        "tokens_equal": all(t == tokens[0] for t in tokens),
        **{f"{t}_step_ms": _steps(runs[t]) for t in runs},
        "star_prefill_s": round(min(d["prefill_s"] for d in runs["star"]), 4),
        "push_prefill_s": round(min(d["prefill_s"] for d in runs["push"]), 4),
    }
    if whole:
        out["compute_ms_per_token"] = round(1000.0 / max(whole), 3) if max(whole) else None
    out["legs_ceiling_ratio"] = round(out["star_legs_per_token"] / out["critical_legs_per_token"], 3) \
        if out["star_legs_per_token"] and out["critical_legs_per_token"] else None
    return out


def _steps(runs: list[dict]) -> dict:
    """Medians over every round's plain decode steps: wall time and the hops' own compute (their
    execution times, summed along the route), the rest being legs and software."""
    wall = [w for d in runs for w in d.get("step_wall_ms", [])]
    execution = [e for d in runs for e in d.get("step_execution_ms", [])]
    if not wall:
        return {}
    return {"wall_median": round(statistics.median(wall), 3),
            "hops_compute_median": round(statistics.median(execution), 3),
            "rest_median": round(statistics.median(w - e for w, e in zip(wall, execution)), 3)}


def arithmetic(figures: dict, rtt_ms: float) -> dict:
    """The measured decomposition of a decode step (module doc): legs x RTT/2, compute, software per leg.

    ``c`` is the hops' own compute in the same steps (the medians of their execution times: the
    machine's load at that moment, which the whole model's rounds only sample nearby); the whole
    model's ``compute_ms_per_token`` is beside it."""
    out: dict = {"rtt_ms": rtt_ms, "whole_model_compute_ms": figures.get("compute_ms_per_token")}
    for topology, legs_key in (("star", "star_legs_per_token"), ("push", "critical_legs_per_token")):
        steps, legs = figures.get(f"{topology}_step_ms") or {}, figures.get(legs_key)
        if not steps or not legs:
            return out
        delay = legs * rtt_ms / 2
        out[topology] = {"legs": legs, "delay_ms": round(delay, 3), "wall_ms": steps["wall_median"],
                         "compute_ms": steps["hops_compute_median"],
                         "software_ms_per_leg": round((steps["rest_median"] - delay) / legs, 3)}
    star, push = out["star"], out["push"]
    c = (star["compute_ms"] + push["compute_ms"]) / 2
    out["compute_ms"] = round(c, 3)
    out["ratio_from_step_medians"] = round(star["wall_ms"] / push["wall_ms"], 3)
    out["ratio_from_delay_and_compute"] = round((star["delay_ms"] + c) / (push["delay_ms"] + c), 3)
    whole = figures.get("compute_ms_per_token")
    if whole:
        out["ratio_from_delay_and_whole_model_compute"] = round(
            (star["delay_ms"] + whole) / (push["delay_ms"] + whole), 3)
    out["compute_ms_for_1_4"] = round((star["delay_ms"] - 1.4 * push["delay_ms"]) / 0.4, 3)  # software 0
    gap = star["legs"] - 1.4 * push["legs"]   # (ls R/2 + c) / (lp R/2 + c) = 1.4  <=>  R = 0.8 c / (ls - 1.4 lp)
    out["rtt_ms_for_1_4"] = round(0.8 * c / gap, 3) if gap > 0 else None
    return out


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"swarm bench (wan): {line}", file=progress, flush=True)


def run(rtt_ms: float, quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    from meshd.benchmarks import daemon_runs as R
    from meshd.daemon.local_swarm import THREADS, LocalSwarm, wait_for
    from meshd.plan.modelinfo import model_num_layers
    from native.packaged import smollm2_artifact

    if not 0 <= rtt_ms <= 1000:
        raise NetnsError("--rtt-ms must be within 0..1000")
    model = R.bench_model(options, smollm2_artifact)
    num_layers = model_num_layers(model)
    layers = getattr(options, "layers", None)
    specs = R.parse_splits(layers, num_layers) if layers else _even(num_layers, 3)
    new_tokens = 16 if quick else R.QUICK_NEW_TOKENS
    rounds = 1 if quick else 3
    prompt = R.PROMPT_TEXT
    result: dict = {"path": "daemon", "model": str(model), "rtt_ms": rtt_ms, "layers": specs,
                    "new_tokens": new_tokens, "rounds": rounds, "threads": THREADS}
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-wan-"))
    net = DelayedNet(len(specs) + 1, rtt_ms)   # the last namespace holds the client-only entry
    swarm = LocalSwarm(root, model)
    try:
        net.up()
        _say(progress, f"{len(specs)} namespaces, {rtt_ms:g} ms round trips between them; starting daemons")
        for i, spec in enumerate(specs):
            d = _ns_daemon(root, f"n{i}", model, prefix=net.prefix(i), ip=net.ip(i), advertise=net.hub_ip(i),
                           layers=spec,
                           bootstrap=swarm.bootstrap, threads=THREADS, record_ttl_s=R.BENCH_RECORD_TTL_S,
                           kv_budget_tokens=1024)
            swarm.daemons.append(d)
            if swarm.bootstrap is None:
                swarm.bootstrap = d.address()
        c = len(specs)
        entry = _ns_daemon(root, "entry", model, prefix=net.prefix(c), ip=net.ip(c), advertise=net.hub_ip(c),
                           layers="none", bootstrap=swarm.bootstrap, threads=THREADS,
                           record_ttl_s=R.BENCH_RECORD_TTL_S, kv_budget_tokens=1024)
        swarm.daemons.append(entry)
        for d in swarm.daemons[:-1]:
            swarm.wait_serving(d, R.START_TIMEOUT_S)
        _wait_covered(entry, len(specs), wait_for, R.START_TIMEOUT_S)
        (entries,) = (entry.query("status") or {})["coverage"].values()
        ports: dict[int, list[int]] = {}
        for e in entries:
            for endpoint in (e["grpc_endpoint"], e.get("frames_endpoint") or ""):
                host, _, port = endpoint.rpartition(":")
                if port:
                    ports.setdefault(next(i for i in range(len(specs)) if net.hub_ip(i) == host), []).append(int(port))
        net.delay(ports)
        result["delay"] = "userspace proxy in the hub namespace (no sch_netem in this kernel)"
        _say(progress, "loading the whole model in this process (compute per token, same rounds)")
        reference = R.Reference(model, THREADS)
        result.update(compare(entry, prompt, new_tokens, rounds, progress, f"{rtt_ms:g} ms", reference))
        result["arithmetic"] = arithmetic(result, rtt_ms)
        _say(progress, _explain(result["arithmetic"]))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    finally:
        _say(progress, "stopping the daemons and removing the namespaces")
        swarm.close()
        net.down()
    try:
        _say(progress, "the same ranges on loopback, a client-only entry beside them")
        local = R.start_split(root / "loopback", model, specs, kv_budget_tokens=1024)
        try:
            client = local.add(layers="none", name="entry")
            _wait_covered(client, len(specs), wait_for, R.START_TIMEOUT_S)
            loop = compare(client, prompt, new_tokens, rounds, progress, "loopback", reference)
            loop["arithmetic"] = arithmetic(loop, 0.0)
            result["loopback"] = loop
        finally:
            local.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _wait_covered(entry, hops: int, wait_for, timeout_s: float) -> dict:
    """Until the (client-only) entry sees every layer covered by ``hops`` daemons."""
    return wait_for(lambda: (v := entry.swarm()) and (v.get("coverage") or {}).get("fully_covered")
                    and len(v["ads"]) >= hops and v, f"{entry.name} seeing full coverage", timeout_s, entry)


def _explain(a: dict) -> str:
    if "push" not in a:
        return "no decode steps measured"
    s, p, half = a["star"], a["push"], a["rtt_ms"] / 2
    return (f"per decode step: star {s['wall_ms']} ms = {s['legs']} legs x {half:g} ms + compute {s['compute_ms']} + "
            f"{s['software_ms_per_leg']} ms software per leg; push {p['wall_ms']} ms = {p['legs']} x {half:g} + "
            f"{p['compute_ms']} + {p['software_ms_per_leg']}/leg; star/push {a['ratio_from_step_medians']}, delay "
            f"and compute alone predict {a['ratio_from_delay_and_compute']} (whole model's compute "
            f"{a['whole_model_compute_ms']} ms); 1.4 needs compute <= {a['compute_ms_for_1_4']} ms per token at "
            f"this RTT, or an RTT >= {a['rtt_ms_for_1_4']} ms at this compute")


def _even(num_layers: int, parts: int) -> list[str]:
    cuts = [round(num_layers * k / parts) for k in range(parts + 1)]
    return [f"{a}:{b}" for a, b in zip(cuts, cuts[1:])]
