"""Range-aware GGUF reading: the model facts, one layer range's tensors, digests.

Data flow: ``open_reader(path)`` parses the file with the bounded reader
(``gguf_file.GGUFFile``: memory-mapped, every count and offset checked);
``model_info`` reads the architecture facts through the architecture's
adapter (``gguf_arch``); ``read_range(reader, layer_range)`` returns a
``RangeTensors`` holding *views* of exactly the tensors the range needs:
``blk.N.*`` for N in the range, ``token_embd`` for the head, ``output_norm``
and ``output`` (or the tied ``token_embd``) for the tail. No tensor byte is
read until a consumer (the slice writer, the torch dequantizer) touches a view.

Whole files and slices: a file written by ``slice.write_user_slice`` (``meshd
slice``) keeps the source's metadata and block numbering but holds only the
blocks of ``meshd.slice.start..end``; ``held_range`` says which, and
``read_range`` refuses a range outside it. Its identity is the *source's*:
``model_digest`` returns the root of the manifest it carries, so a slice and
the whole file are one model artifact and route together.

State: none of its own. The file's digest is computed once and cached on
disk (``shard/model/digests.py``, keyed by path, size, mtime_ns and inode), so a
restart, a LOAD or a respawn never rehashes an unchanged file.

Identity: ``model_digest`` is the one function callers use: the Merkle root
of the model's manifest (native/gguf_manifest.py; a slice carries its
source's, checked against its bytes); ``artifact_digest`` is SHA-256 over the
whole file (what ``sha256sum`` prints), kept as a field of the manifest;
``gguf_recipe`` names backend, compute dtype, quantization and runtime
versions as a ``shard.model.artifact.Recipe`` whose digest is the recipe digest.
Both end up in the ``pb.Fingerprint`` every hop of a route must share.

Errors: a file that is not well-formed GGUF is a ``GGUFFormatError`` (an
``ArtifactError``); a range the model (or the slice) does not have is
``RangeUnavailable``.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import gguf

from native.errors import ArtifactError, RangeUnavailable
from native.gguf_arch import ARCHITECTURES, Architecture, architecture
from native.gguf_file import GGUFFile, GGUFTensor
from native.gguf_manifest import file_manifest
from shard.model import digests
from shard.model.artifact import Recipe
from shard.model.backend import LayerRange

__all__ = [
    "GGUFModelInfo", "RangeTensors", "open_reader", "model_info", "read_range", "held_range",
    "artifact_digest", "model_digest", "gguf_recipe", "size_table", "SizeTable", "SUPPORTED_ARCHITECTURES",
    "SLICE_KEYS",
]

# Bounds on what metadata may claim: shard.model.backend.LayerRange allows 4096 layers;
# widths (hidden, vocab, heads, ffn) and contexts far above any real model.
MAX_MODEL_LAYERS = 4096
MAX_WIDTH = 1 << 24
MAX_CONTEXT = 1 << 30
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# Metadata of a self-describing slice (``meshd slice``; see slice.write_user_slice).
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)
SLICE_KEYS = {"source_digest": "meshd.slice.source_digest", "start": "meshd.slice.start",
              "end": "meshd.slice.end", "num_layers": "meshd.slice.num_layers",
              "vocab_size": "meshd.slice.vocab_size", "tied": "meshd.slice.tied_embeddings",
              "layer_bytes": "meshd.slice.layer_bytes", "layer_elements": "meshd.slice.layer_elements",
              "single_bytes": "meshd.slice.single_bytes", "single_elements": "meshd.slice.single_elements"}


@dataclass(frozen=True, slots=True)
class GGUFModelInfo:
    """The model facts a backend and the planner need, read from GGUF metadata."""

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tied_embeddings: bool
    quantization: str  # e.g. "F16", "BF16", "Q8_0", "Q4_K_M", "Q4_1"
    value_head_dim: int = 0  # V head size when it differs from K's (0: same as head_dim)

    def __post_init__(self) -> None:
        for name, limit in (("num_layers", MAX_MODEL_LAYERS), ("hidden_size", MAX_WIDTH),
                            ("vocab_size", MAX_WIDTH), ("num_heads", MAX_WIDTH), ("num_kv_heads", MAX_WIDTH),
                            ("head_dim", MAX_WIDTH), ("intermediate_size", MAX_WIDTH),
                            ("context_length", MAX_CONTEXT)):
            if not 0 < getattr(self, name) <= limit:
                raise ArtifactError(f"GGUF metadata gives {name} = {getattr(self, name)} (expected 1..{limit}); "
                                    "the file is corrupt")
        if self.num_heads % self.num_kv_heads:
            raise ArtifactError("GGUF metadata: head_count is not a multiple of head_count_kv")

    @property
    def adapter(self) -> Architecture:
        return architecture(self.architecture)

    def kv_elements_per_token_layer(self) -> int:
        """K and V elements one position holds in one layer."""
        return self.num_kv_heads * (self.head_dim + (self.value_head_dim or self.head_dim))


@dataclass(frozen=True, slots=True)
class RangeTensors:
    """Memory-mapped views of the tensors one layer range needs (nothing else)."""

    info: GGUFModelInfo
    layer_range: LayerRange
    # blocks[i] maps the suffix after "blk.N." (e.g. "attn_q.weight") to its tensor,
    # for N = layer_range.start + i.
    blocks: tuple[Mapping[str, GGUFTensor], ...]
    token_embd: GGUFTensor | None   # head, or a tail whose output is tied
    output_norm: GGUFTensor | None  # tail only
    output: GGUFTensor | None       # tail with an untied output matrix

    def touched_bytes(self) -> int:
        """Bytes of tensor data this range maps (what a slice file will hold)."""
        tensors = [t for block in self.blocks for t in block.values()]
        tensors += [t for t in (self.token_embd, self.output_norm, self.output) if t is not None]
        return sum(int(t.n_bytes) for t in tensors)


def open_reader(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file read-only; a malformed file is a GGUFFormatError."""
    return GGUFFile.open(path)


