"""meshd's own C against the installed llama.cpp: compiled once per machine, cached.

Two sources in ``native/csrc/``:

* ``capture.c`` -> ``libmeshd_capture.so``: the eval callback that captures a
  non-tail slice's residual (llama_engine.py). llama.cpp asks the callback
  about every graph node (hundreds per decode step); through ctypes into
  Python that would cost a sizeable share of a hop's step
  (docs/measurements/2026-12-02.md).
* ``llama_floor.c`` -> ``llama_floor``: the bare split floor the llama.cpp
  swarm bench runs beside the daemons (llama_floor.py).

Both compile with the system C compiler (``cc``; the one that built
llama-cpp-python, see scripts/install-native.sh, which builds them right
after the wheel) against the headers and libraries llama-cpp-python
installed (``site-packages/include``, ``llama_cpp/lib``). The cache key
digests the source, the llama-cpp-python version and the library path, so an
upgraded runtime or edited source is never paired with an old binary. Builds
write a temporary sibling and rename it into place: concurrent workers are
safe. The cache is ``~/.cache/meshd/native`` (override ``MESHD_NATIVE_CACHE``).

``python -m native.cbuild`` builds both and prints their paths.
Failures raise RuntimeUnavailable with the compiler's last output;
``capture_library()`` instead returns None and says why once (the engine
then falls back to the Python callback: same bytes, slower).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from native.errors import RuntimeUnavailable

__all__ = ["build", "capture_library", "native_cache_root", "floor_binary"]

SOURCE_DIR = Path(__file__).parent / "csrc"
# A compile of either file takes ~1 s here; bounded so a wedged compiler cannot hang a worker.
COMPILE_TIMEOUT_S = 120.0
_TARGETS = {
    "capture": ("capture.c", "libmeshd_capture.so", ("-fPIC", "-shared"), ("-lggml-base",)),
    "floor": ("llama_floor.c", "llama_floor", (), ("-lllama", "-lggml-base")),
}


def native_cache_root() -> Path:
    root = Path(os.environ.get("MESHD_NATIVE_CACHE", Path.home() / ".cache" / "meshd" / "native"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _runtime_dirs() -> tuple[str, Path, Path]:
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeUnavailable("llama-cpp-python is not installed; bash scripts/install-native.sh") from exc
    package = Path(llama_cpp.__file__).parent
    lib, include = package / "lib", package.parent / "include"
    if not (include / "llama.h").is_file() or not (lib / "libllama.so").exists():
        raise RuntimeUnavailable(f"llama-cpp-python's headers ({include}) or libraries ({lib}) are missing")
    return llama_cpp.__version__, include, lib


def build(target: str) -> Path:
    """The cached binary of ``target`` ("capture" or "floor"), compiling it if absent."""
    source, name, flags, libs = _TARGETS[target]
    version, include, lib = _runtime_dirs()
    text = (SOURCE_DIR / source).read_bytes() + (SOURCE_DIR / "capture.c").read_bytes()
    key = hashlib.sha256(text + f"|{version}|{lib}|{' '.join(flags + libs)}".encode()).hexdigest()[:16]
    out = native_cache_root() / f"{key}-{name}"
    if out.is_file():
        return out
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeUnavailable("no C compiler (cc) to build meshd's llama.cpp helpers")
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, "-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", *flags, f"-I{include}",
               f"-I{SOURCE_DIR}", "-o", tmp, str(SOURCE_DIR / source), f"-L{lib}", *libs, f"-Wl,-rpath,{lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeUnavailable(f"compiling {source} failed: {done.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeUnavailable(f"compiling {source} took over {COMPILE_TIMEOUT_S:.0f} s") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def floor_binary() -> Path:
    return build("floor")


class CaptureState(ctypes.Structure):
    """``struct meshd_capture`` of capture.c (the layout is checked against the library)."""

    _fields_ = [("target", ctypes.c_char * 64), ("want", ctypes.c_int32), ("stop", ctypes.c_int32),
                ("out", ctypes.c_void_p), ("cap", ctypes.c_int64), ("got", ctypes.c_int64)]


@functools.lru_cache(maxsize=1)
def capture_library() -> ctypes.CDLL | None:
    """The loaded capture library, or None (said once on stderr) when it cannot be built here."""
    try:
        lib = ctypes.CDLL(str(build("capture")))
        lib.meshd_capture_abi.restype = ctypes.c_int32
        if lib.meshd_capture_abi() != ctypes.sizeof(CaptureState):
            raise RuntimeUnavailable("capture.c and CaptureState disagree on the struct layout")
        return lib
    except (RuntimeUnavailable, OSError) as exc:
        print(f"[meshd llama.cpp] residual capture in Python (slower): {exc}", file=sys.stderr, flush=True)
        return None


def main() -> int:
    for target in _TARGETS:
        print(build(target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
