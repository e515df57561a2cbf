"""The churn scenario on the simulated network: join, publish, read, 20% die, republish, read.

What ``meshd bench dht --sim`` prints and tests/test_dht_sim.py asserts. The
same phases as the real-host bench (meshd/benchmarks/dht_sim.py), in virtual
time on dht/kademlia/sim.py::

    join        node i (i >= 1) dials the bootstrap node 0 at i x JOIN_SPACING_S and
                joins as DhtNode.join does (ops.join: a lookup of its own id, then
                one per bucket beyond its neighbourhood); every node then runs the
                refresh schedule of ops.py (every 600 s at a random phase)
    publish     T0 = JOIN_SETTLE_S after the last join: every node publishes one
                signed capability record (one of nodes / RECORDS_PER_MODEL models,
                a one-layer span of a MODEL_LAYERS-layer model; ttl = the daemon's
                record TTL) at its own moment within one republish interval, as
                the daemon's advertisers do
    read        one interval later: READERS_PER_MODEL random nodes per model fetch
                its model key (ops.fetch): ``found_fraction``, ``max_lookup_rounds``
    kill        CHURN_FRACTION of the nodes die at once; every survivor republishes
                once at its own moment within one interval (the advertiser's ttl/3)
    converge    the surviving readers' views not yet complete are read again every
                POLL_S; when none is left, one full pass confirms:
                ``churn_converged_s`` (kill -> confirmed, virtual seconds)
    after       once every survivor has republished, one more full pass:
                ``complete_after_republish``; replica counts before and after

Nodes: NAT_FRACTION of them NAT'd and SLOW_FRACTION slow (sim.py), the
bootstrap node neither; the victims of the kill are drawn from all nodes.
Identities, roles, phases and victims come from the seed alone.

Reported (``simulate``'s dict): ``nodes``, ``seed``, ``max_lookup_rounds`` and
``round_bound`` (ceil(log2 N) + 2), ``found_fraction``, ``churn_converged_s``,
``republish_interval_s``, ``trace_digest``, ``killed_nodes``, ``nat_nodes``,
``slow_nodes``, ``messages`` (GET and PUT RPCs sent), ``rpcs`` (their outcomes
summed over the nodes), ``lookups``, ``max_lookup_rounds_after_churn``,
``max_lookup_rounds_any`` (every lookup: joins, publishes, reads),
``complete_after_republish``, ``min_replicas_*`` (live holders of the least
held model key) and ``min_record_replicas_*`` (of the least held record),
routing-table and connection sizes, ``virtual_s`` and ``wall_s``.
"""
from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio.testing

from dht import keys as K
from dht.identity import Identity
from dht.kademlia import ops
from dht.kademlia.sim import T_MARK, Network, run_on_mock_clock
from dht.kademlia.values import lenient
from dht.records import CapabilityClaim, sign_capability, validate_capability

