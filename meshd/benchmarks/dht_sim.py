"""``meshd bench dht``: a 200-node DHT on one machine; ``--sim``: 1,000+ simulated nodes.

``meshd bench dht --sim [--nodes N] [--seed S]`` runs the deterministic
simulation instead (dht/kademlia/scenario.py: the same core on an in-memory
network on a virtual clock, NAT'd and slow nodes, 20% churn; its result does
not depend on this machine's load) and adds ``wall_s`` and ``cpu_s``.

Without ``--sim``: real py-libp2p hosts on loopback, each with meshd's ``DhtNode`` (the one the
daemon runs: validator, merge rules, iterative lookups of dht/lookup.py),
spread over a few processes; no weights. Each node publishes a synthetic
signed capability record (one of ``nodes / 20`` synthetic models, a one-layer
span of a 4-layer model), with a record TTL of three ``republish_interval_s``
as the daemon's advertiser does (the first publish's records live
PRE_CHURN_TTL_EXTRA_S longer: they stand for the republishes the sim skips
while 200 nodes join and read, which takes minutes on 2 cores; without it the
first records expired during the reads). After the kill, every survivor republishes
once within one interval at its own random phase -- what the advertiser's
ttl/3 loop does -- while sampled survivors keep reading. (Running every
node's loop from the start would put 200 nodes' republishing on 2 cores:
the bench would measure CPU starvation, not the DHT.)

    parent (this module's run)                 children (``child``: one trio loop each)
    spawn P children  -------------------->   start N/P hosts, print their addresses
    join: child 0 first, then the others ->   bootstrap via node 0, self-lookup, refresh lookup
    publish ------------------------------>   publish every record once (one at a time per child)
    fetch (sampled nodes x every model) -->   DhtNode.fetch(model key): records found, rounds
    SIGKILL one child (1/P = 20% of nodes)
    republish (spread over one interval) ->   every survivor publishes again at a random moment
    fetch again, every few seconds ------->   the views not yet complete, until none is left;
                                              then one full pass confirms
    holders ------------------------------>   how many live nodes hold each model key, and each record
    stats -------------------------------->   RPC outcomes, connections per node

Reported: ``nodes``, ``max_lookup_rounds`` (over every sampled lookup, with
``round_bound`` = ceil(log2 N) + 2), ``found_fraction`` (records found /
records published, before churn), ``churn_converged_s`` (kill -> every
sampled survivor's view holds every surviving record; its floor here is
``read_pass_s``, one full read of every sampled view before the kill, since
convergence is seen by reading: at least one pass plus the confirming one), and the replica
counts of the model keys before the kill, right after it and one republish
interval later (``min_replicas_*``): republishing re-replicates to the new
k closest; ``min_record_replicas_*``: the same per record (the holders
of a key may hold different subsets of its records; a record held by few
nodes was published to a poor view of the key's closest peers, one held by
many and still missed was lost by the reader's lookup); ``republished_s``: kill -> every survivor's republish done
(null when not within REPUBLISH_WAIT_INTERVALS intervals). Also the nodes'
RPC outcomes (answered, cut by the caller's deadline, failed: ``rpcs_*``,
see ``DhtNode.rpc_stats``) and connections per node at the end; and how many
cores the nodes kept busy (their processes' CPU seconds per wall second:
``cores_busy_publishing``, ``cores_busy_converging`` from the kill to a complete
view, ``cores_busy_after_kill`` to the end of the republishes): near the
machine's core count, the figures are CPU starvation's, not the DHT's.
After the kill the views are polled at most half of the time (``POLL_DUTY``):
reading without pause would double the survivors' load while they republish.

Commands and answers are JSON lines on the children's stdin / stdout. Every
wait is bounded; a child exits when its stdin closes.
"""
from __future__ import annotations

import json
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from meshd.testing import procs

