"""Reading a range's tensors out of a safetensors file into memory the tensors own.

    TensorFile(path) --keys()/get_tensor(name)--> a torch tensor in its own allocation
                     (pread(2) through safetensors; the tensor's pages of page cache are
                     handed back right after: shard/model/memory.drop_page_cache)

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
        """The tensor ``name``, in an allocation of its own; its page cache dropped."""
        tensor = self._fh.get_tensor(name)
        span = self._spans.get(name)
        if span is not None and span[1] and self._fd >= 0:   # a length of 0 would mean 'to the end'
            drop_page_cache(self._fd, *span)
        return tensor
