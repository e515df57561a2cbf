"""A memory cgroup for one node's processes (tests and benchmarks: a node held to its promise).

``MemoryCgroup.create(name, limit)`` makes a cgroup whose memory limit is
``limit`` bytes: v2 (``memory.max``) where the unified hierarchy has the
memory controller, else v1 (``memory.limit_in_bytes`` under
/sys/fs/cgroup/memory), else none (``version == "none"``: nothing is capped,
and the caller reports that). ``wrap(cmd)`` prefixes a command so the
process joins the cgroup before it execs (its children -- the node's worker --
are born inside); page cache the node's processes fault in or write is
charged to it, as the kernel charges a machine's own files. ``peak()``,
``oom_kills()`` and ``usage()`` read its counters; ``close()`` removes it
once its processes are gone.

Needs root (writing cgroupfs). State: the cgroup directory, owned by the
caller, removed by ``close`` (the context manager does it).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1_ROOT = ROOT / "memory"
# A cgroup whose last process just exited can be busy for a moment; rmdir is retried this long.
REMOVE_WAIT_S = 10.0


def cgroup_version() -> str:
    """"v2", "v1" or "none": which memory controller this machine offers us (and can we write it)."""
    controllers = ROOT / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split() and os.access(ROOT, os.W_OK):
        return "v2"
    if (V1_ROOT / "memory.limit_in_bytes").is_file() and os.access(V1_ROOT, os.W_OK):
        return "v1"
    return "none"


@dataclass
class MemoryCgroup:
    path: Path | None
    version: str
    limit: int

    @classmethod
    def create(cls, name: str, limit: int) -> MemoryCgroup:
        version = cgroup_version()
        if version == "none":
            return cls(None, version, limit)
        path = (ROOT if version == "v2" else V1_ROOT) / name
        path.mkdir(exist_ok=True)
        group = cls(path, version, limit)
        if version == "v2" and (path / "memory.swap.max").exists():
            (path / "memory.swap.max").write_text("0")   # no swapping out of the promise either
        group.set_limit(limit)
        return group

    def set_limit(self, limit: int) -> None:
        """Cap the cgroup at ``limit`` bytes (lowering it makes the kernel reclaim down to it).
        v1: memory+swap follows it, raised first or lowered last (it may never be below the limit)."""
        self.limit = limit
        if self.path is None:
            return
        if self.version == "v2":
            (self.path / "memory.max").write_text(str(limit))
            return
        memsw = self.path / "memory.memsw.limit_in_bytes"
        order = [memsw, self.path / "memory.limit_in_bytes"]
        current = int((self.path / "memory.limit_in_bytes").read_text())
        for knob in (order if limit > current else order[::-1]):
            if knob.exists():
                try:
                    knob.write_text(str(limit))
                except OSError:
                    if knob != memsw:
                        raise

    def reset_peak(self) -> None:
        """Start the peak over from the current usage (v1 always; v2 from Linux 6.12)."""
        if self.path is None:
            return
        try:
            (self.path / ("memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes")).write_text("0")
        except OSError:
            pass

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside the cgroup (a shell writes its own pid to cgroup.procs, then execs)."""
        if self.path is None:
            return cmd
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *cmd]

    def _read(self, v1: str, v2: str) -> int:
        if self.path is None:
            return 0
        try:
            return int((self.path / (v2 if self.version == "v2" else v1)).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def peak(self) -> int:
        """The highest usage (processes' memory + charged page cache) since creation."""
        return self._read("memory.max_usage_in_bytes", "memory.peak")

    def usage(self) -> int:
        return self._read("memory.usage_in_bytes", "memory.current")

    def oom_kills(self) -> int:
        """Processes the kernel killed because the cgroup hit its limit."""
        if self.path is None:
            return 0
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self) -> None:
        if self.path is None:
            return
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
