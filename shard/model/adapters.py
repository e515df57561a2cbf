"""Architecture adapters: how one family's layer range is built, loaded and run.

An adapter knows, for one architecture family, (1) which artifact tensors a
range needs (head: token embedding; layers; tail: final norm + LM head, with
tied embeddings read from the embedding tensor), (2) how to build the range's
modules with transformers' *own* classes on the meta device with local layer
indices, and (3) the forward pieces: embed, run the owned decoder layers over
a session cache, and turn the final residual into logits.

The ops and their order are those of the family's whole-model forward in
transformers 5.23 (``LlamaModel.forward``, ``Gemma3TextModel.forward``), so a
split run reproduces the whole model bit for bit on the same dtype.

Families:
* ``LlamaFamily``: llama, mistral, qwen2, qwen3 (their ``*DecoderLayer``,
  ``*RMSNorm``, ``*RotaryEmbedding``); optional sliding-window layers.
* ``Gemma3Family``: gemma3_text: embeddings scaled by sqrt(hidden), (1 + w)
  RMSNorm, per-layer-type rotary bases, sliding/full masks, final logit
  softcap.
* ``Qwen3MoeFamily`` / ``Qwen2MoeFamily`` (shard/experts/adapters.py): sparse MoE
  layers (router, top-k, experts; Qwen2-MoE's gated shared expert), ranges
  that hold only some experts and delegate the rest to expert peers.

Registry: a family registers itself where it is defined (``@register_family``)
and ``adapter_for`` looks it up by ``config.model_type``. This room never
imports the rooms that extend it: the MoE families register when
shard/experts/adapters.py is imported, which every process that loads a
MoE range does first (the worker, the expert peer).
"""
from __future__ import annotations

import copy
import importlib
from typing import TypeVar

import torch
from torch import nn

from shard.model.backend import LayerRange

ATTN_IMPLEMENTATION = "sdpa"


class UnsupportedArchitecture(ValueError):
    """The artifact's model_type has no adapter; the message lists the supported ones."""


class InputMajorLinear(nn.Module):
    """A dense projection with its weight stored input-major: ``weight_t`` [in, out], contiguous, and
    ``forward(x) = x @ weight_t (+ bias)`` (the product of ``nn.Linear`` with weight ``weight_t.T``).

    Why: with one thread, torch 2.13's CPU ``linear`` goes row by row below 4 rows, so ``x @
    weight_t`` is faster for 1-3 rows (about twice over SmolLM2's LM head) and a little slower from
    4 (docs/measurements/2026-12-06.md, 2026-12-07.md). A decode forward holds one row per session
    and a worker batches 1-3 sessions' rows most of the time, so both the lone step and the usual
    batch get cheaper. Every range (whole model and split alike, and the transformers reference) runs
    the same layout, so a split model's logits stay the whole model's bit for bit."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear) -> InputMajorLinear:
        """The same projection as ``linear``, input-major (one transposed copy of its weight)."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.weight.detach().t().contiguous(), bias)

    @property
    def in_features(self) -> int:
        return self.weight_t.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight_t.shape[1]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.weight_t
        return out if self.bias is None else out + self.bias


# The dense projections of a decoder layer that run input-major (``input_major_layers``).
DENSE_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                     ("mlp", ("gate_proj", "up_proj", "down_proj")))


def input_major_layers(layers) -> None:
    """Swap every decoder layer's dense ``nn.Linear`` projections for ``InputMajorLinear`` in place,
    one at a time (the old weight is freed as its copy replaces it)."""
    for layer in layers:
        for part, names in DENSE_PROJECTIONS:
            parent = getattr(layer, part, None)
            for name in names:
                linear = getattr(parent, name, None)
                if type(linear) is nn.Linear:
                    setattr(parent, name, InputMajorLinear.of(linear))


class ColumnEmbedding(nn.Module):
    """Tied token embeddings read from an ``InputMajorLinear`` head's weight: token i is column i (the
    same values as the row-major table, one copy of the tensor for both). The strided gather is
    slower than a row-major one, but nothing beside a prefill's forward
    (docs/measurements/2026-12-06.md)."""

    def __init__(self, weight_t: nn.Parameter) -> None:
        super().__init__()
        self.weight_t = weight_t

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight_t.t())


class RangeModules(nn.Module):
    """The modules one range owns (head/tail parts are None when not owned).

    Parameter names are local: ``embed.weight``, ``layers.<local>.…``,
    ``norm.weight``, ``lm_head.weight``.
    """

    def __init__(self, embed, layers, rotary, norm, lm_head):
        super().__init__()
        self.embed = embed
        self.layers = layers
        self.rotary = rotary
        self.norm = norm
        self.lm_head = lm_head


def range_config(config, layer_range: LayerRange):
    """A copy of ``config`` describing only the owned layers (local indices)."""
    sub = copy.deepcopy(config)
    layer_types = getattr(config, "layer_types", None)
    sub.num_hidden_layers = layer_range.count
    if layer_types is not None:
        sub.layer_types = list(layer_types[layer_range.start:layer_range.end])
    sub._attn_implementation = ATTN_IMPLEMENTATION
    return sub


