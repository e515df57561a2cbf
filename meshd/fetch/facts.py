"""Model facts of a node that holds only a manifest: layers, context, footprint, a range's entries.

A node started with ``--model ROOT`` plans (``--layers auto``), sizes its
range and asks the tracker before it holds one tensor. Everything it needs
is in the manifest and its BLOB entries, already checked against the root:

    GGUF          the metadata blob -> metadata pairs -> a GGUFFile with no bytes
                  (native/gguf_manifest.virtual_reader): model_info, size_table,
                  the footprint and the range's tensors read it as they read a file
    safetensors   config.json (a BLOB) and the manifest's tensor shapes

Pure: values in, values out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshd.errors import ConfigError
from meshd.plan.assignment import ModelFootprint
from meshd.plan.footprint import footprint_of_config, gguf_footprint_of
from shard.model.backend import LayerRange
from shard.model.manifest import BLOB, KIND_GGUF, TENSOR, Manifest

__all__ = ["ModelFacts", "model_facts", "footprint", "range_entries", "meta_entries"]

# config.json of a real model is a few KiB.
MAX_CONFIG_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ModelFacts:
    kind: int
    num_layers: int
    context_tokens: int
    reader: Any = None          # GGUF: the virtual reader (native.gguf_file.GGUFFile)
    config: dict | None = None  # safetensors: config.json


def meta_entries(manifest: Manifest) -> list[int]:
    """The BLOB entries: what every node of the model fetches first (the metadata)."""
    return [i for i, e in enumerate(manifest.entries) if e.kind == BLOB]


def model_facts(manifest: Manifest, meta: dict[int, bytes]) -> ModelFacts:
    """The facts of the model from its manifest and its (checked) BLOB entries."""
    if manifest.kind == KIND_GGUF:
        from native.errors import ArtifactError
        from native.gguf_manifest import METADATA_ENTRY, metadata_of, virtual_reader
        from native.gguf_range import model_info

        try:
            fields = metadata_of(manifest, meta[manifest.index(METADATA_ENTRY)])
            reader = virtual_reader(manifest, fields)
            info = model_info(reader)
        except (ArtifactError, KeyError) as exc:
            raise ConfigError(f"the model's metadata is unusable: {exc}") from exc
        return ModelFacts(KIND_GGUF, info.num_layers, info.context_length, reader=reader)
    if not manifest.has("config.json"):
        raise ConfigError("the model has no config.json")
    raw = meta[manifest.index("config.json")]
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("the model's config.json is too large")
    try:
        config = json.loads(raw)
        text = config.get("text_config") or config
        layers = int(text["num_hidden_layers"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError("the model's config.json does not say num_hidden_layers") from exc
    context = text.get("max_position_embeddings")
    return ModelFacts(manifest.kind, layers, context if isinstance(context, int) and context > 0 else 0,
                      config=config)


def footprint(facts: ModelFacts, manifest: Manifest, backend: str, dtype: str) -> ModelFootprint:
    if facts.reader is not None:
        return gguf_footprint_of(facts.reader, manifest.root, backend, dtype)
    shapes = {e.name: list(e.shape) for e in manifest.entries if e.kind == TENSOR}
    return footprint_of_config(facts.config or {}, shapes, manifest.root, dtype)


def range_entries(manifest: Manifest, facts: ModelFacts, layer_range: LayerRange) -> list[int]:
    """The TENSOR entries ``layer_range`` needs, in manifest order."""
    if facts.reader is not None:
        from native.gguf_manifest import range_names

        names = range_names([e.name for e in manifest.entries if e.kind == TENSOR], layer_range)
    else:
        from shard.model.st_manifest import range_names as st_names

        names = st_names(manifest, facts.config or {}, layer_range)
    return [manifest.index(n) for n in names]
