"""Range-aware GGUF reading: the model facts, one layer range's tensors, digests.

Data flow: ``read_range(path, layer_range)`` opens the file with
``gguf.GGUFReader`` (a read-only ``np.memmap``: parsing the header touches
only the header pages), checks the architecture and the range, and returns a
``RangeTensors`` holding *views* of exactly the tensors the range needs:
``blk.N.*`` for N in the range, ``token_embd`` for the head, ``output_norm``
and ``output`` (or the tied ``token_embd``) for the tail. No tensor byte is
read until a consumer (the slice writer, the torch dequantizer) touches a view.

State: none beyond a per-process digest memo keyed by (path, size, mtime), so
a worker that opens the same file twice hashes it once.

Identity: ``artifact_digest`` is SHA-256 over the whole file (what
``sha256sum`` prints), streamed with progress; ``gguf_recipe`` names backend,
compute dtype, quantization and runtime versions as a ``shard.artifact.Recipe``
whose digest is the recipe digest. Both end up in the ``pb.Fingerprint``
every hop of a route must share.

Errors: a file gguf cannot parse (truncated, corrupt, not GGUF) is an
``ArtifactError``; a range the model does not have is ``RangeUnavailable``.
"""
from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TextIO

import gguf
import numpy as np

from native.errors import ArtifactError, RangeUnavailable
from shard.artifact import Recipe
from shard.backend import LayerRange

__all__ = [
    "GGUFModelInfo", "RangeTensors", "open_reader", "model_info", "read_range",
    "artifact_digest", "gguf_recipe", "SUPPORTED_ARCHITECTURES",
]

# Architectures whose GGUF tensor layout we know how to slice and to map back
# to HF names; anything else is refused up front rather than run wrongly.
# qwen3moe: Qwen3-MoE, its experts stacked per block (blk.N.ffn_*_exps), so they travel with their layer.
SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen3moe"})
# Hash in 8 MiB reads: large enough that Python overhead vanishes next to
# SHA-256 (~1 GB/s), small enough to keep the worker's RSS flat.
HASH_CHUNK_BYTES = 8 << 20
# One progress line per this many bytes hashed (a 1 GB file prints ~4 lines).
HASH_PROGRESS_BYTES = 256 << 20
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


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

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "vocab_size", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "context_length"):
            if getattr(self, name) <= 0:
                raise ArtifactError(f"GGUF metadata gives {name} = {getattr(self, name)}; the file is corrupt")
        if self.num_heads % self.num_kv_heads:
            raise ArtifactError("GGUF metadata: head_count is not a multiple of head_count_kv")


@dataclass(frozen=True, slots=True)
class RangeTensors:
    """Memory-mapped views of the tensors one layer range needs (nothing else)."""

    info: GGUFModelInfo
    layer_range: LayerRange
    # blocks[i] maps the suffix after "blk.N." (e.g. "attn_q.weight") to its tensor,
    # for N = layer_range.start + i.
    blocks: tuple[Mapping[str, gguf.ReaderTensor], ...]
    token_embd: gguf.ReaderTensor | None   # head, or a tail whose output is tied
    output_norm: gguf.ReaderTensor | None  # tail only
    output: gguf.ReaderTensor | None       # tail with an untied output matrix

    def touched_bytes(self) -> int:
        """Bytes of tensor data this range maps (what a slice file will hold)."""
        tensors = [t for block in self.blocks for t in block.values()]
        tensors += [t for t in (self.token_embd, self.output_norm, self.output) if t is not None]
        return sum(int(t.n_bytes) for t in tensors)


