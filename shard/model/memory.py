"""What a worker's memory is made of, measured: the figures the planner sizes ranges with.

    worker start, the backend's libraries imported      base    = VmRSS
    load the range                                       the peak is reset here (reset_peak)
    run the validation forward                           peak    = VmHWM since the reset
    (the largest forward a session sends: one prefill chunk)

    weights  = the backend's resident weight bytes (``weight_bytes``: the mapped
               file for llama.cpp, the loaded tensors for torch)
    kv       = KV for the whole KV budget at the model's dims and cache type
               (``kv_bytes_per_token`` x budget)
    working  = peak - base - weights - the KV resident at the peak: llama.cpp
               zeroes its whole KV buffer when it creates the context, so all of
               it is resident; torch grows a session's cache, so only the
               validation's positions are. Whatever else the load leaves
               resident counts here too: a loader must leave only the
               weights (shard/model/tensor_file.py: a live map of the
               safetensors file once doubled a torch range's figure)

The worker puts these in its CapabilityReport (``pb.MemoryFigures``); the
daemon adds its own base and republishes them in its record; the planner
(meshd/plan/footprint.py) sums weights + KV + working + bases for a range.
Reading VmHWM instead of sampling RSS catches the validation's transients
(activations, the torch allocator's growth) that a sample would miss. The
peak is reset after the load because what the load maps and drops -- the
source file's pages while a slice is cut or a safetensors file is read --
is clean page cache, which the kernel reclaims inside a memory cgroup
instead of killing; what the load keeps (objects, the weights) is still in
the resident set the validation's peak starts from.

Page cache: a node's weights are the page cache of the file it maps; what it
only reads once (a digest over the source, the source's tensors while a slice
is cut) or writes once (the slice) is handed back with ``drop_page_cache``
chunk by chunk, so it never crowds the node's promise.

State: none; reads ``/proc/<pid>/status``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from proto import shard_runtime_pb2 as pb

_FIELDS = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """Resident memory of one process, in bytes (``/proc/<pid>/status``)."""

    rss: int = 0
    peak: int = 0      # VmHWM: the high-water mark of rss
    anon: int = 0
    file: int = 0      # mapped file pages (weights mapped by llama.cpp, shared libraries)


def process_memory(pid: int | str = "self") -> ProcessMemory:
    """The process's resident memory; zeros when /proc cannot say (not Linux, process gone)."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in _FIELDS:
                    values[_FIELDS[key]] = int(rest.split()[0]) * 1024   # the kernel writes kB
    except (OSError, ValueError, IndexError):
        return ProcessMemory()
    return ProcessMemory(**values)


def drop_page_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Tell the kernel this process is done with those pages of a file (``POSIX_FADV_DONTNEED``):
    clean ones leave the page cache now instead of filling the node's memory cgroup until it
    reclaims them (pages another process maps stay). ``length`` 0: to the end of the file."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):   # not Linux, or a file system that ignores it: only a hint
        pass


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current resident set (Linux 4.0+, ``clear_refs`` 5);
    False when the kernel does not allow it (then the peak keeps counting from the start)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def memory_figures(backend, *, base: int, peak: int, kv_budget_tokens: int, validation_tokens: int) -> pb.MemoryFigures:
    """The worker's figures after its validation forward (see the module docstring).

    ``backend`` may lack ``weight_bytes`` / ``kv_bytes_per_token`` (a backend that does not
    say): those parts are then 0 and the peak above the base counts as working memory.
    """
    weights = int(getattr(backend, "weight_bytes", 0) or 0)
    per_token = int(getattr(backend, "kv_bytes_per_token", 0) or 0)
    kv = per_token * kv_budget_tokens
    kv_at_peak = kv if getattr(backend, "kv_preallocated", False) else per_token * validation_tokens
    working = max(0, peak - base - weights - kv_at_peak)
    return pb.MemoryFigures(weight_bytes=weights, kv_bytes=kv, working_bytes=working,
                            worker_base_bytes=max(0, base))