NODES = 200
PROCESSES = 5
QUICK_NODES = 40
QUICK_PROCESSES = 5
RECORDS_PER_MODEL = 20
MODEL_LAYERS = 4
REPUBLISH_S = 60.0
QUICK_REPUBLISH_S = 30.0
SAMPLES_PER_PROCESS = 4
# Nodes of one process that join (bootstrap + lookups) at once.
JOIN_CONCURRENCY = 1
PUBLISH_CONCURRENCY = 1
FETCH_CONCURRENCY = 8
COMMAND_TIMEOUT_S = 600.0
# How long after the kill the survivors' republishes may take (in republish intervals).
REPUBLISH_WAIT_INTERVALS = 3
CONVERGE_POLL_S = 2.0
# After a poll that read the views for T seconds, the next one starts at least T later: reads
# take at most half of the survivors' time, next to their republishing (see ``simulate``).
POLL_DUTY = 0.5
RPC_OUTCOMES = ("answered", "timed_out", "failed", "stuck_closed", "stuck_kept")
# The republish interval is at least this many times the time this machine takes to
# publish the survivors' records (measured in the publish phase; see ``simulate``).
INTERVAL_HEADROOM = 3.0
# Extra lifetime of the records of the first publish (see ``_child_main``), within the
# validator's one-hour cap: the daemon's advertiser would have republished them every
# interval while the sim joins and reads, which on 2 cores takes several minutes.
PRE_CHURN_TTL_EXTRA_S = 1200.0
MAX_FIRST_TTL_S = 3600.0


def _digest(model: int) -> str:
    return "sha256:" + f"{model:064x}"


