"""llama.cpp build flags from CPU features and the OS's XSAVE permissions (default suite, no build).

The cpuinfo texts are real ``flags`` lines of three machine kinds, trimmed to
the features that matter; the xcomp masks are what ``arch_prctl(ARCH_GET_XCOMP_SUPP)``
returns (bit 17 XTILECFG, bit 18 XTILEDATA).
"""
from __future__ import annotations

import platform

import pytest

from native.cpu_build import (
    BASE_ARGS,
    XFEATURE_XTILEDATA,
    amx_usable,
    build_key,
    cmake_args,
    cpu_flags,
    xcomp_supported,
)

# Sapphire Rapids that reports AMX (the machine).
SPR = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
       "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512bw avx512vl "
       "avx512vbmi avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n")
# AMD EPYC Zen 4 (this machine kind): AVX-512, no AMX.
ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
        "flags\t\t: fpu sse sse2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512bw avx512vl avx512vbmi "
        "avx512_vnni avx512_bf16\n")
# An older desktop: AVX2 only.
HASWELL = "processor\t: 0\nflags\t\t: fpu sse sse2 avx f16c fma bmi2 avx2\n"
XCOMP_NO_TILEDATA = 0x202e7   # measured on the machine: XTILECFG set, XTILEDATA clear
XCOMP_WITH_TILEDATA = 0x602e7


def _options(args: tuple[str, ...]) -> dict[str, str]:
    return dict(a.removeprefix("-D").split("=", 1) for a in args)


def test_native_is_always_off_and_base_args_come_first():
    for text, xcomp in ((SPR, XCOMP_WITH_TILEDATA), (ZEN4, 0xe7), (HASWELL, None)):
        args = cmake_args(cpu_flags(text), xcomp)
        assert args[:len(BASE_ARGS)] == BASE_ARGS
        assert _options(args)["GGML_NATIVE"] == "OFF"


def test_amx_reported_but_tile_data_not_enabled_is_off():
    opts = _options(cmake_args(cpu_flags(SPR), XCOMP_NO_TILEDATA))
    assert not XCOMP_NO_TILEDATA >> XFEATURE_XTILEDATA & 1
    assert (opts["GGML_AMX_TILE"], opts["GGML_AMX_INT8"], opts["GGML_AMX_BF16"]) == ("OFF", "OFF", "OFF")
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_BF16"] == opts["GGML_AVX512_VNNI"] == "ON"


def test_amx_on_only_with_tile_data_permission():
    opts = _options(cmake_args(cpu_flags(SPR), XCOMP_WITH_TILEDATA))
    assert (opts["GGML_AMX_TILE"], opts["GGML_AMX_INT8"], opts["GGML_AMX_BF16"]) == ("ON", "ON", "ON")
    assert amx_usable(cpu_flags(SPR), XCOMP_WITH_TILEDATA)
    assert not amx_usable(cpu_flags(SPR), None)          # the kernel cannot tell: off
    assert not amx_usable(cpu_flags(ZEN4), XCOMP_WITH_TILEDATA)  # permission without the CPU: off


def test_feature_sets_follow_cpuinfo():
    zen4 = _options(cmake_args(cpu_flags(ZEN4), 0xe7))
    assert all(zen4[k] == "ON" for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2",
                                         "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI",
                                         "GGML_AVX512_BF16"))
    assert zen4["GGML_AMX_TILE"] == "OFF"
    old = _options(cmake_args(cpu_flags(HASWELL), None))
    assert old["GGML_AVX2"] == "ON" and old["GGML_AVX512"] == "OFF" and old["GGML_AVX512_BF16"] == "OFF"
    # AVX512 needs all four of F, BW, DQ, VL (ggml's AVX512 kernels use each).
    partial = _options(cmake_args(cpu_flags("flags : avx avx2 avx512f avx512bw"), None))
    assert partial["GGML_AVX512"] == "OFF"
    assert _options(cmake_args(frozenset(), None))["GGML_AVX"] == "OFF"  # no flags line: nothing assumed


def test_cpu_flags_reads_the_first_flags_line():
    assert cpu_flags("model name : x\nflags : a b\nflags : c\n") == frozenset({"a", "b"})
    assert cpu_flags("no flags here") == frozenset()


def test_build_key_changes_with_every_flag():
    a = cmake_args(cpu_flags(SPR), XCOMP_NO_TILEDATA)
    b = cmake_args(cpu_flags(SPR), XCOMP_WITH_TILEDATA)
    c = cmake_args(cpu_flags(HASWELL), None)
    keys = {build_key(a), build_key(b), build_key(c)}
    assert len(keys) == 3 and all(len(k) == 12 for k in keys)
    # Same flags, same wheel: an AMX CPU without tile-data permission builds what Zen 4 builds.
    assert build_key(a) == build_key(cmake_args(cpu_flags(ZEN4), 0xe7))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="ARCH_GET_XCOMP_SUPP is x86-64 only")
def test_this_machine_reports_an_xcomp_mask():
    mask = xcomp_supported()
    assert mask is not None and mask & 0x3 == 0x3  # x87 and SSE state are always enabled


def test_amx_can_be_turned_off_where_an_amx_build_faulted():
    from native.cpu_build import AMX_ENV, amx_mode

    off = _options(cmake_args(cpu_flags(SPR), XCOMP_WITH_TILEDATA, amx="off"))
    assert (off["GGML_AMX_TILE"], off["GGML_AMX_INT8"], off["GGML_AMX_BF16"]) == ("OFF", "OFF", "OFF")
    assert off["GGML_AVX512_BF16"] == "ON"                     # only AMX goes
    assert build_key(cmake_args(cpu_flags(SPR), XCOMP_WITH_TILEDATA, amx="off")) != \
        build_key(cmake_args(cpu_flags(SPR), XCOMP_WITH_TILEDATA, amx="auto"))   # another wheel
    assert amx_mode({}) == "auto" and amx_mode({AMX_ENV: " OFF "}) == "off"
    with pytest.raises(SystemExit):
        amx_mode({AMX_ENV: "maybe"})