# Model families by the model types they serve, in registration order (see the module doc).
_FAMILIES: list[type[LlamaFamily]] = []
_F = TypeVar("_F", bound="type[LlamaFamily]")


def register_family(family: _F) -> _F:
    """Class decorator: ``adapter_for`` answers ``family`` for each of its ``MODEL_TYPES``.
    A model type that another family already serves is our own bug (ValueError)."""
    for other in _FAMILIES:
        taken = set(other.MODEL_TYPES) & set(family.MODEL_TYPES)
        if other is not family and taken:
            raise ValueError(f"{family.__name__} and {other.__name__} both serve {sorted(taken)}")
    if family not in _FAMILIES:
        _FAMILIES.append(family)
    return family


@register_family
class LlamaFamily:
    """Llama, Mistral, Qwen2, Qwen3: pre-norm decoder, plain embedding, one rotary."""

    MODEL_TYPES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    name = "llama-family"

    def __init__(self, config):
        self.config = config
        prefix = self.MODEL_TYPES[config.model_type]
        module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        self.decoder_layer_cls = getattr(module, f"{prefix}DecoderLayer")
        self.norm_cls = getattr(module, f"{prefix}RMSNorm")
        self.rotary_cls = getattr(module, f"{prefix}RotaryEmbedding")
        self.adapter_name = f"{config.model_type}"

    # -- which tensors ---------------------------------------------------
    def local_names(self, key: str, layer_range: LayerRange) -> list[str]:
        """Where artifact tensor ``key`` goes in this range ([] = not ours).

        A tied LM head reads the embedding tensor, so one key may fill two
        local parameters (they then share storage).
        """
        tied = bool(self.config.tie_word_embeddings)
        if key == "model.embed_tokens.weight":
            return (["embed.weight"] if layer_range.is_head else []) + (
                ["lm_head.weight"] if layer_range.is_tail and tied else [])
        if key == "lm_head.weight":
            return ["lm_head.weight"] if layer_range.is_tail and not tied else []
        if key == "model.norm.weight":
            return ["norm.weight"] if layer_range.is_tail else []
        if key.startswith("model.layers."):
            index_text, _, rest = key[len("model.layers."):].partition(".")
            if index_text.isdigit() and layer_range.start <= int(index_text) < layer_range.end:
                return [f"layers.{int(index_text) - layer_range.start}.{rest}"]
        return []

    # -- building ----------------------------------------------------------
    def _embedding(self, sub) -> nn.Module:
        return nn.Embedding(sub.vocab_size, sub.hidden_size, getattr(sub, "pad_token_id", None))

    def build(self, sub, layer_range: LayerRange) -> RangeModules:
        """Modules on the meta device (no memory); rotary built for real on CPU."""
        with torch.device("meta"):
            embed = self._embedding(sub) if layer_range.is_head else None
            layers = nn.ModuleList([self.decoder_layer_cls(sub, i) for i in range(layer_range.count)])
            norm = self.norm_cls(sub.hidden_size, eps=sub.rms_norm_eps) if layer_range.is_tail else None
            lm_head = nn.Linear(sub.hidden_size, sub.vocab_size, bias=False) if layer_range.is_tail else None
        # Rotary tables are computed, not loaded: never build them on meta.
        rotary = self.rotary_cls(sub)
        return RangeModules(embed=embed, layers=layers, rotary=rotary, norm=norm, lm_head=lm_head)

    def finish_embedding(self, embed: nn.Module) -> None:
        """Fix up non-persistent buffers after weights were assigned (none here)."""

    # The LM head runs input-major (``InputMajorLinear``) in families whose embedding is a plain table.
    input_major_head = True
    # The decoder layers' dense projections run input-major (``input_major_layers``).
    input_major_layers = True

    def apply_layout(self, layers, lm_head: nn.Module | None) -> nn.Module | None:
        """This family's compute layout: its layers' projections swapped in place, and the LM head
        to use (``InputMajorLinear`` where the family runs it input-major). The ranges and the
        transformers reference (shard/model/reference.py) both go through here, so they compute alike."""
        if self.input_major_layers:
            input_major_layers(layers)
        if self.input_major_head and type(lm_head) is nn.Linear:
            return InputMajorLinear.of(lm_head)
        return lm_head

    def finish_modules(self, modules: RangeModules) -> None:
        """After the weights are assigned: the embedding's buffers, then the layout (``apply_layout``).
        A tied head whose range also holds the embedding keeps one tensor: the embedding reads its
        columns. Callers drop their own references to the loaded tensors first, so that each swap
        frees the tensor it copies (peak: the weights plus one matrix)."""
        if modules.embed is not None:
            self.finish_embedding(modules.embed)
        head = modules.lm_head
        tied = (head is not None and modules.embed is not None
                and modules.embed.weight.data_ptr() == head.weight.data_ptr())
        modules.lm_head = self.apply_layout(modules.layers, head)
        if tied and modules.lm_head is not head:
            modules.embed = ColumnEmbedding(modules.lm_head.weight_t)

    def finish_state(self, state: dict[str, torch.Tensor], layer_range: LayerRange) -> dict[str, torch.Tensor]:
        """Turn what ``local_names`` staged into the modules' parameters (identity here;
        the MoE families stack per-expert tensors)."""
        return state

    # -- forward pieces ------------------------------------------------------
    def embed(self, modules: RangeModules, ids: torch.Tensor) -> torch.Tensor:
        return modules.embed(ids)

    def _masks(self, sub, hidden, cache, position_ids, skip: int) -> dict[str, object]:
        """One mask per layer type among the layers run (``skip`` = leading layers not run).

        ``layer_idx`` names the first run layer of each type, so mask sizes come
        from a cache layer this session actually fills.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(config=sub, inputs_embeds=hidden, attention_mask=None,
                      past_key_values=cache, position_ids=position_ids)
        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks: dict[str, object] = {}
        for index, layer_type in enumerate(self._layer_types(sub)):
            if index >= skip and layer_type not in masks:
                masks[layer_type] = makers[layer_type](**kwargs, layer_idx=index)
        return masks

    def _layer_types(self, sub) -> list[str]:
        return list(getattr(sub, "layer_types", None) or ["full_attention"] * sub.num_hidden_layers)

    def run_layers(self, sub, modules: RangeModules, hidden, cache, position_ids, skip: int = 0):
        """Run owned layers ``skip..`` (local indices) over ``cache``; returns the residual."""
        masks = self._masks(sub, hidden, cache, position_ids, skip)
        position_embeddings = modules.rotary(hidden, position_ids=position_ids)
        types = self._layer_types(sub)
        for layer, layer_type in zip(modules.layers[skip:], types[skip:]):
            hidden = layer(
                hidden,
                attention_mask=masks[layer_type],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
        return hidden

    def logits(self, modules: RangeModules, hidden: torch.Tensor, *, every: bool = False) -> torch.Tensor:
        # Norm over every position, then the head on the last one: the order of
        # XForCausalLM.forward(logits_to_keep=1). ``every``: the head on every position (a verify step).
        hidden = modules.norm(hidden)
        return modules.lm_head(hidden if every else hidden[:, -1:, :])


@register_family
class Gemma3Family(LlamaFamily):
    """Gemma 3 text: scaled embedding, (1 + w) norms, two rotary bases, softcap."""

    MODEL_TYPES = {"gemma3_text": "Gemma3"}
    name = "gemma3"
    input_major_head = False   # its embedding is scaled (a module of its own): the head stays nn.Linear
    input_major_layers = False  # not measured on Gemma 3: its layers keep nn.Linear

    def __init__(self, config):
        self.config = config
        from transformers.models.gemma3 import modeling_gemma3 as m

        self.m = m
        self.decoder_layer_cls = m.Gemma3DecoderLayer
        self.norm_cls = m.Gemma3RMSNorm
        self.rotary_cls = m.Gemma3RotaryEmbedding
        self.adapter_name = "gemma3_text"

    def _embedding(self, sub) -> nn.Module:
        return self.m.Gemma3TextScaledWordEmbedding(
            sub.vocab_size, sub.hidden_size, sub.pad_token_id, embed_scale=sub.hidden_size**0.5
        )

    def finish_embedding(self, embed: nn.Module) -> None:
        # The scale is a non-persistent buffer left on the meta device.
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale)

    def run_layers(self, sub, modules: RangeModules, hidden, cache, position_ids, skip: int = 0):
        masks = self._masks(sub, hidden, cache, position_ids, skip)
        types = self._layer_types(sub)
        position_embeddings = {t: modules.rotary(hidden, position_ids, t) for t in set(types[skip:])}
        for layer, layer_type in zip(modules.layers[skip:], types[skip:]):
            hidden = layer(
                hidden,
                attention_mask=masks[layer_type],
                position_embeddings=position_embeddings[layer_type],
                position_ids=position_ids,
                past_key_values=cache,
            )
        return hidden

    def logits(self, modules: RangeModules, hidden: torch.Tensor, *, every: bool = False) -> torch.Tensor:
        logits = super().logits(modules, hidden, every=every)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def adapter_for(config) -> LlamaFamily:
    """The adapter of the registered family for ``config.model_type``, or UnsupportedArchitecture."""
    for family in _FAMILIES:
        if config.model_type in family.MODEL_TYPES:
            return family(config)
    supported = sorted(t for f in _FAMILIES for t in f.MODEL_TYPES)
    raise UnsupportedArchitecture(
        f"model_type {config.model_type!r} is not supported; supported: {supported} (the MoE families "
        "qwen3_moe and qwen2_moe register when shard.experts.adapters is imported)")
