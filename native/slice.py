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

Layer-indexed metadata: ``{arch}.*`` arrays with one entry per layer are cut
to the range, and the architecture's adapter adds what llama.cpp would
otherwise derive from the (renumbered) layer index (``gguf_arch``: Gemma 3's
sliding-window layers).

User slices (``meshd slice FILE --layers A:B -o OUT``, ``write_user_slice``,
and what a node fetches from its peers, meshd/fetch/) are different: a
self-describing *part of the model file* for a node that should not need the
whole file. It keeps every metadata pair of the source (tokenizer and chat
template included, so a head slice can be an entry node; in the canonical
order of native/gguf_write.py), the original block numbers and only the
tensors of [A, B) (``gguf_manifest.range_names``: the blocks, plus the
embedding at the head or a tied tail and the output tensors at the tail), and
adds ``meshd.slice.{source_digest,start,end,num_layers,...}`` and
``meshd.slice.manifest``: the source's manifest, so the slice proves its own
bytes against the model's root. ``plan_slice`` gives its header and every
tensor's offset from the manifest and the metadata alone, which is what lets
a fetch write verified chunks straight into place. ``gguf_range`` reads the
slice as the source model restricted to [A, B); its root is the source's.

Writing (the worker's renumbered slices and user slices alike; a fetch
writes its verified chunks at ``plan_slice``'s offsets itself, and settles
them the same way, meshd/fetch/store.py): tensor bytes are copied from the
source with ``pread`` in
COPY_CHUNK_BYTES pieces (the source is never mapped into the writer, so its
pages never count in a worker's resident set), each piece is synced and
both its source and its written pages are handed back to the kernel
(shard/model/memory.drop_page_cache): a node whose promise is a third of the
model cuts its slice without its memory cgroup filling with dirty or
read-once pages. What the worker then maps is read back once, from disk.

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

from native.errors import ArtifactError
from native.gguf_file import GGUFField, GGUFFile, GGUFTensor, VType
from native.gguf_manifest import MANIFEST_KEY, file_manifest, range_names, virtual_reader
from native.gguf_range import (
    SLICE_KEYS,
    RangeTensors,
    held_range,
    model_digest,
    model_info,
    open_reader,
    read_range,
    size_table,
)
from native.gguf_write import Layout, TensorSpec, plan_layout
from shard.model.backend import LayerRange
from shard.model.manifest import TENSOR, Manifest
from shard.model.memory import drop_page_cache

__all__ = ["slice_path", "range_file", "write_slice", "write_user_slice", "slice_cache_root", "FAKE_VOCAB",
           "SLICE_FORMAT_VERSION", "plan_slice", "slice_fields"]

# Bump when write_slice changes what it writes, so stale cached slices are not reused.
SLICE_FORMAT_VERSION = 3
# Dummy vocabulary of a non-head, non-tail slice: llama.cpp needs a token_embd
# of shape [hidden, n_vocab] to load a model; 8 rows cost 18 KiB at hidden 576.
FAKE_VOCAB = 8
# Metadata keys copied verbatim besides "{arch}.*" (which carries every hparam).
_COPIED_GENERAL_KEYS = ("general.file_type", "general.quantization_version")


def slice_cache_root() -> Path:
    root = Path(os.environ.get("MESHD_SLICE_CACHE", Path.home() / ".cache" / "meshd" / "slices"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _copy_field(writer: gguf.GGUFWriter, field: GGUFField, value=None) -> None:
    if field.vtype == VType.ARRAY and not len(field.value):
        return  # gguf's writer cannot write an empty array; no model key needs one
    writer.add_key_value(field.name, field.contents() if value is None else value, field.vtype, field.sub_type)


# Bytes copied, synced and dropped from the page cache at a time (module docstring): the dirty
# page cache one slice write holds, small beside any node's promise, large enough to stream.
COPY_CHUNK_BYTES = 16 << 20


class _Tensors:
    """The tensors of one file being written, in order: source tensors (copied from the source
    file when the data is written) and small arrays made here (fake embeddings, norms)."""

    def __init__(self, writer: gguf.GGUFWriter, source: Path) -> None:
        self.writer, self.source = writer, source
        self.items: list[GGUFTensor | np.ndarray] = []

    def add(self, name: str, tensor: GGUFTensor) -> None:
        data = tensor.data   # a view of the map: its shape and dtype; no byte is read here
        self.writer.add_tensor_info(name, data.shape, data.dtype, tensor.n_bytes, raw_dtype=tensor.tensor_type)
        self.items.append(tensor)

    def add_array(self, name: str, array: np.ndarray) -> None:
        self.writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
        self.items.append(array)

    def write(self) -> None:
        """Header, metadata, tensor table, then the data (streamed; module docstring)."""
        writer = self.writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None   # the writer opened its file in __init__
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        with open(self.source, "rb") as src:
            settled = fout.tell()
            for item in self.items:
                if isinstance(item, np.ndarray):
                    fout.write(item.tobytes())
                    n = item.nbytes
                else:
                    n = item.n_bytes
                    settled = _copy(src, item.offset, n, item.name, fout, settled)
                writer.write_padding(fout, n)
            _settle(fout, settled)
        writer.close()


def _copy(src, offset: int, n: int, name: str, fout, settled: int) -> int:
    """Copy ``n`` bytes of ``src`` from ``offset`` to ``fout``'s position (moving forward only) in
    COPY_CHUNK_BYTES pieces, each piece's source pages dropped, the written ones synced and dropped
    every COPY_CHUNK_BYTES (module docstring); ``settled``: where the unsynced bytes begin. Returns
    the new ``settled``."""
    for done in range(0, n, COPY_CHUNK_BYTES):
        size = min(COPY_CHUNK_BYTES, n - done)
        chunk = os.pread(src.fileno(), size, offset + done)
        if len(chunk) != size:
            raise ArtifactError(f"{Path(src.name).name} ends inside tensor {name}")
        fout.write(chunk)
        drop_page_cache(src.fileno(), offset + done, size)
        if fout.tell() - settled >= COPY_CHUNK_BYTES:
            settled = _settle(fout, settled)
    return settled


def _settle(fout, start: int) -> int:
    """Sync what was written since ``start`` and drop it from the page cache; the new start."""
    fout.flush()
    os.fdatasync(fout.fileno())
    end = fout.tell()
    drop_page_cache(fout.fileno(), start, end - start)
    return end


def _arch_fields(reader: GGUFFile, arch: str, layer_range: LayerRange, writer: gguf.GGUFWriter) -> None:
    """``{arch}.*`` pairs for a renumbered slice: per-layer arrays cut, the adapter's additions."""
    n = layer_range.num_layers
    extra = model_info(reader).adapter.slice_metadata(
        {f.name: f.contents() for f in reader.fields.values() if f.name.startswith(f"{arch}.")},
        layer_range.start, layer_range.end, n)
    for field in sorted(reader.fields.values(), key=lambda f: f.name):   # a slice's pairs are sorted too
        if not field.name.startswith(f"{arch}.") or field.name in extra:
            continue
        if field.name in (f"{arch}.block_count", f"{arch}.vocab_size"):
            continue
        if field.vtype == VType.ARRAY and len(field.value) == n:  # one entry per layer
            values = field.contents()[layer_range.start:layer_range.end]
            _copy_field(writer, field, values)
        else:
            _copy_field(writer, field)
    for name, (value, vtype, sub_type) in extra.items():
        writer.add_key_value(name, value, vtype, sub_type)


def write_slice(reader: GGUFFile, tensors: RangeTensors, out: Path) -> None:
    """Write the slice of ``tensors.layer_range`` to ``out`` (not atomic; see slice_path)."""
    info = tensors.info
    arch = info.architecture
    layer_range = tensors.layer_range
    writer = gguf.GGUFWriter(out, arch)
    table = _Tensors(writer, reader.path)
    writer.add_name(f"meshd slice {layer_range}")
    _arch_fields(reader, arch, layer_range, writer)
    for field in reader.fields.values():
        if field.name in _COPIED_GENERAL_KEYS:
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
        table.add("token_embd.weight", tensors.token_embd)
    elif needs_real_vocab:
        # A non-head tail with an untied output: llama.cpp still wants a [hidden, vocab] token_embd;
        # zeros in F16 are never read (embd input). (Storing the output matrix under that name and
        # no output.weight would save them, but llama.cpp then places it as an input tensor, which
        # CPU weight repacking skips: the tail's logits would differ from the whole model's.)
        table.add_array("token_embd.weight", np.zeros((vocab, info.hidden_size), np.float16))
    else:
        table.add_array("token_embd.weight", np.zeros((vocab, info.hidden_size), np.float32))
    for offset, block in enumerate(tensors.blocks):
        for suffix in sorted(block):
            table.add(f"blk.{offset}.{suffix}", block[suffix])
    if tensors.output_norm is not None:
        table.add("output_norm.weight", tensors.output_norm)
    else:
        table.add_array("output_norm.weight", np.ones(info.hidden_size, np.float32))
    if tensors.output is not None:
        table.add("output.weight", tensors.output)
    table.write()


def slice_path(source: str | os.PathLike[str], layer_range: LayerRange,
               progress: TextIO | None = sys.stderr, *, directory: Path | None = None,
               replace: bool = False) -> Path:
    """Return the cached slice of ``layer_range`` of ``source``, writing it if absent.

    ``directory``: where slices live (default ``slice_cache_root()``). ``replace``: the directory
    is one node's (``meshd worker --slice-dir``), whose worker serves one range at a time: once
    this slice exists, the node's slices of other ranges of the same model are deleted -- a new
    range replaces the old one on disk instead of piling up beside it.
    """
    source = Path(source)
    reader = open_reader(source)
    digest = model_digest(source, progress, reader)
    prefix = digest.partition(":")[2][:24]   # the model's root (shard/model/manifest.py), hex after its scheme
    name = f"{prefix}-{layer_range.start}-{layer_range.end}-of-{layer_range.num_layers}-v{SLICE_FORMAT_VERSION}.gguf"
    root = directory if directory is not None else slice_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if not target.is_file():
        tensors = read_range(reader, layer_range)
        if progress is not None:
            print(f"[meshd gguf] writing slice {layer_range} of {source.name} "
                  f"({tensors.touched_bytes() / 1e6:.1f} MB)", file=progress, flush=True)
        _atomic_write(target, lambda tmp: write_slice(reader, tensors, tmp))
    if replace:
        for old in root.glob(f"{prefix}-*.gguf"):
            if old != target:
                if progress is not None:
                    print(f"[meshd gguf] removing {old.name}: this node serves {layer_range} now",
                          file=progress, flush=True)
                old.unlink(missing_ok=True)
    return target


def range_file(source: str | os.PathLike[str], layer_range: LayerRange,
               progress: TextIO | None = sys.stderr, *, directory: Path | None = None,
               replace: bool = False) -> Path:
    """The file llama.cpp should map for ``layer_range``: ``source`` itself when it already is
    exactly that range (a whole model served whole: nothing is written), else the range's slice
    (``slice_path``, with its ``directory`` and ``replace``)."""
    source = Path(source)
    reader = open_reader(source)
    if reader.get_field(SLICE_KEYS["start"]) is None and layer_range.start == 0 \
            and layer_range.end == layer_range.num_layers == model_info(reader).num_layers:
        return source
    return slice_path(source, layer_range, progress, directory=directory, replace=replace)


def _atomic_write(target: Path, write) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(Path(tmp_name))
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def slice_fields(source: dict[str, GGUFField], manifest: Manifest, layer_range: LayerRange) -> list[GGUFField]:
    """The metadata pairs of the slice of ``layer_range``: the source's (canonical order, without
    slice keys), then the slice keys (SLICE_KEYS) and the manifest."""
    reader = virtual_reader(manifest, source)
    info = model_info(reader)
    sizes = size_table(reader, info)   # the whole model's, so a slice holder can plan for others
    fields = sorted((f for f in source.values() if not f.name.startswith("meshd.slice.")), key=lambda f: f.name)
    digest = "sha256:" + manifest.files[0].sha256.hex() if manifest.files else ""
    extra = [
        GGUFField(SLICE_KEYS["source_digest"], VType.STRING, digest),   # the source file's SHA-256
        GGUFField(SLICE_KEYS["vocab_size"], VType.UINT32, info.vocab_size),
        GGUFField(SLICE_KEYS["tied"], VType.BOOL, info.tied_embeddings),
        *(GGUFField(SLICE_KEYS[k], VType.ARRAY, np.asarray(getattr(sizes, k), dtype=np.uint64), VType.UINT64)
          for k in ("layer_bytes", "layer_elements", "single_bytes", "single_elements")),
        GGUFField(SLICE_KEYS["start"], VType.UINT32, layer_range.start),
        GGUFField(SLICE_KEYS["end"], VType.UINT32, layer_range.end),
        GGUFField(SLICE_KEYS["num_layers"], VType.UINT32, layer_range.num_layers),
        GGUFField(MANIFEST_KEY, VType.ARRAY, np.frombuffer(manifest.encode(), dtype=np.uint8), VType.UINT8),
    ]
    return fields + extra


def plan_slice(manifest: Manifest, source: dict[str, GGUFField],
               layer_range: LayerRange) -> tuple[Layout, list[int]]:
    """The layout of the slice of ``layer_range`` and the manifest entries it holds, in file order."""
    names = range_names([e.name for e in manifest.entries if e.kind == TENSOR], layer_range)
    indices = [manifest.index(n) for n in names]
    specs = [TensorSpec(e.name, e.shape, gguf.GGMLQuantizationType[e.dtype], e.size)
             for e in (manifest.entries[i] for i in indices)]
    return plan_layout(slice_fields(source, manifest, layer_range), specs), indices


def write_user_slice(source: str | os.PathLike[str], start: int, end: int, out: str | os.PathLike[str],
                     progress: TextIO | None = sys.stderr) -> Path:
    """``meshd slice``: write layers [start, end) of ``source`` as a self-describing slice at ``out``.

    ``source`` may itself be a slice (then [start, end) must lie inside it).
    The file is written to a temporary sibling and moved into place.
    """
    source, out = Path(source), Path(out)
    reader = open_reader(source)
    info = model_info(reader)
    if not 0 <= start < end <= info.num_layers:
        raise ArtifactError(f"layers {start}:{end} are outside the model's 0:{info.num_layers}")
    layer_range = LayerRange(start, end, info.num_layers)
    read_range(reader, layer_range)  # RangeUnavailable outside a source slice
    manifest = file_manifest(source, reader, progress)   # built (whole file) or checked (a slice)
    layout, indices = plan_slice(manifest, reader.fields, layer_range)
    by_name = {t.name: t for t in reader.tensors}
    tensors = [by_name[manifest.entries[i].name] for i in indices]
    if progress is not None:
        print(f"[meshd gguf] writing layers {start}:{end} of {source.name} to {out} "
              f"({sum(t.n_bytes for t in tensors) / 1e6:.1f} MB of tensors)", file=progress, flush=True)

    def write(tmp: Path) -> None:
        with open(source, "rb") as src, open(tmp, "wb") as fout:
            fout.write(layout.header)
            settled = 0
            for t in tensors:
                fout.seek(layout.offsets[t.name])
                settled = _copy(src, t.offset, t.n_bytes, t.name, fout, settled)
            fout.truncate(layout.size)
            _settle(fout, settled)

    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out, write)
    got = open_reader(out)
    if held_range(got) != layer_range or model_digest(out, None, got) != manifest.root:  # pragma: no cover
        raise ArtifactError(f"{out} does not read back as layers {start}:{end} of {manifest.root}")
    return out
