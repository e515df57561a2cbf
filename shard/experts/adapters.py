"""Adapters for the MoE families: Qwen3-MoE and Qwen2-MoE ranges through transformers' own classes.

Both are pre-norm decoders like Llama (``shard/model/adapters.py``): the range is
built from ``Qwen3MoeDecoderLayer`` / ``Qwen2MoeDecoderLayer`` on the meta
device with local layer indices, and only the range's tensors are read. What
differs is the feed-forward of the sparse layers, and which tensors a range
owns:

* Qwen3-MoE: attention with per-head Q/K RMSNorm, a ``Qwen3MoeTopKRouter``
  (softmax, top-k, top-k weights renormalized when ``norm_topk_prob``), and
  ``Qwen3MoeExperts`` (gate/up fused, down). Dense layers
  (``mlp_only_layers``, ``decoder_sparse_step``) keep a plain MLP.
* Qwen2-MoE: Q/K/V biases, no Q/K norm, the same router (un-normalized
  top-k weights by default), plus a shared expert on every row behind a
  sigmoid gate (``shared_expert``, ``shared_expert_gate``).

Checkpoints store one tensor per expert and projection
(``model.layers.L.mlp.experts.E.gate_proj.weight``; transformers' own
loader fuses them on load). Here each held expert's tensors are read under a
staging name and ``finish_state`` stacks them into the fused parameters, so
a node that holds only some experts of a layer reads only those (a fused
checkpoint, ``...mlp.experts.gate_up_proj``, is read whole and sliced).

Which experts a range holds comes from ``configure_experts(held, exchange)``
(default: every expert of every owned layer). A sparse layer that holds all
its experts (and its shared expert), with nothing to delegate, runs
transformers' block unchanged; any other sparse layer gets ``MoeDispatch``
(shard/experts/dispatch.py), which keeps the router and the additions here and runs the
missing experts on expert peers. Experts run transformers' "eager"
implementation (the per-expert loop): it is the one an expert peer can
reproduce row for row, so delegating is bit-exact; "grouped_mm" differs in
the last bits (docs/measurements/2026-12-01.md).

Both families register themselves with the model room's registry
(shard/model/adapters.py ``register_family``) when this module is imported:
a process that loads a MoE range imports it first.
"""
from __future__ import annotations

import re

import torch
from transformers.activations import ACT2FN

from shard.experts.dispatch import ExpertExchange, MoeDispatch
from shard.experts.spec import SHARED, ExpertSpec
from shard.model.adapters import LlamaFamily, RangeModules, register_family
from shard.model.backend import LayerRange

__all__ = ["Qwen3MoeFamily", "Qwen2MoeFamily", "EXPERTS_IMPLEMENTATION", "is_moe_family", "moe_layers"]

EXPERTS_IMPLEMENTATION = "eager"
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_SHARED_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_expert\.")


def moe_layers(config) -> list[int]:
    """Global indices of the sparse layers (the rule of the families' decoder layers)."""
    only = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    if int(getattr(config, "num_experts", 0) or 0) <= 0:
        return []
    return [i for i in range(config.num_hidden_layers) if i not in only and (i + 1) % step == 0]


def is_moe_family(adapter) -> bool:
    return isinstance(adapter, _MoeFamily)


