"""Which experts of which MoE layers a node holds: ``ExpertSpec`` (pure, frozen).

Text form (``meshd join --experts``, the ``experts`` config key, ``meshd worker
--experts``): comma-separated entries ``LAYERS:EXPERTS``::

    0:E0-E7            layer 0, experts 0..7 (inclusive)
    0-3:E4-E7          layers 0..3, experts 4..7 of each
    2:E1+E5+shared     layer 2, experts 1 and 5 and the layer's shared expert
    0-3:E4-7           "E4-7" is the same as "E4-E7"

A spec is a set of (layer, expert) pairs; the shared expert of a layer is the
pair (layer, ``SHARED``) -- the same id the exchange protocol puts on the wire
for it (proto/moe/wire.py). ``str(spec)`` is canonical (one entry per run of
layers holding the same experts), so two specs are equal exactly when their
text forms are.

Bounds (a spec arrives from a config file, a CLI flag or a peer's record):
layers < ``MAX_LAYERS``, expert ids < ``MAX_EXPERTS_PER_LAYER``, at most
``MAX_SPEC_PAIRS`` pairs and ``MAX_SPEC_CHARS`` characters of text.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from proto import shard_runtime_pb2 as pb
from proto.moe.wire import MAX_EXPERTS_PER_LAYER, SHARED
from shard.model.backend import MAX_LAYERS

__all__ = ["ExpertSpec", "ExpertSpecError", "SHARED", "MAX_SPEC_PAIRS"]

# 4096 layers x 512 experts would be two million pairs; a node holds far fewer.
# 65,536 pairs is e.g. every expert of 128 layers of 512 experts.
MAX_SPEC_PAIRS = 65_536
MAX_SPEC_CHARS = 8192
_ENTRY = re.compile(r"^(\d+)(?:-(\d+))?:(.+)$")
_ITEM = re.compile(r"^E(\d+)(?:-E?(\d+))?$")


class ExpertSpecError(ValueError):
    """A spec that does not parse or names layers/experts outside the bounds (or the model)."""


@dataclass(frozen=True, slots=True)
class ExpertSpec:
    """A set of (layer, expert id) pairs; expert id ``SHARED`` names a layer's shared expert."""

    pairs: frozenset[tuple[int, int]]

    def __post_init__(self) -> None:
        if len(self.pairs) > MAX_SPEC_PAIRS:
            raise ExpertSpecError(f"{len(self.pairs)} (layer, expert) pairs > {MAX_SPEC_PAIRS}")
        for layer, eid in self.pairs:
            if not (isinstance(layer, int) and isinstance(eid, int)) or isinstance(layer, bool):
                raise ExpertSpecError("expert spec pairs are (int layer, int expert)")
            if not 0 <= layer < MAX_LAYERS:
                raise ExpertSpecError(f"layer {layer} outside 0..{MAX_LAYERS - 1}")
            if eid != SHARED and not 0 <= eid < MAX_EXPERTS_PER_LAYER:
                raise ExpertSpecError(f"expert {eid} outside 0..{MAX_EXPERTS_PER_LAYER - 1}")

    # -- building ----------------------------------------------------------------
    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> ExpertSpec:
        return cls(frozenset((int(layer), int(eid)) for layer, eid in pairs))

    @classmethod
    def parse(cls, text: str) -> ExpertSpec:
        if not isinstance(text, str) or not text.strip():
            raise ExpertSpecError("an expert spec looks like 0-3:E4-E7 (layers 0..3, experts 4..7)")
        if len(text) > MAX_SPEC_CHARS:
            raise ExpertSpecError(f"expert spec over {MAX_SPEC_CHARS} characters")
        pairs: set[tuple[int, int]] = set()
        for entry in text.replace(" ", "").split(","):
            match = _ENTRY.match(entry)
            if match is None:
                raise ExpertSpecError(f"bad entry {entry!r}: expected LAYERS:EXPERTS, e.g. 0-3:E4-E7 or 2:shared")
            first, last = int(match.group(1)), int(match.group(2) or match.group(1))
            if last < first or last >= MAX_LAYERS:
                raise ExpertSpecError(f"bad layer run {first}-{last} in {entry!r}")
            experts = _parse_experts(match.group(3), entry)
            if (last - first + 1) * len(experts) + len(pairs) > MAX_SPEC_PAIRS:
                raise ExpertSpecError(f"expert spec names more than {MAX_SPEC_PAIRS} pairs")
            pairs.update((layer, eid) for layer in range(first, last + 1) for eid in experts)
        return cls(frozenset(pairs))

    # -- reading -----------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.pairs}))

    def experts_of(self, layer: int) -> tuple[int, ...]:
        """Routed expert ids held for ``layer``, ascending (the shared expert excluded)."""
        return tuple(sorted(e for at, e in self.pairs if at == layer and e != SHARED))

    def has_shared(self, layer: int) -> bool:
        return (layer, SHARED) in self.pairs

    def restricted_to(self, layers: Iterable[int]) -> ExpertSpec:
        keep = set(layers)
        return ExpertSpec(frozenset(p for p in self.pairs if p[0] in keep))

    def __len__(self) -> int:
        return len(self.pairs)

    def __str__(self) -> str:
        runs: list[tuple[int, int, tuple[int, ...], bool]] = []
        for layer in self.layers:
            key = (self.experts_of(layer), self.has_shared(layer))
            if runs and runs[-1][1] == layer - 1 and (runs[-1][2], runs[-1][3]) == key:
                runs[-1] = (runs[-1][0], layer, *key)
            else:
                runs.append((layer, layer, *key))
        return ",".join(f"{a}-{b}:{_experts_text(e, s)}" if a != b else f"{a}:{_experts_text(e, s)}"
                        for a, b, e, s in runs)

    # -- as the runs signed records carry (pb.ExpertRun) ------------------------------------
    def to_runs(self) -> tuple[pb.ExpertRun, ...]:
        """Runs of layers holding identical experts, one run per contiguous block of expert ids."""
        out: list[pb.ExpertRun] = []
        layers = self.layers
        i = 0
        while i < len(layers):
            key = (self.experts_of(layers[i]), self.has_shared(layers[i]))
            j = i
            while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1 and \
                    (self.experts_of(layers[j + 1]), self.has_shared(layers[j + 1])) == key:
                j += 1
            experts, shared = key
            blocks = _blocks(experts)
            for n, (first, last) in enumerate(blocks):
                out.append(pb.ExpertRun(first_layer=layers[i], last_layer=layers[j], first_expert=first,
                                        last_expert=last, routed=True, shared=shared and n == 0))
            if shared and not blocks:
                out.append(pb.ExpertRun(first_layer=layers[i], last_layer=layers[j], shared=True))
            i = j + 1
        return tuple(out)

    @classmethod
    def from_runs(cls, runs) -> ExpertSpec:
        """The pairs of validated runs (bounds are the record validator's job)."""
        pairs: set[tuple[int, int]] = set()
        for run in runs:
            if (run.last_layer - run.first_layer + 1) * (run.last_expert - run.first_expert + 2) > MAX_SPEC_PAIRS:
                raise ExpertSpecError(f"expert runs name more than {MAX_SPEC_PAIRS} pairs")
            for layer in range(run.first_layer, run.last_layer + 1):
                if run.routed:
                    pairs.update((layer, e) for e in range(run.first_expert, run.last_expert + 1))
                if run.shared:
                    pairs.add((layer, SHARED))
        return cls(frozenset(pairs))

    def check_model(self, *, num_layers: int, num_experts: int, moe_layers: Iterable[int],
                    has_shared: bool) -> None:
        """Refuse pairs the model does not have (a dense layer, an expert id past the end)."""
        moe = set(moe_layers)
        for layer, eid in sorted(self.pairs):
            if layer >= num_layers:
                raise ExpertSpecError(f"layer {layer}: the model has {num_layers} layers")
            if layer not in moe:
                raise ExpertSpecError(f"layer {layer} is a dense layer of this model: it has no experts")
            if eid == SHARED and not has_shared:
                raise ExpertSpecError("this model's MoE layers have no shared expert")
            if eid != SHARED and eid >= num_experts:
                raise ExpertSpecError(f"expert {eid}: the model's MoE layers have {num_experts} experts")


