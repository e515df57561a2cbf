"""Per-range GGUF slices: a small standalone GGUF that llama.cpp loads as a model.

Data flow: ``slice_path(source, layer_range)`` returns a cached file holding
only the range's blocks, renumbered from 0 (``{arch}.block_count`` = range
length), written from the memory-mapped views ``gguf_range.read_range``
selects. llama.cpp then runs the slice as if it were a whole model:

* every slice declares ``tokenizer.ggml.model = "no_vocab"`` with an explicit
  ``{arch}.vocab_size``: token ids go in and logits come out, text never does
  (meshd tokenizes at the entry), so no tokenizer tables are copied;
* the head keeps the real ``token_embd`` (llama.cpp embeds the token ids
  itself, bit-identical to the whole model); a non-head slice gets a tiny
  zero ``token_embd`` over ``FAKE_VOCAB`` dummy tokens, because its input
  arrives as embeddings (``llama_batch.embd``) and the matrix is never read;
* the tail keeps the real ``output_norm`` and ``output`` (or the tied
  embedding); a non-tail slice gets a ones ``output_norm`` and no ``output``
  (so the tied, real or fake, ``token_embd`` stands in). The backend stops
  the graph right after the last block (see llama_backend), so the vocabulary
  projection of a non-tail slice is never computed.

State: the slice cache directory (``~/.cache/meshd/slices``, override with
``MESHD_SLICE_CACHE``). Names hash the source digest and the range; files are
written to a temporary sibling and moved into place with ``os.replace``, so
concurrent workers never load half a slice.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import gguf
import numpy as np

from native.gguf_range import RangeTensors, artifact_digest, open_reader, read_range
from shard.backend import LayerRange

__all__ = ["slice_path", "write_slice", "slice_cache_root", "FAKE_VOCAB", "SLICE_FORMAT_VERSION"]

# Bump when write_slice changes what it writes, so stale cached slices are not reused.
SLICE_FORMAT_VERSION = 1
# Dummy vocabulary of a non-head, non-tail slice: llama.cpp needs a token_embd
# of shape [hidden, n_vocab] to load a model; 8 rows cost 18 KiB at hidden 576.
FAKE_VOCAB = 8
# Metadata keys copied verbatim besides "{arch}.*" (which carries every hparam).
_COPIED_GENERAL_KEYS = ("general.file_type", "general.quantization_version")


def slice_cache_root() -> Path:
    root = Path(os.environ.get("MESHD_SLICE_CACHE", Path.home() / ".cache" / "meshd" / "slices"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _copy_field(writer: gguf.GGUFWriter, field: gguf.ReaderField) -> None:
    vtype = field.types[0]
    sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), vtype, sub_type)


def _add(writer: gguf.GGUFWriter, name: str, tensor: gguf.ReaderTensor) -> None:
    writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)


def write_slice(reader: gguf.GGUFReader, tensors: RangeTensors, out: Path) -> None:
    """Write the slice of ``tensors.layer_range`` to ``out`` (not atomic; see slice_path)."""
    info = tensors.info
    arch = info.architecture
    layer_range = tensors.layer_range
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"meshd slice {layer_range}")
    for field in reader.fields.values():
        if field.name.startswith(f"{arch}.") or field.name in _COPIED_GENERAL_KEYS:
            if field.name not in (f"{arch}.block_count", f"{arch}.vocab_size"):
                _copy_field(writer, field)
    needs_real_vocab = layer_range.is_head or layer_range.is_tail
    vocab = info.vocab_size if needs_real_vocab else FAKE_VOCAB
    writer.add_uint32(f"{arch}.block_count", layer_range.count)
    writer.add_uint32(f"{arch}.vocab_size", vocab)
    writer.add_string("tokenizer.ggml.model", "no_vocab")
    writer.add_uint32("meshd.slice.start", layer_range.start)
    writer.add_uint32("meshd.slice.end", layer_range.end)
    writer.add_uint32("meshd.slice.num_layers", layer_range.num_layers)

    if tensors.token_embd is not None:
        _add(writer, "token_embd.weight", tensors.token_embd)
    elif needs_real_vocab:
        # A non-head tail with an untied output: llama.cpp still wants a
        # [hidden, vocab] token_embd; zeros in F16 are never read (embd input).
        writer.add_tensor("token_embd.weight", np.zeros((vocab, info.hidden_size), np.float16))
    else:
        writer.add_tensor("token_embd.weight", np.zeros((vocab, info.hidden_size), np.float32))
    for offset, block in enumerate(tensors.blocks):
        for suffix in sorted(block):
            _add(writer, f"blk.{offset}.{suffix}", block[suffix])
    if tensors.output_norm is not None:
        _add(writer, "output_norm.weight", tensors.output_norm)
    else:
        writer.add_tensor("output_norm.weight", np.ones(info.hidden_size, np.float32))
    if tensors.output is not None:
        _add(writer, "output.weight", tensors.output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def slice_path(source: str | os.PathLike[str], layer_range: LayerRange,
               progress: TextIO | None = sys.stderr) -> Path:
    """Return the cached slice of ``layer_range`` of ``source``, writing it if absent."""
    source = Path(source)
    digest = artifact_digest(source, progress)
    name = (f"{digest.removeprefix('sha256:')[:24]}-{layer_range.start}-{layer_range.end}"
            f"-of-{layer_range.num_layers}-v{SLICE_FORMAT_VERSION}.gguf")
    target = slice_cache_root() / name
    if target.is_file():
        return target
    reader = open_reader(source)
    tensors = read_range(reader, layer_range)
    if progress is not None:
        print(f"[meshd gguf] writing slice {layer_range} of {source.name} "
              f"({tensors.touched_bytes() / 1e6:.1f} MB)", file=progress, flush=True)
    fd, tmp_name = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write_slice(reader, tensors, Path(tmp_name))
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target
