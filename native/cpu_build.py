"""Which llama.cpp build flags this machine can run: CPU features *and* what the OS enabled.

``GGML_NATIVE=ON`` compiles with ``-march=native``, which trusts cpuid alone.
A CPU can report AMX (``amx_tile`` in /proc/cpuinfo) while the kernel has not
granted processes the AMX tile-data state: then ``tilezero`` raises SIGILL
(seen on the reference machine: ``arch_prctl(ARCH_GET_XCOMP_SUPP)`` = 0x202e7,
bit 17 XTILECFG set, bit 18 XTILEDATA clear). So the build turns GGML_NATIVE
off and names every instruction set explicitly:

* AVX / AVX2 / FMA / F16C / AVX512 (F, BW, DQ, VL needed by ggml) / VBMI /
  VNNI / BF16 from the cpuid flags the kernel shows in /proc/cpuinfo (the
  kernel clears a flag whose register state it does not support, e.g. AVX512
  without XSAVE of the ZMM state);
* AMX only when the CPU reports it AND ``ARCH_GET_XCOMP_SUPP`` has bit 18
  AND ``MESHD_NATIVE_AMX`` is not ``off``. Even that is not enough everywhere:
  on a Firecracker VM (kernel 6.18.44-fc, Xeon with amx_tile/int8/bf16,
  XCOMP_SUPP 0x600e7) bare AMX probes run -- permission granted, tiles loaded
  on several threads, across context switches and OpenMP regions -- yet
  llama.cpp's ``ggml_backend_amx_mul_mat`` dies with SIGILL on ``tileloadd``
  in an OpenMP thread. So scripts/install-native.sh runs a real forward of
  the build it installed; when that dies with SIGILL and AMX was on, it
  records the machine (``amx-faults`` in the wheel cache), sets
  ``MESHD_NATIVE_AMX=off`` and builds again: a different key, a wheel
  without AMX.

``python -m native.cpu_build`` prints the CMake arguments (used by
scripts/install-native.sh) and ``--key`` a short digest of them, part of the
cached wheel's name so a wheel built with other flags is never reused.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sys
from pathlib import Path

# Fixed arguments: no examples, tests, server or llava (faster build, fewer deps).
BASE_ARGS = ("-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=OFF")
# cmake option -> the /proc/cpuinfo flags it needs (all of them).
FEATURE_OPTIONS = (
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX512", ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
AMX_OPTIONS = (("GGML_AMX_TILE", "amx_tile"), ("GGML_AMX_INT8", "amx_int8"), ("GGML_AMX_BF16", "amx_bf16"))
ARCH_GET_XCOMP_SUPP = 0x1021
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64
# "off": never build AMX kernels (install-native.sh sets it after an AMX build faulted here).
AMX_ENV = "MESHD_NATIVE_AMX"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def xcomp_supported() -> int | None:
    """The kernel's supported XSAVE feature mask for this process, or None when it cannot tell."""
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)) != 0:
        return None
    return mask.value


def amx_usable(flags: frozenset[str], xcomp: int | None) -> bool:
    return "amx_tile" in flags and xcomp is not None and bool(xcomp >> XFEATURE_XTILEDATA & 1)


def amx_mode(env: dict | None = None) -> str:
    mode = (os.environ if env is None else env).get(AMX_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "off"):
        raise SystemExit(f"{AMX_ENV} must be auto or off, not {mode!r}")
    return mode


def cmake_args(flags: frozenset[str] | None = None, xcomp: int | None | str = "probe",
               amx: str | None = None) -> tuple[str, ...]:
    flags = cpu_flags() if flags is None else flags
    probed = xcomp_supported() if isinstance(xcomp, str) else xcomp   # "probe": ask the compiler
    args = list(BASE_ARGS)
    for option, needs in FEATURE_OPTIONS:
        args.append(f"-D{option}={'ON' if all(n in flags for n in needs) else 'OFF'}")
    use_amx = amx_usable(flags, probed) and (amx_mode() if amx is None else amx) != "off"
    for option, flag in AMX_OPTIONS:
        args.append(f"-D{option}={'ON' if use_amx and flag in flags else 'OFF'}")
    return tuple(args)


def build_key(args: tuple[str, ...]) -> str:
    return hashlib.sha256(" ".join(args).encode()).hexdigest()[:12]


def main(argv: list[str]) -> int:
    args = cmake_args()
    if "--key" in argv:
        print(build_key(args))
    elif "--explain" in argv:
        xcomp = xcomp_supported()
        print(f"xcomp_supp={hex(xcomp) if xcomp is not None else 'unknown'} "
              f"amx_usable={amx_usable(cpu_flags(), xcomp)} {AMX_ENV}={amx_mode()}")
        print(" ".join(args))
    elif "--amx" in argv:      # does this build carry AMX kernels? (exit 0: yes)
        return 0 if "-DGGML_AMX_TILE=ON" in args else 1
    else:
        print(" ".join(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
