"""The bounded GGUF reader against mutated real files (default suite, hypothesis).

Invariant (h11's fuzz rule): any bytes give a parsed file whose model facts
and ranges are readable, or ``GGUFFormatError`` / ``ArtifactError`` /
``RangeUnavailable`` -- never another exception, never a hang, never an
allocation the file's size does not justify.

Seeds: the tiny seeded Llama converted to F16 (every byte of it: header,
tensor infos, data) and the header of the real SmolLM2 Q4_1 file (49k-token
vocabulary and merges arrays, so string and array lengths get mutated).
"""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.testing.models import build_random_llama, smollm2_gguf_path
from meshd.testing.procs import child_env
from native.convert import convert
from native.errors import ArtifactError, RangeUnavailable
from native.gguf_file import MAX_ARRAY_LEN, GGUFFile, GGUFFormatError
from native.gguf_range import model_info, read_range
from shard.model.backend import LayerRange

SMOL_HEADER_BYTES = 3 << 20  # SmolLM2's metadata + tensor infos end before 3 MiB


class Blob(bytes):
    """Seed bytes with a short repr, so a failing example does not print megabytes."""

    def __repr__(self) -> str:
        return f"<{len(self)} seed bytes>"


@pytest.fixture(scope="module")
def small() -> bytes:
    return Blob(convert(build_random_llama(), "F16", progress=None).read_bytes())


@pytest.fixture(scope="module")
def smol_header() -> bytes:
    with open(smollm2_gguf_path(), "rb") as f:
        return Blob(f.read(SMOL_HEADER_BYTES))


def _exercise(data: bytes) -> None:
    """Parse and use ``data``; only our typed errors may come out."""
    try:
        parsed = GGUFFile.parse(Path("fuzz.gguf"), data, len(data))
    except GGUFFormatError:
        return
    try:
        info = model_info(parsed)
        for tensor in parsed.tensors[:8]:
            tensor.data  # noqa: B018 - views must be buildable for every validated tensor
        read_range(parsed, LayerRange(0, info.num_layers, info.num_layers))
    except (ArtifactError, RangeUnavailable):
        return


def _header_end(data: bytes) -> int:
    return GGUFFile.parse(Path("x"), data, len(data)).data_offset


def test_seeds_parse(small, smol_header):
    parsed = GGUFFile.parse(Path("x"), small, len(small))
    assert len(parsed.tensors) == 6 * 9 + 3
    with pytest.raises(GGUFFormatError, match="beyond the end"):  # header complete, data cut
        GGUFFile.parse(Path("x"), smol_header, len(smol_header))


@given(st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_truncations(small, data):
    cut = data.draw(st.integers(0, len(small) - 1))
    with pytest.raises(GGUFFormatError):
        GGUFFile.parse(Path("x"), small[:cut], cut)


@given(st.data())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_byte_flips_in_the_header(small, data):
    end = _header_end(small)
    buf = bytearray(small)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, end - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    _exercise(bytes(buf))


HUGE = st.sampled_from([2**64 - 1, 2**63, 2**40, 2**32, 2**31, MAX_ARRAY_LEN + 1, 0xFFFFFFFF, 1 << 20])


@given(st.data(), HUGE)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_huge_counts_anywhere_in_the_header(small, data, value):
    end = _header_end(small)
    pos = data.draw(st.integers(4, end - 8))
    buf = bytearray(small)
    buf[pos:pos + 8] = struct.pack("<Q", value)
    _exercise(bytes(buf))


@given(st.data(), HUGE)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_real_vocabulary_header(smol_header, data, value):
    # A 3 MiB prefix of the real file: strings and 49k-element arrays with lying lengths.
    buf = bytearray(smol_header)
    pos = data.draw(st.integers(4, 2 << 20))
    if data.draw(st.booleans()):
        buf[pos:pos + 8] = struct.pack("<Q", value)
    else:
        buf[pos] ^= data.draw(st.integers(1, 255))
    _exercise(bytes(buf))


def _corrupt(small: bytes, what: str) -> bytes:
    buf = bytearray(small)
    if what == "tensors":
        buf[8:16] = struct.pack("<Q", 2**62)
    elif what == "kv":
        buf[16:24] = struct.pack("<Q", 2**62)
    elif what == "version":
        buf[4:8] = struct.pack("<I", 99)
    elif what == "garbage":
        buf[24:] = bytes(np.random.default_rng(0).integers(0, 256, len(buf) - 24, dtype=np.uint8))
    return bytes(buf)


@pytest.mark.parametrize("what,message", [("tensors", "exceed the limits"), ("kv", "exceed the limits"),
                                          ("version", "version 99"), ("garbage", "malformed GGUF")])
def test_named_corruptions(small, what, message):
    data = _corrupt(small, what)
    with pytest.raises(GGUFFormatError, match=message):
        GGUFFile.parse(Path("x"), data, len(data))


def test_overlapping_and_misaligned_tensors(small):
    parsed = GGUFFile.parse(Path("x"), small, len(small))
    last = parsed.tensors[-1]
    # Its info: name, n_dims u32, dims u64 x n, type u32, then the offset u64 we rewrite.
    pos = small.rfind(last.name.encode()) + len(last.name) + 4 + 8 * len(last.shape) + 4
    for offset, message in ((1, "not aligned"), (0, "overlap")):
        buf = bytearray(small)
        buf[pos:pos + 8] = struct.pack("<Q", offset)
        with pytest.raises(GGUFFormatError, match=message):
            GGUFFile.parse(Path("x"), bytes(buf), len(buf))


def test_join_with_a_garbage_gguf_is_one_line(small, tmp_path):
    """The issue's report: valid magic then garbage made `meshd join` exit with an IndexError traceback."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_corrupt(small, "garbage"))
    proc = subprocess.run([sys.executable, "-m", "meshd", "join", "--model", str(bad), "--layers", "auto",
                           "--memory", "1GiB", "--data-dir", str(tmp_path / "d")], env=child_env(1),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "malformed GGUF" in proc.stderr, proc.stderr[-2000:]