def _parse_experts(text: str, entry: str) -> set[int]:
    out: set[int] = set()
    for item in text.split("+"):
        if item == "shared":
            out.add(SHARED)
            continue
        match = _ITEM.match(item)
        if match is None:
            raise ExpertSpecError(f"bad experts {item!r} in {entry!r}: expected E4, E4-E7 or shared")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first or last >= MAX_EXPERTS_PER_LAYER:
            raise ExpertSpecError(f"bad expert run {item!r} (ids are 0..{MAX_EXPERTS_PER_LAYER - 1})")
        out.update(range(first, last + 1))
    return out


def _blocks(experts) -> list[tuple[int, int]]:
    blocks: list[tuple[int, int]] = []
    for e in experts:
        if blocks and blocks[-1][1] == e - 1:
            blocks[-1] = (blocks[-1][0], e)
        else:
            blocks.append((e, e))
    return blocks


def _experts_text(experts: tuple[int, ...], shared: bool) -> str:
    parts: list[str] = []
    i = 0
    while i < len(experts):
        j = i
        while j + 1 < len(experts) and experts[j + 1] == experts[j] + 1:
            j += 1
        parts.append(f"E{experts[i]}" if i == j else f"E{experts[i]}-E{experts[j]}")
        i = j + 1
    if shared:
        parts.append("shared")
    return "+".join(parts)