def _scalar(reader: GGUFFile, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ArtifactError(f"GGUF metadata lacks required key {key!r}")
        return default
    return field.contents()


def _number(reader: GGUFFile, key: str, kind, default: Any = None):
    value = _scalar(reader, key, default)
    if isinstance(value, (list, str, bytes)):
        raise ArtifactError(f"GGUF metadata key {key!r} holds {type(value).__name__}, not a number")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ArtifactError(f"GGUF metadata key {key!r} = {value!r} is not a {kind.__name__}") from exc


def _quantization(reader: GGUFFile) -> str:
    file_type = reader.get_field("general.file_type")
    if file_type is not None and not isinstance(file_type.value, (list, str)):
        try:
            return gguf.LlamaFileType(int(file_type.value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (ValueError, TypeError):
            pass
    # No (or an unknown) file type: name it after the most common block matrix type.
    kinds = Counter(t.tensor_type.name for t in reader.tensors
                    if t.name.startswith("blk.") and len(t.shape) == 2)
    return kinds.most_common(1)[0][0] if kinds else "UNKNOWN"


def model_info(reader: GGUFFile) -> GGUFModelInfo:
    """Read the architecture facts; refuse architectures we cannot slice correctly."""
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ArtifactError("GGUF metadata general.architecture is not a string")
    adapter = architecture(arch)
    names = {t.name: t for t in reader.tensors}
    k = adapter.key
    hidden = _number(reader, k("embedding_length"), int)
    heads = _number(reader, k("attention.head_count"), int)
    embd = names.get("token_embd.weight")
    sliced = reader.get_field(SLICE_KEYS["source_digest"]) is not None
    if embd is not None:
        if len(embd.shape) != 2 or embd.shape[0] != hidden:
            raise ArtifactError(f"token_embd.weight has shape {embd.shape}, not [hidden {hidden}, vocab]")
        vocab = int(embd.shape[1])  # GGUF shapes are [ne0, ne1] = [hidden, vocab]
    elif sliced:  # a slice without the head: the source's vocabulary size is in its metadata
        vocab = _number(reader, SLICE_KEYS["vocab_size"], int)
    else:
        raise ArtifactError("GGUF file has no token_embd.weight matrix")
    tied = bool(_scalar(reader, SLICE_KEYS["tied"])) if sliced else "output.weight" not in names

    head_dim = adapter.head_dim(lambda key, d: _number(reader, key, int, d), hidden, heads)
    value_dim = _number(reader, k("attention.value_length"), int, head_dim)
    return GGUFModelInfo(
        architecture=arch,
        num_layers=_number(reader, k("block_count"), int),
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=_number(reader, k("attention.head_count_kv"), int, heads),
        head_dim=head_dim,
        intermediate_size=_number(reader, k("feed_forward_length"), int),
        rope_theta=_number(reader, k("rope.freq_base"), float, 10000.0),
        rms_norm_eps=_number(reader, k("attention.layer_norm_rms_epsilon"), float),
        context_length=_number(reader, k("context_length"), int, 2048),
        tied_embeddings=tied,
        quantization=_quantization(reader),
        value_head_dim=0 if value_dim == head_dim else value_dim,
    )


def held_range(reader: GGUFFile, info: GGUFModelInfo | None = None) -> LayerRange:
    """The layers whose blocks this file holds: all of them, or a slice's ``start..end``."""
    info = info or model_info(reader)
    if reader.get_field(SLICE_KEYS["start"]) is None:
        return LayerRange(0, info.num_layers, info.num_layers)
    start = _number(reader, SLICE_KEYS["start"], int)
    end = _number(reader, SLICE_KEYS["end"], int)
    total = _number(reader, SLICE_KEYS["num_layers"], int)
    if total != info.num_layers or not 0 <= start < end <= total:
        raise ArtifactError(f"slice metadata says layers {start}:{end} of {total}, the model has "
                            f"{info.num_layers}: the slice is corrupt")
    return LayerRange(start, end, total)


def read_range(reader: GGUFFile, layer_range: LayerRange) -> RangeTensors:
    """Select the tensors of ``layer_range`` (views into the memory map, nothing read)."""
    info = model_info(reader)
    if layer_range.num_layers != info.num_layers:
        raise RangeUnavailable(
            f"range {layer_range} names a {layer_range.num_layers}-layer model but the GGUF "
            f"file has {info.num_layers} layers"
        )
    held = held_range(reader, info)
    if not held.start <= layer_range.start < layer_range.end <= held.end:
        raise RangeUnavailable(f"range {layer_range} is not inside the layers this slice holds ({held}); "
                               f"serve a range inside {held.start}:{held.end}")
    blocks: list[dict[str, GGUFTensor]] = [{} for _ in range(layer_range.count)]
    singles: dict[str, GGUFTensor] = {}
    for tensor in reader.tensors:
        match = _BLOCK_NAME.match(tensor.name)
        if match is None:
            singles[tensor.name] = tensor
            continue
        layer = int(match.group(1))
        if layer_range.start <= layer < layer_range.end:
            blocks[layer - layer_range.start][match.group(2)] = tensor
    required = info.adapter.block_tensors
    for offset, block in enumerate(blocks):
        missing = [name for name in required if name not in block]
        if missing:
            raise ArtifactError(f"GGUF file lacks {', '.join(missing[:3])} of block {layer_range.start + offset}")
    token_embd = output_norm = output = None
    if layer_range.is_head:
        token_embd = singles["token_embd.weight"]
    if layer_range.is_tail:
        output_norm = singles.get("output_norm.weight")
        if output_norm is None:
            raise ArtifactError("GGUF file has no output_norm.weight tensor")
        output = singles.get("output.weight")
        if output is None:
            token_embd = singles["token_embd.weight"]  # tied: the embedding is the output matrix
    return RangeTensors(info, layer_range, tuple(blocks), token_embd, output_norm, output)


# The tensors outside the blocks that the planner sizes: embedding, final norm, output.
SIZED_SINGLES = ("token_embd.weight", "output_norm.weight", "output.weight")


@dataclass(frozen=True, slots=True)
class SizeTable:
    """Stored bytes and element counts per layer and of the sized singles (of the whole model)."""

    layer_bytes: tuple[int, ...]
    layer_elements: tuple[int, ...]
    single_bytes: tuple[int, ...]       # in SIZED_SINGLES order; 0 = absent
    single_elements: tuple[int, ...]


def size_table(reader: GGUFFile, info: GGUFModelInfo | None = None) -> SizeTable:
    """The model's tensor sizes: counted from the file, or (a slice) the source's, from its metadata."""
    info = info or model_info(reader)
    n = info.num_layers
    if reader.get_field(SLICE_KEYS["source_digest"]) is not None:
        parts = [reader.value(SLICE_KEYS[k]) for k in ("layer_bytes", "layer_elements", "single_bytes",
                                                         "single_elements")]
        want = (n, n, len(SIZED_SINGLES), len(SIZED_SINGLES))
        if not all(isinstance(p, list) and len(p) == w and all(isinstance(x, int) and 0 <= x < 1 << 50 for x in p)
                   for p, w in zip(parts, want)):
            raise ArtifactError("slice metadata lacks or garbles the source's tensor sizes; re-create the slice")
        return SizeTable(*(tuple(p) for p in parts))
    layer_bytes, layer_elements = [0] * n, [0] * n
    singles = {t.name: t for t in reader.tensors if t.name in SIZED_SINGLES}
    for tensor in reader.tensors:
        match = _BLOCK_NAME.match(tensor.name)
        if match is not None and int(match.group(1)) < n:
            layer_bytes[int(match.group(1))] += tensor.n_bytes
            layer_elements[int(match.group(1))] += tensor.n_elements
    return SizeTable(tuple(layer_bytes), tuple(layer_elements),
                     tuple(singles[k].n_bytes if k in singles else 0 for k in SIZED_SINGLES),
                     tuple(singles[k].n_elements if k in singles else 0 for k in SIZED_SINGLES))


def tensor_array(tensor: GGUFTensor):
    """The raw stored bytes/values of a tensor as a numpy view (no copy)."""
    return tensor.data


# The framing of the GGUF digest: the file's bytes alone (what ``sha256sum`` prints).
GGUF_SCHEME = "file-sha256"


def artifact_digest(path: str | os.PathLike[str], progress: TextIO | None = None) -> str:
    """``sha256:<hex>`` over every byte of the file, streamed with progress; cached on disk."""
    path = Path(path).resolve()
    return digests.cached_digest(GGUF_SCHEME, [path], lambda i, key: b"", label=path.name, progress=progress)


def model_digest(path: str | os.PathLike[str], progress: TextIO | None = None,
                 reader: GGUFFile | None = None) -> str:
    """The model's id: the Merkle root of its manifest (native/gguf_manifest.py).

    The one function every caller (worker backends, the daemon) uses, so a
    slice and its source always name the same model: a whole file's root is
    built from its bytes, a slice's is the manifest it carries, checked
    against every byte the slice holds (ArtifactError when one differs).
    """
    reader = reader or open_reader(path)
    if reader.get_field(SLICE_KEYS["start"]) is not None:
        held_range(reader)  # a slice's range must make sense too
    return file_manifest(path, reader, progress).root


def gguf_recipe(*, backend: str, info: GGUFModelInfo, compute_dtype: str,
                libraries: tuple[tuple[str, str], ...]) -> Recipe:
    """The recipe: backend, compute dtype, GGUF quantization and runtime versions.

    Built on shard's ``Recipe`` so GGUF and safetensors fingerprints share one
    format; the adapter names the architecture and the quantization, because a
    Q4_K_M and an F16 file of the same model compute different numbers.
    """
    return Recipe(backend=backend, dtype=compute_dtype,
                  adapter=f"gguf-{info.architecture}-{info.quantization}",
                  libraries=tuple(sorted(libraries)))
