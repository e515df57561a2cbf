"""``meshd bench churn``: a real swarm loses several machines at once mid-generation; how long to heal?

    meshd bench churn [--quick] [--json]

Set-up: NODES real ``meshd join`` daemons on loopback (meshd/daemon/local_swarm.py
LocalSwarm; ``--quick``: QUICK_NODES) split the tiny seeded 6-layer Llama
(meshd/testing/models.py): three fixed ranges (the entry 0:2, then 2:4 and 4:6)
and the rest ``--layers auto`` with memory for two layers, so the tracker
spreads them coverage-first and then by redundancy.

Data flow: one long greedy generation goes through the entry's control socket
(as ``meshd generate`` does). At its KILL_AT_TOKEN-th token, KILLED daemons
(``--quick``: QUICK_KILLED), each with its worker, are SIGKILLed together:
``choose_victims`` picks every server of one layer span the entry does not
serve -- the route's hop there is among them, so the kill opens a real
coverage gap -- plus redundant peers elsewhere (never the last server of any
other layer, never a layer-0 server: the entry and the tracker stay). The
entry's driver fails over, finds no peer for the gap and waits (its refill
wait) while the dead records expire and the tracker moves an auto node into
the gap (meshd/plan/layout.py); then it re-prefills and goes on. Meanwhile a
thread of this process (``CoverageWatch``, started and joined here) polls a
survivor's ``swarm`` view -- what ``meshd status`` shows -- for full coverage
with no killed peer in it.

Reports one JSON object: ``nodes``, ``killed``, ``gap`` ([start, end)),
``tokens_equal`` (the whole generation equals the whole model's greedy tokens,
shard/model/reference.py), ``failovers``, ``coverage_restored_s`` (kill -> the
survivor's view fully covered without a killed peer; null if not within
REFILL_TIMEOUT_S), ``resume_s`` (kill -> the first token after the last
failover, by the entry's clock: monotonic, so comparable across processes on
one host; tokens already in flight at the kill still arrive before it),
``stall_s`` (the longest wait between two tokens here after the kill), ``moved_peer`` (the
survivor whose range moved onto the gap: name, peer id tail, from, to),
``error`` (the generation's, if it failed), ``start_s`` and ``total_s``.

How it behaves depends on this machine's load: that is why it is a benchmark
and not a test (tests/test_tracker_sim.py checks the same tracker logic on a
fake clock). Every wait is bounded; every daemon it starts is stopped, on
error too (their logs are kept then, and their directory named on stderr).
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from proto.errors import MeshdError

NODES = 12
KILLED = 4
QUICK_NODES = 8
QUICK_KILLED = 3   # 8 ranges over three spans: some span outside 0:2 has at most three servers
FIXED = ("0:2", "2:4", "4:6")     # the entry first: it is every other daemon's bootstrap peer
MODEL_SEED = 3                    # the tests' default seed: a long greedy answer before any stop token
KV_TOKENS = 1024
# Two layers' weights and KV with the embeddings or the head, plus one batched forward's scratch
# (tests/test_swarm_e2e.py: the tracker gives such a node two layers of the 6-layer model).
LAYERS_MEMORY = 1_100_000
# Short records: a killed node leaves everyone's map after at most this long (the tracker can only
# see a gap once the dead servers' records expire).
RECORD_TTL_S = 10.0
# The entry's refill wait (--refill-wait): a record TTL, the tracker's gap confirmations (3 x 3 s),
# a worker load and the new record's propagation; generous, so a loaded machine yields a slow
# figure rather than no figure.
REFILL_WAIT_S = 300.0
# Daemons load a model and validate it before they advertise: generous on a busy 2-core box.
START_TIMEOUT_S = 600.0
COVERED_TIMEOUT_S = 120.0
# Kill -> the survivor's view healed; past it ``coverage_restored_s`` is null.
REFILL_TIMEOUT_S = REFILL_WAIT_S + 60.0
NEW_TOKENS = 400
KILL_AT_TOKEN = 4
PROMPT = "the swarm answers"
WATCH_POLL_S = 0.25


class ChurnSetupError(MeshdError):
    """The swarm came up in a shape the benchmark cannot open a one-span gap in."""


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"churn bench: {line}", file=progress, flush=True)


# ---------------------------------------------------------------------------------------------- pure parts
def choose_victims(ads: Sequence[dict], entry_id: str, route_peers: Sequence[str],
                   killed: int) -> tuple[list[str], tuple[int, int]]:
    """``killed`` peers whose death empties one layer span the entry does not serve, and that span.

    ``ads``: the swarm view's ads (``peer_id``, ``start``, ``end``). The span: the layer with the
    fewest servers (at least two, at most ``killed``, none of them a layer-0 server) and every layer
    only they serve. The rest: peers on the route first, then those on the best-served layers, each
    only if every other layer keeps two servers (one gap only, a redundant mover left)."""
    num_layers = max(a["end"] for a in ads)
    serving = {layer: {a["peer_id"] for a in ads if a["start"] <= layer < a["end"]} for layer in range(num_layers)}
    keep = {a["peer_id"] for a in ads if a["start"] == 0} | {entry_id}   # layer-0 servers: entry, tracker
    options = [(len(serving[layer]), layer, sorted(serving[layer])) for layer in range(num_layers)
               if 2 <= len(serving[layer]) <= killed and not serving[layer] & keep]
    if not options:
        raise ChurnSetupError(f"no layer span can be emptied by {killed} kills: "
                              f"{sorted((a['start'], a['end']) for a in ads)}")
    _, _, victims = min(options)
    gap = [layer for layer in range(num_layers) if serving[layer] <= set(victims)]
    others = sorted((a for a in ads if a["peer_id"] not in keep and a["peer_id"] not in victims),
                    key=lambda a: (a["peer_id"] not in route_peers,
                                   -min(len(serving[layer]) for layer in range(a["start"], a["end"])), a["peer_id"]))
    for ad in others:
        if len(victims) == killed:
            break
        dead = set(victims) | {ad["peer_id"]}
        if all(len(serving[layer] - dead) >= 2 for layer in range(num_layers) if layer not in gap):
            victims.append(ad["peer_id"])
    if len(victims) != killed:
        raise ChurnSetupError(f"only {len(victims)} of {killed} victims leave every other layer two servers")
    return victims, (min(gap), max(gap) + 1)


def movers(before: Sequence[dict], after: Sequence[dict], gap: tuple[int, int]) -> list[dict]:
    """Survivors whose range changed onto the gap: ``{"peer_id", "from", "to"}`` each (a newcomer,
    absent from ``before``, is not a mover)."""
    old = {a["peer_id"]: (a["start"], a["end"]) for a in before}
    return [{"peer_id": a["peer_id"], "from": list(old[a["peer_id"]]), "to": [a["start"], a["end"]]}
            for a in after if a["peer_id"] in old and (a["start"], a["end"]) != old[a["peer_id"]]
            and a["start"] < gap[1] and gap[0] < a["end"]]


def healed(view: dict | None, victims: Sequence[str]) -> bool:
    """A swarm view fully covered with none of ``victims`` in it."""
    if not view or not view.get("coverage") or not view["coverage"].get("fully_covered"):
        return False
    return not {a["peer_id"] for a in view.get("ads", ())} & set(victims)


# ---------------------------------------------------------------------------------------------- edges
class CoverageWatch:
    """A thread polling ``daemon``'s swarm view from ``start()`` until it is healed or ``timeout_s``
    passed: ``healed_at`` (monotonic) and ``view``. Owned by ``run``; ``stop`` joins it."""

    def __init__(self, daemon: Any, victims: Sequence[str], timeout_s: float) -> None:
        self.daemon, self.victims, self.timeout_s = daemon, list(victims), timeout_s
        self.healed_at: float | None = None
        self.view: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="churn-coverage-watch")

    def start(self) -> None:
        self._thread.start()

    def _poll(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            view = self.daemon.swarm()
            if healed(view, self.victims):
                self.healed_at, self.view = time.monotonic(), view
                return
            self._stop.wait(WATCH_POLL_S)

    def wait(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def memory_for(model: Path) -> int:
    """An auto node's ``--memory`` (the whole node): two layers with one forward's scratch and its base."""
    from meshd.plan.footprint import artifact_footprint

    fp = artifact_footprint(model, "churn")
    return LAYERS_MEMORY + fp.scratch_bytes(KV_TOKENS, tail=True) + fp.base_bytes


def expected_tokens(model: Path, n: int) -> list[int]:
    """The whole model's greedy tokens in this process (one torch thread), cut after a stop id."""
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    tok = EntryTokenizer(model)
    tokens = WholeModel(model).generate(tok.encode_prompt(PROMPT, raw=True), n).tokens
    cut = next((i for i, t in enumerate(tokens) if t in tok.stop_ids), None)
    return list(tokens if cut is None else tokens[:cut + 1])


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    from meshd.benchmarks.daemon_runs import generate
    from meshd.daemon.local_swarm import LocalSwarm
    from meshd.testing.models import build_random_llama

    nodes, killed = (QUICK_NODES, QUICK_KILLED) if quick else (NODES, KILLED)
    t_start = time.monotonic()
    model = build_random_llama(seed=MODEL_SEED)
    expected = expected_tokens(model, NEW_TOKENS)
    if len(expected) <= 3 * KILL_AT_TOKEN:
        raise ChurnSetupError(f"the reference stops after {len(expected)} tokens: too early to kill mid-generation")
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-churn-"))
    swarm = LocalSwarm(root, model, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S,
                       extra=("--refill-wait", str(REFILL_WAIT_S)))
    watch: CoverageWatch | None = None
    ok = False
    try:
        _say(progress, f"starting {nodes} daemons ({', '.join(FIXED)} fixed, {nodes - len(FIXED)} auto)")
        entry = swarm.add(layers=FIXED[0], name="entry")
        for layers in FIXED[1:]:
            swarm.add(layers=layers)
        for _ in range(nodes - len(FIXED)):
            swarm.add(memory=memory_for(model))
        for d in swarm.daemons:
            swarm.wait_serving(d, START_TIMEOUT_S)
        before = swarm.wait_covered(COVERED_TIMEOUT_S, peers=nodes, via=entry)
        t_ready = time.monotonic()
        ranges = sorted((a["start"], a["end"]) for a in before["ads"])
        _say(progress, f"covered after {t_ready - t_start:.1f} s: ranges {ranges}, "
                       f"counts {before['coverage']['counts']}")

        warm = generate(entry, PROMPT, 8)
        route_peers = [hop.split(":")[0] for hop in warm["route"]]
        victims, gap = choose_victims(before["ads"], before["peer_id"], route_peers, killed)
        by_peer = {(d.swarm() or {}).get("peer_id"): d for d in swarm.daemons}
        doomed = [by_peer[p] for p in victims]
        survivors = [d for d in swarm.daemons if d not in doomed]
        observer = next(d for d in survivors if d is not entry)   # a survivor other than the entry
        watch = watcher = CoverageWatch(observer, victims, REFILL_TIMEOUT_S)
        _say(progress, f"route {warm['route']}; killing {[d.name for d in doomed]} at token {KILL_AT_TOKEN} "
                       f"(gap {gap[0]}:{gap[1]}); watching via {observer.name}")

        killed_at: list[float] = []
        token_times: list[float] = []

        def on_token(count: int) -> None:
            token_times.append(time.monotonic())
            if count == KILL_AT_TOKEN and not killed_at:
                pids = [pid for d in doomed for pid in d.worker_pids()]
                killed_at.append(time.monotonic())
                for pid in pids:   # every machine at once: SIGKILL each worker and daemon, then reap
                    _sigkill(pid)
                for d in doomed:
                    _sigkill(d.proc.pid)
                for d in doomed:
                    d.kill()
                watcher.start()

        done: dict | None = None
        error = None
        try:
            done = generate(entry, PROMPT, NEW_TOKENS, on_token=on_token)
        except (MeshdError, RuntimeError) as exc:
            error = str(exc)[:500]
        _say(progress, f"generation ended: {error or 'done'}; waiting for the survivor's view")
        if killed_at:
            watcher.wait(max(0.0, killed_at[0] + REFILL_TIMEOUT_S - time.monotonic()) + 1.0)
        watcher.stop()
        moved = movers(before["ads"], watcher.view["ads"], gap) if watcher.view else []
        names = {(d.swarm() or {}).get("peer_id"): d.name for d in survivors}
        after_kill = [t for t in token_times if killed_at and t > killed_at[0]]
        resumed = [f["next_token_at"] for f in (done or {}).get("failovers", ()) if f.get("next_token_at")]
        result = {
            "nodes": nodes, "killed": killed, "gap": list(gap),
            "tokens_equal": done is not None and done["tokens"] == expected,
            "failovers": len(done["failovers"]) if done else None,
            "coverage_restored_s": round(watcher.healed_at - killed_at[0], 1)
            if killed_at and watcher.healed_at else None,
            "resume_s": round(max(resumed) - killed_at[0], 1) if killed_at and resumed else None,
            "stall_s": round(max(b - a for a, b in zip([killed_at[0], *after_kill], after_kill)), 1)
            if after_kill else None,
            "moved_peer": {"name": names.get(moved[0]["peer_id"]), "peer_id": moved[0]["peer_id"][-8:],
                           "from": moved[0]["from"], "to": moved[0]["to"]} if moved else None,
            "error": error, "new_tokens": len(done["tokens"]) if done else None,
            "counts_before": before["coverage"]["counts"],
            "counts_after": watcher.view["coverage"]["counts"] if watcher.view else None,
            "record_ttl_s": RECORD_TTL_S, "refill_wait_s": REFILL_WAIT_S,
            "start_s": round(t_ready - t_start, 1), "total_s": round(time.monotonic() - t_start, 1),
        }
        ok = True
        return result
    finally:
        if watch is not None:
            watch.stop()
        _say(progress, "stopping the daemons")
        swarm.close()
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            _say(progress, f"daemon logs kept in {root}")


def _sigkill(pid: int) -> None:
    import os
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
