"""Opt-in timestamps along the relayed frame path (for the latency breakdown).

Off unless ``MESHD_RELAY_TRACE=<directory>`` is set in the environment of the
processes on the path (entry, home node). Then each process records
``(mark, time.monotonic_ns())`` pairs in memory (at most ``MAX_MARKS``; later
marks are dropped) and writes them to ``<directory>/<pid>.trace`` at exit,
one ``mark ns`` per line. CLOCK_MONOTONIC is one clock for every process on a
machine, so marks of the entry and the home node line up;
``breakdown(directory)`` pairs them frame by frame (see the mark names below).

Marks (in path order of one request and its response):
    e.pump_got     entry: the pump thread took a request from the driver's iterator
    e.trio_got     entry: the request reached the trio loop (thread hand-off)
    e.write_done   entry: the request's bytes were written to the libp2p stream
    h.read_done    home:  the whole request frame was read from the libp2p stream
    h.iter_yield   home:  the bridge hands it to gRPC (in the bridge's loop thread)
    h.pump_got     home:  the worker's response came out of the gRPC call
    h.trio_got     home:  the response reached the trio loop (thread hand-off)
    h.write_done   home:  the response's bytes were written to the libp2p stream
    e.read_done    entry: the whole response frame was read in trio
    e.next_return  entry: the driver thread got the response
When disabled, ``mark`` is a no-op costing one global lookup and a branch.
"""
from __future__ import annotations

import atexit
import os
import statistics
import time
from pathlib import Path

__all__ = ["ENABLED", "mark", "enable", "disable", "dump_now", "breakdown", "TRACE_ENV"]

TRACE_ENV = "MESHD_RELAY_TRACE"
# One generation of the benchmark writes ~10 marks per frame for a few hundred
# frames; 200k marks bound the memory of a forgotten trace (~16 MB).
MAX_MARKS = 200_000

_DIR = os.environ.get(TRACE_ENV) or None
ENABLED = _DIR is not None
_marks: list[tuple[str, int]] = []


def mark(name: str) -> None:
    if ENABLED and len(_marks) < MAX_MARKS:
        _marks.append((name, time.monotonic_ns()))


def _dump() -> None:
    if not _marks or _DIR is None:
        return
    path = Path(_DIR) / f"{os.getpid()}.trace"
    path.write_text("".join(f"{name} {ns}\n" for name, ns in _marks))


if ENABLED:
    atexit.register(_dump)


def enable(directory: str | Path) -> None:
    """Start recording in this process (children inherit it through ``TRACE_ENV``)."""
    global ENABLED, _DIR
    _DIR, ENABLED = str(directory), True
    os.environ[TRACE_ENV] = str(directory)


def disable() -> None:
    """Stop recording and write what was recorded."""
    global ENABLED
    _dump()
    ENABLED = False
    _marks.clear()
    os.environ.pop(TRACE_ENV, None)


def dump_now() -> None:
    """Write the marks so far (a child stopped by a signal skips atexit)."""
    _dump()


def _load(directory: Path) -> dict[str, list[int]]:
    series: dict[str, list[int]] = {}
    for path in sorted(directory.glob("*.trace")):
        for line in path.read_text().splitlines():
            name, ns = line.split()
            series.setdefault(name, []).append(int(ns))
    for values in series.values():
        values.sort()
    return series


def _after(values: list[int], t: int) -> int | None:
    for v in values:
        if v >= t:
            return v
    return None


def breakdown(directory: str | Path, *, last: int) -> dict[str, float]:
    """Median milliseconds per segment over the ``last`` request/response pairs."""
    s = _load(Path(directory))
    need = ("e.pump_got", "e.trio_got", "e.write_done", "h.read_done", "h.iter_yield", "h.pump_got",
            "h.trio_got", "h.write_done", "e.read_done", "e.next_return")
    if any(name not in s for name in need):
        return {}
    segments: dict[str, list[float]] = {}
    for t0 in s["e.pump_got"][-last:]:
        chain = [t0]
        for name in need[1:]:
            t = _after(s[name], chain[-1])
            if t is None:
                break
            chain.append(t)
        if len(chain) != len(need):
            continue
        for a, b, (n1, n2) in zip(chain, chain[1:], zip(need, need[1:])):
            segments.setdefault(f"{n1}->{n2}", []).append((b - a) / 1e6)
        segments.setdefault("total", []).append((chain[-1] - chain[0]) / 1e6)
    return {k: round(statistics.median(v), 3) for k, v in segments.items()}