# The daemon's record TTL (meshd/config.py DEFAULT_RECORD_TTL_S; tests/test_dht_sim.py checks
# they agree): the advertiser republishes every ttl / 3 = 40 s.
RECORD_TTL_S = 120.0
RECORDS_PER_MODEL = 20
MODEL_LAYERS = 4
READERS_PER_MODEL = 10
NAT_FRACTION = 0.1
SLOW_FRACTION = 0.1
CHURN_FRACTION = 0.2
BOOTSTRAP = 0
# One join starts every JOIN_SPACING_S (a join takes a few round trips: they overlap).
JOIN_SPACING_S = 0.05
JOIN_SETTLE_S = 10.0
# The reads of one pass start within READ_SPREAD_S of each other.
READ_SPREAD_S = 2.0
# After the kill, views not yet complete are read again this often.
POLL_S = 2.0
# How long after the kill the views may take to converge before the scenario gives up.
CONVERGE_WAIT_INTERVALS = 2


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 1000
    seed: int = 1
    nat_fraction: float = NAT_FRACTION
    slow_fraction: float = SLOW_FRACTION
    churn_fraction: float = CHURN_FRACTION
    record_ttl_s: float = RECORD_TTL_S
    readers_per_model: int = READERS_PER_MODEL

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError("the simulation needs at least 2 nodes")
        for name in ("nat_fraction", "slow_fraction", "churn_fraction"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be within [0, 1)")
        if self.readers_per_model < 1 or self.record_ttl_s <= 0:
            raise ValueError("readers_per_model and record_ttl_s must be positive")


def simulate(config: SimConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run the scenario (module docstring) on trio's MockClock; its report. ``progress`` gets
    a line per phase."""
    wall = time.perf_counter()
    report = run_on_mock_clock(_main, config, progress)
    report["wall_s"] = round(time.perf_counter() - wall, 2)
    return report


def identity(seed: int, index: int) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"meshd-sim/{seed}/{index}".encode()).digest())


def _digest(model: int) -> str:
    return "sha256:" + f"{model:064x}"


class _Scenario:
    def __init__(self, config: SimConfig, progress: Callable[[str], None] | None) -> None:
        self.config = config
        self._progress = progress
        self._wall = time.perf_counter()
        n = config.nodes
        self.rng = random.Random(f"meshd-sim/{config.seed}/scenario")
        self.identities = [identity(config.seed, i) for i in range(n)]
        others = list(range(1, n))
        nat = frozenset(self.rng.sample(others, round(config.nat_fraction * n)))
        slow = frozenset(self.rng.sample(others, round(config.slow_fraction * n)))
        self.net = Network([ident.peer_id_bytes for ident in self.identities], seed=config.seed, nat=nat, slow=slow)
        self.models = max(1, n // RECORDS_PER_MODEL)
        self.interval = ops.republish_interval_s(config.record_ttl_s)
        self.sequence = [0] * n
        self.expected: dict[int, set[str]] = {m: set() for m in range(self.models)}
        for i in range(n):
            self.expected[self._model_of(i)].add(self.identities[i].peer_id)
        self.pending = 0          # joins and publishes running
        self.reading = 0          # reads running

    def say(self, text: str) -> None:
        if self._progress is not None:
            self._progress(f"{text} (virtual {self.net.now:.1f} s, wall {time.perf_counter() - self._wall:.1f} s)")

    def _model_of(self, index: int) -> int:
        return index % self.models

    # ------------------------------------------------------------------ node actions

    def _done(self, _result=None) -> None:
        self.pending -= 1

    def join(self, index: int) -> None:
        node = self.net.nodes[index]
        self.pending += 1

        def connected() -> None:       # DhtNode.join, the bootstrap peer in the table
            self.net.start(node, ops.join(node), self._done)
            self.net.at(self.net.now + ops.refresh_delay(node.rng), self.maintain, index)

        self.net.dial(index, BOOTSTRAP, connected)

    def maintain(self, index: int) -> None:
        node = self.net.nodes[index]
        if node.alive:
            self.net.start(node, ops.refresh(node, node.rng.randbytes(32)))
            self.net.at(self.net.now + ops.refresh_delay(node.rng), self.maintain, index)

    def publish(self, index: int) -> None:
        node, ident = self.net.nodes[index], self.identities[index]
        if not node.alive:
            return
        self.sequence[index] += 1
        layer = (index // self.models) % MODEL_LAYERS
        claim = CapabilityClaim(model_artifact_digest=_digest(self._model_of(index)),
                                runtime_recipe_digest=_digest(self._model_of(index)),
                                start_layer=layer, end_layer=layer + 1, num_layers=MODEL_LAYERS,
                                direct_addrs=(
                                    f"/ip4/10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}/tcp/4001",))
        now = node.wall_ms()
        raw = sign_capability(claim, ident.signing_key, peer_id=ident.peer_id, sequence=self.sequence[index],
                              now_ms=now, ttl_ms=int(self.config.record_ttl_s * 1000))
        self.pending += 1
        self.net.start(node, ops.publish(node, validate_capability(raw, now, node.cache)), self._done)

    # ------------------------------------------------------------------ phases

    async def settle(self, until: float | None = None) -> None:
        """Run until every started join, publish and read is done (and at least until ``until``)."""
        if until is not None:
            await self.net.run_until(until)
        await self.net.run_until(math.inf, stop=lambda: self.pending == 0)

    async def read_pass(self, pairs: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[set, int]]:
        """Every (reader, model) pair's fetch of the model key: (peer ids found, lookup rounds)."""
        results: dict[tuple[int, int], tuple[set, int]] = {}
        for reader, model in pairs:
            def done(fetched: ops.Fetched, pair=(reader, model)) -> None:
                found = {r.peer_id for r in fetched.records}
                results[pair] = (found, fetched.lookup.rounds)
                self.net.mark(T_MARK, pair[0], len(found & self.expected[pair[1]]))
                self.reading -= 1

            def start(reader=reader, model=model, done=done) -> None:
                node = self.net.nodes[reader]
                if node.alive:
                    self.net.start(node, ops.fetch(node, K.model_key(_digest(model))), done)
                else:
                    self.reading -= 1

            self.reading += 1
            self.net.at(self.net.now + self.rng.uniform(0, READ_SPREAD_S), start)
        await self.net.run_until(math.inf, stop=lambda: self.reading == 0)
        return results

    def holders(self) -> tuple[int, int]:
        """Live holders of the least held model key, and of the least held (live) record."""
        now = self.net.nodes[0].wall_ms()
        keys = [K.model_key(_digest(m)) for m in range(self.models)]
        per_key = [0] * self.models
        per_record: dict[str, int] = {}
        for node in self.net.nodes:
            if not node.alive:
                continue
            for m, key in enumerate(keys):
                stored = node.store.values.get(key.encode())
                if stored is None:
                    continue
                recs = lenient(K.parse_key(key), stored, now, node.cache)
                if recs:
                    per_key[m] += 1
                for rec in recs:
                    per_record[rec.peer_id] = per_record.get(rec.peer_id, 0) + 1
        live = [self.identities[n.me].peer_id for n in self.net.nodes if n.alive]
        return min(per_key), min(per_record.get(p, 0) for p in live)

    async def run(self, clock: trio.testing.MockClock) -> dict:
        cfg, net, n = self.config, self.net, self.config.nodes
        net.attach(clock)
        for i in range(1, n):
            net.at(i * JOIN_SPACING_S, self.join, i)
        await self.settle((n - 1) * JOIN_SPACING_S)
        self.say(f"{n} nodes joined ({len(net.nodes[0].conns)} through the bootstrap node; "
                 f"{sum(node.nat for node in net.nodes)} NAT'd, {sum(node.slow for node in net.nodes)} slow)")
        t0 = net.now + JOIN_SETTLE_S
        for i in range(n):
            net.at(t0 + self.rng.uniform(0, self.interval), self.publish, i)
        await self.settle(t0 + self.interval)

        pairs = sorted((reader, m) for m in range(self.models)
                       for reader in self.rng.sample(range(n), min(n, cfg.readers_per_model)))
        views = await self.read_pass(pairs)
        found = sum(len(got & self.expected[m]) for (_, m), (got, _) in views.items())
        wanted = sum(len(self.expected[m]) for _, m in pairs)
        rounds = [r for _, r in views.values()]
        replicas_before, record_replicas_before = self.holders()
        self.say(f"published {n} records over {self.models} models; {len(pairs)} reads found {found}/{wanted}, "
                 f"rounds at most {max(rounds)}")

        victims = sorted(self.rng.sample(range(n), round(cfg.churn_fraction * n)))
        net.kill(victims)
        t_kill = net.now
        dead_ids = {self.identities[v].peer_id for v in victims}
        live_expected = {m: ids - dead_ids for m, ids in self.expected.items()}
        replicas_after_kill, _ = self.holders()
        self.say(f"killed {len(victims)} nodes at once")
        for i in range(n):
            if net.nodes[i].alive:
                net.at(t_kill + self.rng.uniform(0, self.interval), self.publish, i)
        survivors = [(r, m) for r, m in pairs if net.nodes[r].alive]

        converged_s = None
        churn_rounds: list[int] = []
        pending = set(survivors)
        confirming = False
        while net.now - t_kill < CONVERGE_WAIT_INTERVALS * self.interval:
            views = await self.read_pass(survivors if confirming else sorted(pending))
            churn_rounds += [r for _, r in views.values()]
            incomplete = {pair for pair, (got, _) in views.items() if not live_expected[pair[1]] <= got}
            self.say(f"  {'confirming pass' if confirming else 'pass'}: {len(incomplete)} of {len(views)} "
                     f"views incomplete")
            pending = (pending - set(views)) | incomplete
            if confirming and not incomplete:
                converged_s = net.now - t_kill
                break
            confirming = not pending
            if pending:
                await net.run_until(net.now + POLL_S)

        await self.settle(t_kill + self.interval)           # every survivor has republished
        views = await self.read_pass(survivors)
        churn_rounds += [r for _, r in views.values()]
        missing = sum(len(live_expected[m] - got) for (_, m), (got, _) in views.items())
        replicas_after, record_replicas_after = self.holders()
        self.say(f"every survivor republished; {missing} surviving records missing from {len(views)} views")
        live = [node for node in net.nodes if node.alive]
        counts: dict[str, int] = {}
        for node in net.nodes:
            for name, value in node.book.counts.items():
                counts[name] = counts.get(name, 0) + value
        return {
            "nodes": n,
            "seed": cfg.seed,
            "models": self.models,
            "reads": len(pairs),
            "max_lookup_rounds": max(rounds),
            "median_lookup_rounds": sorted(rounds)[len(rounds) // 2],
            "max_lookup_rounds_after_churn": max(churn_rounds),
            "max_lookup_rounds_any": net.max_rounds,
            "round_bound": math.ceil(math.log2(n)) + 2,
            "found_fraction": round(found / wanted, 4),
            "killed_nodes": len(victims),
            "nat_nodes": sum(node.nat for node in net.nodes),
            "slow_nodes": sum(node.slow for node in net.nodes),
            "churn_converged_s": None if converged_s is None else round(converged_s, 3),
            "republish_interval_s": self.interval,
            "record_ttl_s": cfg.record_ttl_s,
            "complete_after_republish": missing == 0,
            "missing_after_republish": missing,
            "min_replicas_before": replicas_before,
            "min_replicas_after_kill": replicas_after_kill,
            "min_replicas_after_republish": replicas_after,
            "min_record_replicas_before": record_replicas_before,
            "min_record_replicas_after_republish": record_replicas_after,
            "messages": sum(net.messages.values()),
            "messages_by_kind": dict(net.messages),
            "rpcs": counts,
            "lookups": net.lookups,
            "events": net.events,
            "routing_table_min": min(len(node.table) for node in live),
            "routing_table_mean": round(sum(len(node.table) for node in live) / len(live), 1),
            "routing_table_max": max(len(node.table) for node in live),
            "connections_mean": round(sum(len(node.conns) for node in live) / len(live), 1),
            "virtual_s": round(net.now, 3),
            "trace_digest": net.trace_digest(),
        }


async def _main(clock: trio.testing.MockClock, config: SimConfig,
                progress: Callable[[str], None] | None) -> dict:
    return await _Scenario(config, progress).run(clock)


__all__ = ["SimConfig", "simulate", "identity"]