class _MoeFamily(LlamaFamily):
    has_shared_expert = False
    input_major_layers = False   # not measured on the MoE families: their layers keep nn.Linear

    def __init__(self, config) -> None:
        super().__init__(config)
        self.num_experts = int(config.num_experts)
        self.sparse = frozenset(moe_layers(config))
        self.held: ExpertSpec | None = None
        self.exchange: ExpertExchange | None = None

    # -- which experts -----------------------------------------------------------
    def configure_experts(self, held: ExpertSpec | None, exchange: ExpertExchange | None) -> None:
        """``held``: the experts this range loads (None: all of them); ``exchange``: where the rest run."""
        if held is not None:
            held.check_model(num_layers=self.config.num_hidden_layers, num_experts=self.num_experts,
                             moe_layers=self.sparse, has_shared=self.has_shared_expert)
        self.held, self.exchange = held, exchange

    def held_experts(self, layer: int) -> tuple[int, ...]:
        if self.held is None:
            return tuple(range(self.num_experts))
        return self.held.experts_of(layer)

    def shared_held(self, layer: int) -> bool:
        return self.has_shared_expert and (self.held is None or self.held.has_shared(layer))

    def delegated(self, layer_range: LayerRange) -> ExpertSpec:
        """The experts of the range's sparse layers that are not held here (what peers must serve)."""
        pairs = set()
        for layer in range(layer_range.start, layer_range.end):
            if layer in self.sparse:
                held = set(self.held_experts(layer))
                pairs.update((layer, e) for e in range(self.num_experts) if e not in held)
                if self.has_shared_expert and not self.shared_held(layer):
                    pairs.add((layer, SHARED))
        return ExpertSpec(frozenset(pairs))

    def _dispatch(self, layer: int) -> bool:
        if layer not in self.sparse:
            return False
        complete = len(self.held_experts(layer)) == self.num_experts and (
            self.shared_held(layer) or not self.has_shared_expert)
        offload = self.exchange is not None and self.exchange.prefer_remote
        return not complete or offload

    # -- which tensors -----------------------------------------------------------
    def local_names(self, key: str, layer_range: LayerRange) -> list[str]:
        for pattern in (_EXPERT_KEY, _FUSED_KEY, _SHARED_KEY):
            match = pattern.match(key)
            if match is None:
                continue
            layer = int(match.group(1))
            if not layer_range.start <= layer < layer_range.end:
                return []
            local = layer - layer_range.start
            if pattern is _EXPERT_KEY:
                expert, proj = int(match.group(2)), match.group(3)
                return [f"layers.{local}.mlp.experts.{proj}.{expert}"] if expert in self.held_experts(layer) else []
            if pattern is _FUSED_KEY:
                return [f"layers.{local}.mlp.experts.{match.group(2)}.fused"]
            return super().local_names(key, layer_range) if self.shared_held(layer) else []
        return super().local_names(key, layer_range)

    def finish_state(self, state: dict[str, torch.Tensor], layer_range: LayerRange) -> dict[str, torch.Tensor]:
        """Stack each sparse layer's held experts into ``gate_up_proj`` / ``down_proj``."""
        for layer in range(layer_range.start, layer_range.end):
            if layer not in self.sparse:
                continue
            prefix = f"layers.{layer - layer_range.start}.mlp.experts"
            held = self.held_experts(layer)
            fused_gate_up, fused_down = state.pop(f"{prefix}.gate_up_proj.fused", None), \
                state.pop(f"{prefix}.down_proj.fused", None)
            if fused_gate_up is not None and fused_down is not None:
                index = torch.tensor(held, dtype=torch.long)
                state[f"{prefix}.gate_up_proj"] = fused_gate_up.index_select(0, index).contiguous()
                state[f"{prefix}.down_proj"] = fused_down.index_select(0, index).contiguous()
                continue
            try:
                gate_up = [torch.cat([state.pop(f"{prefix}.gate.{e}"), state.pop(f"{prefix}.up.{e}")], 0)
                           for e in held]
                down = [state.pop(f"{prefix}.down.{e}") for e in held]
            except KeyError as exc:
                raise FileNotFoundError(f"the artifact lacks expert tensors of layer {layer}: {exc}") from exc
            if held:
                state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
                state[f"{prefix}.down_proj"] = torch.stack(down)
            else:   # this node holds none of the layer's routed experts
                dtype = next(iter(state.values())).dtype
                inter, hidden = self.config.moe_intermediate_size, self.config.hidden_size
                state[f"{prefix}.gate_up_proj"] = torch.empty((0, 2 * inter, hidden), dtype=dtype)
                state[f"{prefix}.down_proj"] = torch.empty((0, hidden, inter), dtype=dtype)
        return state

    # -- building ----------------------------------------------------------------
    def build(self, sub, layer_range: LayerRange) -> RangeModules:
        sub._experts_implementation = EXPERTS_IMPLEMENTATION
        # The decoder layers decide dense vs sparse from their (local) index: say it in local terms.
        sub.mlp_only_layers = [i for i in range(layer_range.count) if layer_range.start + i not in self.sparse]
        sub.decoder_sparse_step = 1
        modules = super().build(sub, layer_range)
        act_fn = ACT2FN[sub.hidden_act]
        for local, decoder in enumerate(modules.layers):
            layer = layer_range.start + local
            if not self._dispatch(layer):
                continue
            with torch.device("meta"):
                decoder.mlp = MoeDispatch(decoder.mlp, layer=layer, num_experts=self.num_experts,
                                          held=self.held_experts(layer), shared_held=self.shared_held(layer),
                                          hidden=sub.hidden_size, intermediate=sub.moe_intermediate_size,
                                          act_fn=act_fn, exchange=self.exchange)
        return modules


@register_family
class Qwen3MoeFamily(_MoeFamily):
    """Qwen3-MoE: Q/K norm, top-k router with normalized weights, routed experts."""

    MODEL_TYPES = {"qwen3_moe": "Qwen3Moe"}
    name = "qwen3-moe"


@register_family
class Qwen2MoeFamily(_MoeFamily):
    """Qwen2-MoE: Q/K/V biases, top-k router, routed experts plus a sigmoid-gated shared expert."""

    MODEL_TYPES = {"qwen2_moe": "Qwen2Moe"}
    name = "qwen2-moe"
    has_shared_expert = True
