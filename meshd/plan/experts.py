"""Pure planning over expert placements: specs <-> record runs, coverage, who serves what.

* ``runs_of(spec)`` / ``spec_of(record)``: an ``ExpertSpec`` (shard) as the
  runs an expert record carries (dht/expert_records.py) and back.
* ``placements(records, recipe=..., now_ms=...)``: the live expert records of
  one model that a holder can use (same recipe digest -- the numerics --,
  a protocol version and act we speak) as ``shard.experts.pool.Placement``s,
  which is what the holder's worker reads (the daemon writes them to its
  placement file).
* ``coverage(records)``: how many live peers serve each (layer, expert);
  ``demand(capability records)``: the experts holders say they need.
* ``plan_experts(...)``: the experts a joining expert peer should take with
  its declared memory: coverage first (experts nobody serves, then the least
  served), whole layers' blocks kept together, sized to ``memory_bytes``.

No I/O, no clock: callers pass ``now_ms``.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from dht.expert_records import ExpertRecord
from proto import moe as W
from proto import shard_runtime_pb2 as pb
from shard.experts.pool import Placement
from shard.experts.spec import SHARED, ExpertSpec

__all__ = ["runs_of", "spec_of", "demand", "placements", "coverage", "plan_experts", "ExpertFootprint"]


def runs_of(spec: ExpertSpec) -> tuple[pb.ExpertRun, ...]:
    return spec.to_runs()


def spec_of(record: ExpertRecord) -> ExpertSpec:
    return ExpertSpec(record.pairs(SHARED))


def demand(capabilities: Iterable, now_ms: int) -> ExpertSpec:
    """The experts live holders need from expert peers (``delegated_experts`` of their records)."""
    pairs: set[tuple[int, int]] = set()
    for rec in capabilities:
        if not rec.withdrawn and not rec.expired(now_ms):
            pairs |= ExpertSpec.from_runs(rec.payload.delegated_experts).pairs
    return ExpertSpec(frozenset(pairs))


def placements(records: Iterable[ExpertRecord], *, recipe: str, now_ms: int,
               version: int = W.VERSION_ROWS_ONCE, act: int = W.ACT_F32,
               exclude: Iterable[str] = ()) -> list[Placement]:
    """The usable expert peers of one model for a holder speaking ``version`` / ``act``."""
    skip = set(exclude)
    out = []
    for rec in records:
        p = rec.payload
        if rec.withdrawn or rec.expired(now_ms) or rec.peer_id in skip or p.runtime_recipe_digest != recipe:
            continue
        if version not in p.protocol_versions or act not in p.acts:
            continue
        host, _, port = p.endpoint.rpartition(":")
        out.append(Placement(rec.peer_id, host.strip("[]"), int(port), bytes(p.tls_cert_sha256), spec_of(rec)))
    return sorted(out, key=lambda pl: pl.peer_id)


def coverage(records: Iterable[ExpertRecord], now_ms: int) -> Counter:
    """(layer, expert) -> how many live expert peers serve it."""
    counts: Counter = Counter()
    for rec in records:
        if not rec.withdrawn and not rec.expired(now_ms):
            counts.update(rec.pairs(SHARED))
    return counts


@dataclass(frozen=True, slots=True)
class ExpertFootprint:
    """What one expert costs to hold, and which experts the model has."""

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    has_shared: bool
    routed_bytes: int           # one routed expert's weights
    shared_bytes: int = 0       # one shared expert's weights

    def all_pairs(self) -> list[tuple[int, int]]:
        pairs = [(layer, e) for layer in self.moe_layers for e in range(self.num_experts)]
        if self.has_shared:
            pairs += [(layer, SHARED) for layer in self.moe_layers]
        return pairs

    def cost(self, expert: int) -> int:
        return self.shared_bytes if expert == SHARED else self.routed_bytes


def plan_experts(footprint: ExpertFootprint, counts: Counter, memory_bytes: int, *,
                 needed: ExpertSpec | None = None) -> ExpertSpec:
    """The experts to take with ``memory_bytes``: least served first (``needed`` ones before the rest),
    then layer by layer in id order, so the result is a few compact runs. Empty when nothing fits."""
    want = set(needed.pairs) if needed is not None else set()
    order = sorted(footprint.all_pairs(),
                   key=lambda p: (p not in want, counts.get(p, 0), p[0], p[1] == SHARED, p[1]))
    taken: list[tuple[int, int]] = []
    left = memory_bytes
    for pair in order:
        cost = footprint.cost(pair[1])
        if cost <= left:
            taken.append(pair)
            left -= cost
    return ExpertSpec(frozenset(taken))
