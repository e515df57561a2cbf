"""Reading a range's tensors out of a safetensors file into memory the tensors own.

    TensorFile(path) --keys()/get_tensor(name)--> a torch tensor in its own allocation
                     (pread(2) through safetensors, then copied to the page offset a
                     map would give it: ``page_placed``; the tensor's pages of page
                     cache are handed back right after: shard/model/memory.drop_page_cache)

Why not safetensors' default (``backend="mmap"``): it maps the whole file and
its tensors are views of that map. A worker keeps some of them as loaded (a
norm's weight, every tensor already in the compute dtype until the layout
swap copies it), and one live view keeps the map, so every page the load
touched -- the whole range's weights -- stayed in the worker's resident set
beside the copies it computes with: twice the weights resident, never read
again. The worker's measured working memory (peak - base - weights, after the
load) then carried one more copy of its range (1,561 MiB for a 1,515 MiB
range of a 1.15 B fp32 llama), the planner raised every torch node's
footprint to it, and nodes with the same ``--memory`` got 1-2 layers where
the first got 9. With ``pread`` nothing maps the file: the resident set after
the load is the weights the modules hold.

Page cache: the worker reads each tensor once, so its pages are dropped as
soon as the tensor is in memory (``--memory`` counts the node's page cache;
a memory cgroup charges it), and the whole file's when it is closed (the
kernel reads ahead past a tensor: ~2 MiB a tensor stayed cached otherwise).
The spans come from the file's header (``st_manifest.read_header``); a
header it cannot read leaves the pages to the close (only a hint;
safetensors has already vetted the file).

State: one open safetensors handle and one file descriptor, closed on exit.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

from shard.errors import ArtifactError
from shard.model.memory import drop_page_cache
from shard.model.st_manifest import read_header

# safetensors' reader that copies each tensor into its own allocation (safetensors>=0.8; pinned).
READ_BACKEND = "pread"
# The page size a map of the file is aligned to (``page_placed``): 4 KiB on the x86-64 and arm64
# Linux kernels we run on; kernels' alignment paths look at most at 64 bytes, which it divides.
PAGE_BYTES = 4096


class TensorFile:
    """A safetensors file opened for reading tensors into owned memory (module docstring).

    Opening raises what ``safetensors.safe_open`` raises (a header that does not parse, a missing
    file); callers turn that into their own error."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._handle: Any = safe_open(str(self.path), framework="pt", backend=READ_BACKEND)
        self._fh: Any = None
        self._fd = -1
        self._spans: dict[str, tuple[int, int]] = {}

    def __enter__(self) -> TensorFile:
        self._fh = self._handle.__enter__()
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
            infos, _ = read_header(self.path)
            self._spans = {t.name: (t.begin, t.size) for t in infos}
        except (OSError, ArtifactError):
            self._spans = {}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd >= 0:
            drop_page_cache(self._fd)   # what the kernel read ahead past the tensors taken
            os.close(self._fd)
            self._fd = -1
        self._handle.__exit__(exc_type, exc, tb)

    def keys(self) -> list[str]:
        """The tensors in file order: each read continues where the last ended (the kernel's
        read-ahead serves the next one instead of pages dropped unread)."""
        return list(self._fh.offset_keys())

    def get_tensor(self, name: str):
        """The tensor ``name``, in an allocation of its own placed as a map of the file would place
        it (``page_placed``); its page cache dropped."""
        tensor = self._fh.get_tensor(name)
        span = self._spans.get(name)
        if span is None or not span[1]:   # (a length of 0 would mean 'to the end')
            return tensor
        if self._fd >= 0:
            drop_page_cache(self._fd, *span)
        return page_placed(tensor, span[0])


def page_placed(tensor, file_offset: int):
    """A copy of ``tensor`` whose address lies at ``file_offset``'s offset within a page, where a
    map of the file (safetensors' default, and transformers' whole model: the exactness reference)
    puts it. CPU matmul kernels pick their path by the operands' alignment, and their sums differ in
    the last bits between paths: a weight the range keeps as loaded (an MoE router's gate, a shared
    expert) placed anywhere else gave logits 1e-6 off the reference. Costs < one page a tensor."""
    import torch

    nbytes = tensor.numel() * tensor.element_size()
    buffer = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
    shift = (file_offset - buffer.data_ptr()) % PAGE_BYTES
    placed = buffer[shift:shift + nbytes].view(tensor.dtype).view(tensor.shape)
    placed.copy_(tensor)
    return placed