def _assignment(index: int, models: int) -> tuple[str, tuple[int, int]]:
    model = index % models
    layer = (index // models) % MODEL_LAYERS
    return _digest(model), (layer, layer + 1)


# ---------------------------------------------------------------------------------------- child

def child(first_index: int, count: int, models: int, republish_s: float) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import trio

    trio.run(_child_main, first_index, count, models, republish_s)


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _child_main(first_index: int, count: int, models: int, republish_s: float) -> None:
    from contextlib import AsyncExitStack

    import trio

    from dht import keys as K
    from dht.host.bootstrap import connect_bootstrap
    from dht.host.build import running_host
    from dht.identity import Identity
    from dht.node import DhtNode
    from dht.records import CapabilityClaim, parse_record_set_lenient, sign_capability, validate_capability

    def wall_ms() -> int:
        return int(time.time() * 1000)

    ttl_ms = int(3 * republish_s * 1000)
    # The first publish stands for the republishes the sim skips before the kill: its
    # records must outlive the join, publish and first-read phases (minutes at 200 nodes).
    first_ttl_ms = min(int(MAX_FIRST_TTL_S * 1000), ttl_ms + int(PRE_CHURN_TTL_EXTRA_S * 1000))
    async with AsyncExitStack() as stack:
        nodes: list[tuple[int, Identity, DhtNode]] = []
        for i in range(count):
            index = first_index + i
            ident = Identity.from_seed(index.to_bytes(4, "big") * 8)
            host = await stack.enter_async_context(running_host(ident, ["/ip4/127.0.0.1/tcp/0"]))
            node = await stack.enter_async_context(DhtNode(host, wall_ms).running())
            nodes.append((index, ident, node))
        _emit({"event": "up", "peers": [ident.peer_id for _, ident, _ in nodes],
               "bootstrap": f"{nodes[0][2].host.get_addrs()[0]}"})
        sequences = {index: 0 for index, _, _ in nodes}

        async def publish(index: int, ident: Identity, node: DhtNode) -> None:
            digest, span = _assignment(index, models)
            first = sequences[index] == 0
            sequences[index] += 1
            raw = sign_capability(CapabilityClaim(model_artifact_digest=digest, runtime_recipe_digest=digest,
                                                  start_layer=span[0], end_layer=span[1], num_layers=MODEL_LAYERS,
                                                  direct_addrs=(str(node.host.get_addrs()[0]),)),
                                  ident.signing_key, peer_id=ident.peer_id, sequence=sequences[index],
                                  now_ms=wall_ms(), ttl_ms=first_ttl_ms if first else ttl_ms)
            await node.publish(validate_capability(raw, wall_ms()))

        async def republish_within(spread_s: float) -> None:
            """Every node republishes once at its own random moment in [0, spread_s)."""
            rng = random.Random(first_index)

            async def later(delay: float, item) -> None:
                await trio.sleep(delay)
                try:
                    await publish(*item)
                except Exception as exc:  # noqa: BLE001 - counted by the parent as a missing record
                    print(f"republish {item[0]}: {exc}", file=sys.stderr)

            async with trio.open_nursery() as inner:
                for item in nodes:
                    inner.start_soon(later, rng.uniform(0, spread_s), item)
            _emit({"event": "republished"})

        async def bounded(fn, items, limit: int) -> list:
            out: list = [None] * len(items)
            limiter = trio.CapacityLimiter(limit)

            async def one(i, item):
                async with limiter:
                    out[i] = await fn(*item)

            async with trio.open_nursery() as nursery:
                for i, item in enumerate(items):
                    nursery.start_soon(one, i, item)
            return out

        async def join(index: int, ident: Identity, node: DhtNode, bootstrap: list[str]) -> int:
            if index != 0:
                await connect_bootstrap(node.host, bootstrap, 10.0)
            await node.join()                                            # the daemon's: bootstrap + self-lookup
            await node.lookup(random.Random(index).randbytes(32))        # and one far bucket
            return node.routing_table_size()

        async def fetch(index: int, node: DhtNode, digest: str) -> dict:
            recs = await node.fetch(K.model_key(digest))
            return {"node": index, "digest": digest, "peers": sorted(r.peer_id for r in recs),
                    "rounds": node.last_lookup.rounds if node.last_lookup else 0,
                    "asked": node.last_lookup.asked if node.last_lookup else 0,
                    "failed": node.last_lookup.failed if node.last_lookup else 0}

        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        async with trio.open_nursery() as nursery:
            while True:
                chunk = await stdin.receive_some(65536)
                if not chunk:
                    nursery.cancel_scope.cancel()
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    cmd = json.loads(line)
                    kind = cmd["cmd"]
                    if kind == "join":
                        which = nodes[1:] if cmd.get("rest") else nodes[:1] if cmd.get("first") else nodes
                        sizes = await bounded(join, [(i, d, n, cmd["bootstrap"]) for i, d, n in which],
                                              JOIN_CONCURRENCY)
                        _emit({"event": "joined", "routing_table": sizes})
                    elif kind == "refresh":
                        sizes = await bounded(lambda i, n: n.lookup(n.host.get_id().to_bytes()),
                                              [(i, n) for i, _, n in nodes], JOIN_CONCURRENCY)
                        _emit({"event": "refreshed",
                               "routing_table": [n.routing_table_size() for _, _, n in nodes]})
                    elif kind == "publish":
                        await bounded(publish, nodes, PUBLISH_CONCURRENCY)
                        _emit({"event": "published"})
                    elif kind == "republish":
                        ttl_ms = int(3 * float(cmd["spread_s"]) * 1000)     # the interval the parent chose
                        nursery.start_soon(republish_within, float(cmd["spread_s"]))
                    elif kind == "fetch":
                        by_index = {i: n for i, _, n in nodes}
                        if "pairs" in cmd:      # (node, digest) pairs, or every sampled node x every digest
                            items = [(i, by_index[i], d) for i, d in cmd["pairs"] if i in by_index]
                        else:
                            chosen = [(i, n) for i, n in by_index.items() if i in set(cmd["nodes"])]
                            items = [(i, n, d) for i, n in chosen for d in cmd["digests"]]
                        _emit({"event": "fetched", "results": await bounded(fetch, items, FETCH_CONCURRENCY)})
                    elif kind == "stats":
                        counts = {name: 0 for name in RPC_OUTCOMES}
                        for _, _, n in nodes:
                            for name in counts:
                                counts[name] += n.rpc_counts[name]
                        _emit({"event": "stats", "rpcs": counts,
                               "connections": [len(n.host.get_network().connections) for _, _, n in nodes],
                               "rpc_timeout_s": [n.rpc_timer.timeout() for _, _, n in nodes],
                               "cpu_s": time.process_time()})
                    elif kind == "holders":
                        held: dict[str, int] = {}
                        by_record: dict[str, dict[str, int]] = {}     # key -> record's peer -> holders
                        for _, _, n in nodes:
                            for key in n.store.index_keys():
                                if key.startswith("/meshd/model/"):
                                    held[key] = held.get(key, 0) + 1
                                    stored = n.store.get(key.encode())
                                    recs = parse_record_set_lenient(stored.value, wall_ms()) if stored else []
                                    counts = by_record.setdefault(key, {})
                                    for r in recs:
                                        counts[r.peer_id] = counts.get(r.peer_id, 0) + 1
                        _emit({"event": "holders", "held": held, "records": by_record})


# ---------------------------------------------------------------------------------------- parent

class _Late(RuntimeError):
    """A child did not answer in time (it is still running)."""


class _Child:
    def __init__(self, index: int, first: int, count: int, models: int, republish_s: float, log: Path) -> None:
        self.index, self.first, self.count = index, first, count
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshd.benchmarks.dht_sim", "child", str(first), str(count), str(models),
             str(republish_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("wb"), env=procs.child_env(1),
            cwd=str(Path(__file__).resolve().parents[2]))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None   # piped
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, **cmd) -> None:
        assert self.proc.stdin is not None   # piped
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def expect(self, event: str, timeout_s: float = COMMAND_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise _Late(f"dht child {self.index}: no {event!r} within {timeout_s:g} s; "
                                   f"log: {self.log.read_text()[-2000:]}") from None
            if line is None:
                raise RuntimeError(f"dht child {self.index} exited ({self.proc.wait()}): "
                                   f"{self.log.read_text()[-2000:]}")
            msg = json.loads(line)
            if msg.get("event") == event:
                return msg

    def stop(self) -> None:
        procs.stop_process(self.proc)


def _say(progress, text: str) -> None:
    if progress is not None:
        print(f"[bench dht] {text}", file=progress, flush=True)


def _views(children: list[_Child], samples: dict[int, list[int]], digests: list[str],
           only: set[tuple[int, str]] | None = None) -> list[dict]:
    """Every sampled node's fetch of every model key, or of the (node, digest) pairs in
    ``only`` (children work concurrently)."""
    for c in children:
        if only is None:
            c.send(cmd="fetch", nodes=samples[c.index], digests=digests)
        else:
            c.send(cmd="fetch", pairs=[[i, d] for i, d in sorted(only) if c.first <= i < c.first + c.count])
    return [r for c in children for r in c.expect("fetched")["results"]]


def _holders(children: list[_Child], digests: list[str]) -> tuple[int, dict[str, dict[str, int]]]:
    """The fewest live holders of any model key; and per model, per record (its peer id), how many
    live nodes hold that record (holders of a key may hold different subsets of its records)."""
    held: dict[str, int] = {}
    records: dict[str, dict[str, int]] = {d: {} for d in digests}
    for c in children:
        c.send(cmd="holders")
    for c in children:
        got = c.expect("holders")
        for key, n in got["held"].items():
            held[key] = held.get(key, 0) + n
        for key, counts in got["records"].items():
            into = records.setdefault(key.rsplit("/", 1)[-1], {})
            for peer, n in counts.items():
                into[peer] = into.get(peer, 0) + n
    return min(held.get(f"/meshd/model/{d}", 0) for d in digests), records


def _record_replicas(records: dict[str, dict[str, int]], expected: dict[str, set[str]]) -> int:
    """The fewest live holders of any expected record."""
    return min((records.get(d, {}).get(p, 0) for d, peers in expected.items() for p in peers), default=0)


def _stats(children: list[_Child]) -> dict:
    """RPC outcomes summed over the children's nodes, and their connection counts."""
    rpcs = {name: 0 for name in RPC_OUTCOMES}
    conns: list[int] = []
    timeouts: list[float] = []
    cpu_s = 0.0
    for c in children:
        c.send(cmd="stats")
    for c in children:
        got = c.expect("stats")
        for name in rpcs:
            rpcs[name] += got["rpcs"][name]
        conns += got["connections"]
        timeouts += got["rpc_timeout_s"]
        cpu_s += got["cpu_s"]
    return {"rpcs": rpcs, "connections_max": max(conns), "connections_mean": round(sum(conns) / len(conns), 1),
            "rpc_timeout_max_s": round(max(timeouts), 2), "cpu_s": cpu_s, "at": time.monotonic()}


def _cores_busy(before: dict, after: dict) -> float:
    """CPU seconds the children spent between two ``_stats`` per second of wall time: how many
    of the machine's cores they kept busy (the children's own work only)."""
    return round((after["cpu_s"] - before["cpu_s"]) / max(1e-9, after["at"] - before["at"]), 2)


def simulate(nodes: int, processes: int, republish_s: float, progress=None) -> dict:
    models = max(1, nodes // RECORDS_PER_MODEL)
    per = nodes // processes
    digests = [_digest(m) for m in range(models)]
    scratch = Path(tempfile.mkdtemp(prefix="meshd-dht-sim-"))
    keep_logs = False
    children: list[_Child] = []
    t0 = time.monotonic()
    try:
        for p in range(processes):
            count = per if p < processes - 1 else nodes - per * (processes - 1)
            children.append(_Child(p, p * per, count, models, republish_s, scratch / f"child{p}.log"))
        peers: dict[int, str] = {}
        boot = None
        for c in children:
            up = c.expect("up")
            peers.update({c.first + i: pid for i, pid in enumerate(up["peers"])})
            if c.index == 0:
                boot = [f"{up['bootstrap']}/p2p/{up['peers'][0]}"]
        _say(progress, f"{nodes} hosts up in {processes} processes ({time.monotonic() - t0:.1f} s)")
        children[0].send(cmd="join", bootstrap=boot, first=True)
        children[0].expect("joined")
        children[0].send(cmd="join", bootstrap=boot, rest=True)
        children[0].expect("joined")
        for c in children[1:]:
            c.send(cmd="join", bootstrap=boot)
        for c in children[1:]:
            c.expect("joined")
        for c in children:
            c.send(cmd="refresh")
        tables = [n for c in children for n in c.expect("refreshed")["routing_table"]]
        _say(progress, f"joined ({time.monotonic() - t0:.1f} s); routing tables {min(tables)}..{max(tables)} peers")
        t_publish = time.monotonic()
        stats_joined = _stats(children)
        for c in children:
            c.send(cmd="publish")
        for c in children:
            c.expect("published")
        publish_phase_s = time.monotonic() - t_publish
        stats_published = _stats(children)
        _say(progress, f"published {nodes} records over {models} models ({time.monotonic() - t0:.1f} s; "
                       f"{_cores_busy(stats_joined, stats_published)} cores busy)")
        # The floor: this machine publishes the N records in publish_phase_s (PUBLISH_CONCURRENCY
        # per process). Republishing the survivors' records within one interval must fit in what
        # the 2 cores carry, or the bench measures CPU starvation (each real node has a CPU of
        # its own): the interval is stretched to INTERVAL_HEADROOM x that floor when it is shorter.
        # Three, not two: that publish keeps both cores busy (``cores_busy_publishing``, 1.9 of 2
        # here), so at 2 x the republishing alone takes about one core and the convergence reads,
        # at full speed, the other: no headroom left for a slower period of a shared machine.
        floor_s = publish_phase_s * (nodes - nodes // processes) / nodes
        base_republish_s = republish_s
        republish_s = max(republish_s, math.ceil(INTERVAL_HEADROOM * floor_s))

        rng = random.Random(7)
        samples = {c.index: sorted(rng.sample(range(c.first, c.first + c.count), min(SAMPLES_PER_PROCESS, c.count)))
                   for c in children}
        expected = {d: {peers[i] for i in peers if _assignment(i, models)[0] == d} for d in digests}
        t_read = time.monotonic()
        views = _views(children, samples, digests)
        read_pass_s = time.monotonic() - t_read
        found = sum(len(set(v["peers"]) & expected[v["digest"]]) for v in views)
        wanted = sum(len(expected[v["digest"]]) for v in views)
        rounds = [v["rounds"] for v in views]
        replicas_before, records_before = _holders(children, digests)
        record_replicas_before = _record_replicas(records_before, expected)
        stats_before = _stats(children)
        _say(progress, f"{len(views)} lookups: found {found}/{wanted}, rounds max {max(rounds)}, "
                       f"fewest replicas {replicas_before} of a key, {record_replicas_before} of a record; "
                       f"{stats_before['rpcs']}, connections max {stats_before['connections_max']} mean "
                       f"{stats_before['connections_mean']}, {_cores_busy(stats_published, stats_before)} cores busy")
        for v in views:     # a record a lookup missed: how many nodes hold it tells publish from read
            for peer in sorted(expected[v["digest"]] - set(v["peers"])):
                _say(progress, f"  not found: node {v['node']} model {v['digest'][-4:]} record of {peer[-6:]} "
                               f"(held by {records_before[v['digest']].get(peer, 0)} nodes); lookup asked "
                               f"{v['asked']}, {v['failed']} did not answer, {v['rounds']} rounds")

        # churn: the last process (1/P of the nodes) dies at once
        _say(progress, f"republish interval {republish_s:g} s (base {base_republish_s:g} s; the survivors' "
                       f"records take {floor_s:.0f} s to publish here)")
        victim = children[-1]
        dead = {peers[i] for i in range(victim.first, victim.first + victim.count)}
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        t_kill = time.monotonic()
        survivors = children[:-1]
        live_expected = {d: ids - dead for d, ids in expected.items()}
        replicas_after_kill, _ = _holders(survivors, digests)
        stats_kill = _stats(survivors)
        for c in survivors:       # each survivor's advertiser republishes once per interval, at its own phase
            c.send(cmd="republish", spread_s=republish_s)
        # Poll the views that are not complete yet (each poll re-reading all 160 would load
        # the 2 cores more than the churn does); when none is left, one full pass confirms,
        # and a view found incomplete there goes back on the list.
        converged_s = None
        churn_rounds: list[int] = []
        pending = {(i, d) for c in survivors for i in samples[c.index] for d in digests}
        confirming = False
        while time.monotonic() - t_kill < 2 * republish_s:
            t_pass = time.monotonic()
            views = _views(survivors, samples, digests, None if confirming else pending)
            pass_s = time.monotonic() - t_pass
            churn_rounds += [v["rounds"] for v in views]
            incomplete = {(v["node"], v["digest"]) for v in views if not live_expected[v["digest"]] <= set(v["peers"])}
            pending = (pending - {(v["node"], v["digest"]) for v in views}) | incomplete
            if confirming and not incomplete:
                converged_s = time.monotonic() - t_kill
                break
            confirming = not pending
            _say(progress, f"  {time.monotonic() - t_kill:.0f} s after the kill: {len(incomplete)} of "
                           f"{len(views)} views read incomplete")
            if pending:
                time.sleep(max(CONVERGE_POLL_S, pass_s * (1 - POLL_DUTY) / POLL_DUTY))
        stats_converged = _stats(survivors)
        _say(progress, f"after killing {len(dead)} nodes: view complete after "
                       f"{converged_s if converged_s is None else round(converged_s, 1)} s; "
                       f"{_cores_busy(stats_kill, stats_converged)} cores busy; {stats_converged['rpcs']}")
        # the survivors' republishes, one deadline for all: a republish still running after
        # REPUBLISH_WAIT_INTERVALS intervals is reported (``republished_s`` null), not waited for
        deadline = t_kill + REPUBLISH_WAIT_INTERVALS * republish_s
        republished_s: float | None = None
        try:
            for c in survivors:
                c.expect("republished", timeout_s=max(0.1, deadline - time.monotonic()))
            republished_s = time.monotonic() - t_kill
        except _Late:
            pass
        _say(progress, f"every survivor republished: {republished_s if republished_s is None else round(republished_s)}"
                       f" s after the kill")
        replicas_after_republish, records_after = _holders(survivors, digests)
        stats_after = _stats(survivors)
        views = _views(survivors, samples, digests)
        churn_rounds += [v["rounds"] for v in views]
        missing = sum(len(live_expected[v["digest"]] - set(v["peers"])) for v in views)
        short = [v for v in views if not live_expected[v["digest"]] <= set(v["peers"])]
        for v in short:
            _say(progress, f"  incomplete after the republish: node {v['node']} model {v['digest'][-4:]}: "
                           f"{len(live_expected[v['digest']] - set(v['peers']))} missing; lookup asked {v['asked']}, "
                           f"{v['failed']} did not answer, {v['rounds']} rounds")
        return {
            "nodes": nodes,
            "processes": processes,
            "models": models,
            "sampled_lookups": len(rounds),
            "max_lookup_rounds": max(rounds),
            "median_lookup_rounds": sorted(rounds)[len(rounds) // 2],
            "max_lookup_rounds_after_churn": max(churn_rounds),
            "round_bound": math.ceil(math.log2(nodes)) + 2,
            "found_fraction": round(found / wanted, 4),
            "killed_nodes": len(dead),
            "churn_converged_s": None if converged_s is None else round(converged_s, 2),
            "read_pass_s": round(read_pass_s, 2),
            "republished_s": None if republished_s is None else round(republished_s, 1),
            "complete_after_republish": missing == 0,
            "missing_after_republish": missing,
            "views_incomplete_after_republish": len(short),
            "republish_interval_s": republish_s,
            "republish_interval_base_s": base_republish_s,
            "survivors_republish_floor_s": round(floor_s, 1),
            "interval_stretched_to_cpu": republish_s > base_republish_s,
            "record_ttl_s": 3 * republish_s,
            "min_replicas_before": replicas_before,
            "min_replicas_after_kill": replicas_after_kill,
            "min_replicas_after_republish": replicas_after_republish,
            "min_record_replicas_before": record_replicas_before,
            "min_record_replicas_after_republish": _record_replicas(records_after, live_expected),
            "routing_table_min": min(tables),
            "routing_table_max": max(tables),
            "rpcs_before_churn": stats_before["rpcs"],
            "rpcs_survivors_total": stats_after["rpcs"],
            "connections_per_node_max": stats_after["connections_max"],
            "connections_per_node_mean": stats_after["connections_mean"],
            "rpc_timeout_max_s": stats_after["rpc_timeout_max_s"],
            "cores_busy_publishing": _cores_busy(stats_joined, stats_published),
            "cores_busy_converging": _cores_busy(stats_kill, stats_converged),
            "cores_busy_after_kill": _cores_busy(stats_kill, stats_after),
            "elapsed_s": round(time.monotonic() - t0, 1),
        }
    except BaseException:
        _say(progress or sys.stderr, f"children's logs kept in {scratch}")
        keep_logs = True
        raise
    finally:
        for c in children:
            c.stop()
        if not keep_logs:
            shutil.rmtree(scratch, ignore_errors=True)


# Simulated nodes of ``--sim`` (``--quick``: fewer).
SIM_NODES = 1000
SIM_QUICK_NODES = 200
SIM_SEED = 1


def simulated(nodes: int, seed: int, progress=None) -> dict:
    """The simulation's report (dht/kademlia/scenario.py), with its wall and CPU seconds."""
    from dht.kademlia.scenario import SimConfig, simulate

    cpu = time.process_time()
    report = simulate(SimConfig(nodes=nodes, seed=seed),
                      progress=None if progress is None else lambda text: _say(progress, text))
    report["cpu_s"] = round(time.process_time() - cpu, 2)
    return report


def run(quick: bool, progress=None, options=None) -> dict:
    if options is not None and getattr(options, "sim", False):
        nodes = options.nodes if options.nodes is not None else SIM_QUICK_NODES if quick else SIM_NODES
        return simulated(nodes, SIM_SEED if options.seed is None else options.seed, progress)
    if quick:
        return simulate(QUICK_NODES, QUICK_PROCESSES, QUICK_REPUBLISH_S, progress)
    return simulate(NODES, PROCESSES, REPUBLISH_S, progress)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "child":
        child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    else:
        print("usage: python -m meshd.benchmarks.dht_sim child FIRST COUNT MODELS REPUBLISH_S", file=sys.stderr)
        sys.exit(2)