def open_reader(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """Open a GGUF file read-only; a file gguf cannot parse is an ArtifactError."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError,
            OSError) as exc:
        size = path.stat().st_size
        raise ArtifactError(
            f"{path} ({size} bytes) is not a readable GGUF file: {exc}. It is truncated or "
            "corrupt; re-create or re-download it"
        ) from exc


def _scalar(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ArtifactError(f"GGUF metadata lacks required key {key!r}")
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"GGUF metadata key {key!r} is unreadable") from exc


def _quantization(reader: gguf.GGUFReader) -> str:
    file_type = reader.get_field("general.file_type")
    if file_type is not None:
        try:
            return gguf.LlamaFileType(int(file_type.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    # No (or an unknown) file type: name it after the most common block matrix type.
    kinds = Counter(t.tensor_type.name for t in reader.tensors
                    if t.name.startswith("blk.") and len(t.shape) == 2)
    return kinds.most_common(1)[0][0] if kinds else "UNKNOWN"


def model_info(reader: gguf.GGUFReader) -> GGUFModelInfo:
    """Read the architecture facts; refuse architectures we cannot slice correctly."""
    arch = str(_scalar(reader, "general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(
            f"GGUF architecture {arch!r} is not supported by meshd's GGUF path "
            f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    names = {t.name: t for t in reader.tensors}
    embd = names.get("token_embd.weight")
    if embd is None:
        raise ArtifactError("GGUF file has no token_embd.weight tensor")
    hidden = int(_scalar(reader, f"{arch}.embedding_length"))
    heads = int(_scalar(reader, f"{arch}.attention.head_count"))
    vocab = int(embd.shape[1])  # GGUF shapes are [ne0, ne1] = [hidden, vocab]
    return GGUFModelInfo(
        architecture=arch,
        num_layers=int(_scalar(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=int(_scalar(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_scalar(reader, f"{arch}.rope.dimension_count", hidden // max(heads, 1))),
        intermediate_size=int(_scalar(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(_scalar(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_scalar(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(_scalar(reader, f"{arch}.context_length", 2048)),
        tied_embeddings="output.weight" not in names,
        quantization=_quantization(reader),
    )


def read_range(reader: gguf.GGUFReader, layer_range: LayerRange) -> RangeTensors:
    """Select the tensors of ``layer_range`` (views into the memory map, nothing read)."""
    info = model_info(reader)
    if layer_range.num_layers != info.num_layers:
        raise RangeUnavailable(
            f"range {layer_range} names a {layer_range.num_layers}-layer model but the GGUF "
            f"file has {info.num_layers} layers"
        )
    blocks: list[dict[str, gguf.ReaderTensor]] = [{} for _ in range(layer_range.count)]
    singles: dict[str, gguf.ReaderTensor] = {}
    for tensor in reader.tensors:
        match = _BLOCK_NAME.match(tensor.name)
        if match is None:
            singles[tensor.name] = tensor
            continue
        layer = int(match.group(1))
        if layer_range.start <= layer < layer_range.end:
            blocks[layer - layer_range.start][match.group(2)] = tensor
    for offset, block in enumerate(blocks):
        if "attn_norm.weight" not in block or not ({"ffn_down.weight", "ffn_down_exps.weight"} & block.keys()):
            raise ArtifactError(f"GGUF file lacks the tensors of block {layer_range.start + offset}")
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


def tensor_array(tensor: gguf.ReaderTensor) -> np.ndarray:
    """The raw stored bytes/values of a tensor as a numpy view (no copy)."""
    return tensor.data


_DIGEST_MEMO: dict[tuple[str, int, int], str] = {}


def artifact_digest(path: str | os.PathLike[str], progress: TextIO | None = None) -> str:
    """``sha256:<hex>`` over every byte of the file, streamed; memoised per process."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key in _DIGEST_MEMO:
        return _DIGEST_MEMO[key]
    digest = hashlib.sha256()
    done = next_report = 0
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None and done >= next_report:
                print(f"[meshd gguf] hashing {path.name}: {done * 100 // max(stat.st_size, 1)}%",
                      file=progress, flush=True)
                next_report = done + HASH_PROGRESS_BYTES
    value = "sha256:" + digest.hexdigest()
    _DIGEST_MEMO[key] = value
    return value


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
