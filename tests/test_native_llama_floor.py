"""meshd's C against llama.cpp: the residual capture (product path) and the bare split floor.

* capture.c and the Python eval callback give byte-identical residuals on the
  same slice (prefill chunk and decode steps), and the engine says which it used.
* The bare floor (llama_floor.c over pipes) reproduces the whole model's greedy
  tokens on SmolLM2 Q4_1 for 2- and 3-way splits.
* The floor's message reader is bounded: a bad header or a short message ends it
  with exit code 3 (hypothesis: any bytes end it with 0 or 3, never a signal).
"""
from __future__ import annotations

import ctypes
import os
import struct
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.testing.models import smollm2_gguf_path
from native.cbuild import CaptureState, capture_library, floor_binary
from native.gguf_range import model_info, open_reader
from native.llama_engine import EngineConfig, LlamaEngine
from native.llama_floor import floor_generate
from native.llama_reference import reference_generate
from native.slice import slice_path
from shard.model.backend import LayerRange

pytestmark = pytest.mark.native

SMOL_PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378]  # token ids of SmolLM2's vocab


@pytest.fixture(scope="module")
def smol():
    path = smollm2_gguf_path()
    return path, model_info(open_reader(path))


def _head_engine(path, info, monkeypatch, mode: str) -> LlamaEngine:
    monkeypatch.setenv("MESHD_LLAMA_CAPTURE", mode)
    head = slice_path(path, LayerRange(0, 12, info.num_layers), None)
    return LlamaEngine(head, EngineConfig(n_threads=1, n_ctx=256, n_seq_max=2), n_embd=info.hidden_size,
                       n_vocab=info.vocab_size, capture_layer=11)


def test_c_capture_equals_the_python_callback_bit_for_bit(smol, monkeypatch):
    path, info = smol
    assert capture_library() is not None
    c, py = _head_engine(path, info, monkeypatch, "c"), _head_engine(path, info, monkeypatch, "python")
    try:
        assert (c.capture, py.capture) == ("c", "python")
        prompt = np.asarray(SMOL_PROMPT, np.int32)
        a, b = c.decode(0, 0, prompt, want_hidden=True), py.decode(0, 0, prompt, want_hidden=True)
        assert a.shape == (len(SMOL_PROMPT), info.hidden_size) and a.dtype == np.float32
        assert np.array_equal(a, b)
        for step in range(4):
            token = np.asarray([100 + step], np.int32)
            a = c.decode(0, len(SMOL_PROMPT) + step, token, want_hidden=True)
            b = py.decode(0, len(SMOL_PROMPT) + step, token, want_hidden=True)
            assert np.array_equal(a, b) and np.isfinite(a).all()
        held = a.copy()
        c.decode(0, len(SMOL_PROMPT) + 4, np.asarray([7], np.int32), want_hidden=True)
        assert np.array_equal(a, held), "a returned residual must not alias the engine's capture buffer"
    finally:
        c.close()
        py.close()


def test_capture_struct_layout_matches_the_library():
    lib = capture_library()
    assert lib is not None and lib.meshd_capture_abi() == ctypes.sizeof(CaptureState)


@pytest.mark.parametrize("cuts", [(15,), (10, 20)])
def test_bare_floor_reproduces_the_whole_model_tokens(smol, cuts):
    path, info = smol
    bounds = [0, *cuts, info.num_layers]
    parts = [LayerRange(a, b, info.num_layers) for a, b in zip(bounds, bounds[1:])]
    whole = reference_generate(path, SMOL_PROMPT, 12, n_threads=1, chunk_tokens=4)
    floor = floor_generate(path, parts, SMOL_PROMPT, 12, n_threads=1, n_ctx=256, chunk_tokens=4)
    print(f"split {cuts}: whole {whole.tokens}, floor {floor.tokens}")
    assert floor.tokens == whole.tokens and len(floor.tokens) == 12
    assert floor.processes == len(parts) and floor.prefill_s > 0 and floor.decode_s > 0


def test_floor_rejects_ranges_that_do_not_chain(smol):
    path, info = smol
    n = info.num_layers
    with pytest.raises(ValueError):
        floor_generate(path, [LayerRange(0, n, n)], SMOL_PROMPT, 4)
    with pytest.raises(ValueError):
        floor_generate(path, [LayerRange(0, 10, n), LayerRange(12, n, n)], SMOL_PROMPT, 4)
    with pytest.raises(ValueError):
        floor_generate(path, [LayerRange(0, 10, n), LayerRange(10, n, n)], SMOL_PROMPT, 300, n_ctx=256)


@pytest.mark.parametrize("header", [(600, 0), (-1, 0), (1, -5), (1, 10_000)])
def test_floor_process_refuses_a_bad_message_header(smol, header):
    path, info = smol
    tail = slice_path(path, LayerRange(15, info.num_layers, info.num_layers), None)
    proc = subprocess.run([str(floor_binary()), "--model", str(tail), "--embd", str(info.hidden_size),
                           "--ctx", "256", "--batch", "512"],
                          input=struct.pack("<ii", *header), capture_output=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert b"bad message header" in proc.stderr


def test_floor_process_ends_on_a_short_message(smol):
    path, info = smol
    tail = slice_path(path, LayerRange(15, info.num_layers, info.num_layers), None)
    body = struct.pack("<ii", 1, 0) + os.urandom(info.hidden_size * 4 // 2)   # half a row, then EOF
    proc = subprocess.run([str(floor_binary()), "--model", str(tail), "--embd", str(info.hidden_size),
                           "--ctx", "256"], input=body, capture_output=True, timeout=120)
    assert proc.returncode == 3 and b"short read" in proc.stderr


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64) | st.tuples(st.integers(-2, 600), st.integers(-2, 2000), st.binary(max_size=64)).map(
    lambda t: struct.pack("<ii", t[0], t[1]) + t[2]))
def test_floor_process_survives_any_input(smol, data):
    path, info = smol
    tail = slice_path(path, LayerRange(15, info.num_layers, info.num_layers), None)
    proc = subprocess.run([str(floor_binary()), "--model", str(tail), "--embd", str(info.hidden_size),
                           "--ctx", "256"], input=data, capture_output=True, timeout=120)
    assert proc.returncode in (0, 3), (proc.returncode, proc.stderr[-500:])
