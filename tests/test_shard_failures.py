"""Our own failures in the worker: logged with their traceback, answered with a typed status.

Real torch backends on a seeded tiny Llama. A broken weight (a real torch error) stands
in for a backend that fails mid-generation; faults we cannot cause otherwise (a cache
allocator failing for a reason other than memory, a bug in the manager) are injected
by a thin wrapper or one replaced method. Real allocation failures (numpy's MemoryError,
torch's CPU allocator) are caused for real."""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from meshd.testing import models as testmodels
from proto import shard_runtime_pb2 as pb
from shard.errors import MAX_DETAIL_CHARS, ResourceExhausted, is_out_of_memory, map_failure
from shard.model.torch_backend import TorchRangeBackend
from shard.session import worklog
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from shard.session.stream import SessionStream
from shard.session.worklog import TRACE_MARK
from tests.test_shard_stream import decode_req, error_of, open_req, opened, parse

torch.set_num_threads(1)
REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
WORKER_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def model_dir():
    return testmodels.build_random_llama()


def fresh_service(model_dir, backend=None) -> ShardService:
    backend = backend or TorchRangeBackend.load(model_dir, 0, 6, progress=None)
    return ShardService(backend, SessionPolicy(kv_budget_tokens=4096))


def break_a_weight(backend: TorchRangeBackend) -> None:
    """A real fault: layer 1's query projection no longer fits the hidden size (torch raises)."""
    attn = backend.modules.layers[1].self_attn
    attn.q_proj.weight_t = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)


def records(caplog, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


class CacheFaults:
    """A real backend whose ``new_cache`` fails as ``fault`` does (everything else is the backend's)."""

    def __init__(self, backend, fault) -> None:
        self._backend, self._fault = backend, fault

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def new_cache(self, max_tokens: int):
        return self._fault(max_tokens)


# ------------------------------------------------------------------ backend failures mid-generation

def test_a_backend_failure_mid_decode_is_logged_with_its_traceback_and_answered_typed(model_dir, caplog):
    svc = fresh_service(model_dir)
    s, _ = opened(svc, session="breaks")
    assert parse(s.receive(decode_req(1, 0))[0]).WhichOneof("kind") == "decode"
    break_a_weight(svc.backend)
    caplog.set_level(logging.INFO)
    status = error_of(s.receive(decode_req(2, 1)))
    assert status.error.code == pb.ERROR_CODE_INTERNAL and status.error.retryable and not status.terminal
    assert "RuntimeError" in status.error.detail and "worker's log" in status.error.detail
    assert "session cache reset to 0" in status.error.detail
    [rec] = records(caplog, "shard.session.sessions")
    assert rec.levelno == logging.ERROR and rec.exc_info and rec.exc_info[0] is RuntimeError
    assert "mat1 and mat2" in str(rec.exc_info[1])        # torch's own message, in the log
    # the cache was reset: the next step is told where the session really is
    again = error_of(s.receive(decode_req(3, 1)))
    assert again.error.code == pb.ERROR_CODE_CACHE_MISS and again.error.actual_past_len == 0


def test_a_failed_validation_keeps_its_message_bounded_and_logs_the_traceback(model_dir, caplog):
    backend = TorchRangeBackend.load(model_dir, 0, 6, progress=None)
    break_a_weight(backend)
    caplog.set_level(logging.INFO)
    report = ShardService(backend, SessionPolicy(kv_budget_tokens=4096)).validate()
    assert not report.validated
    assert report.detail.startswith("validation forward failed: RuntimeError: mat1 and mat2 shapes cannot be")
    assert len(report.detail) <= MAX_DETAIL_CHARS and "\n" not in report.detail
    [rec] = records(caplog, "shard.session.service")
    assert rec.levelno == logging.ERROR and rec.exc_info[0] is RuntimeError


# ------------------------------------------------------------------ cache creation: room or not

def _open_status(svc) -> pb.ShardStatus:
    return error_of(SessionStream(svc).receive(open_req(svc, session="c")))


def test_a_cache_failure_that_is_not_memory_is_internal_never_no_room(model_dir, caplog):
    def vanished(max_tokens):
        raise OSError(5, "Input/output error reading the KV pool")

    caplog.set_level(logging.INFO)
    status = _open_status(fresh_service(model_dir, CacheFaults(TorchRangeBackend.load(model_dir, 0, 6, progress=None),
                                                               vanished)))
    assert status.terminal and status.error.code == pb.ERROR_CODE_INTERNAL
    assert "creating a KV cache of 64 tokens failed (OSError)" in status.error.detail
    [rec] = records(caplog, "shard.session.sessions")
    assert rec.levelno == logging.ERROR and rec.exc_info[0] is OSError


@pytest.mark.parametrize("allocate", [
    lambda n: np.empty(1 << 60, np.uint8),                 # numpy: a real MemoryError
    lambda n: torch.empty(1 << 46, dtype=torch.uint8),     # torch's CPU allocator: RuntimeError (ENOMEM)
], ids=["numpy", "torch"])
def test_a_real_lack_of_memory_is_resource_exhausted_and_logged(model_dir, caplog, allocate):
    caplog.set_level(logging.INFO)
    backend = CacheFaults(TorchRangeBackend.load(model_dir, 0, 6, progress=None), allocate)
    status = _open_status(fresh_service(model_dir, backend))
    assert status.error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and status.error.retryable
    assert status.error.detail == "out of memory creating a KV cache of 64 tokens"
    assert status.error.retry_after_ms > 0
    [rec] = records(caplog, "shard.session.sessions")
    assert rec.levelno == logging.WARNING and rec.exc_info


def test_a_budget_shortfall_is_resource_exhausted_and_not_logged(model_dir, caplog):
    caplog.set_level(logging.INFO)
    svc = ShardService(TorchRangeBackend.load(model_dir, 0, 6, progress=None), SessionPolicy(kv_budget_tokens=100))
    opened(svc, session="first")                       # 64 of 100 tokens reserved, in use
    status = _open_status(svc)
    assert status.error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and "KV budget full" in status.error.detail
    assert records(caplog, "shard.session.sessions") == []     # a refusal, not a failure of ours


def test_the_mapping_rules():
    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 70368744177664 bytes. Error code 12 (Cannot allocate memory)")
    assert is_out_of_memory(MemoryError()) and is_out_of_memory(oom)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    mine = ResourceExhausted("KV budget full")
    assert map_failure(mine, "x") is mine
    assert (map_failure(KeyError("k"), "doing y").detail
            == "doing y failed (KeyError); the traceback is in the worker's log")


# ------------------------------------------------------------------ the stream's own catch-all

def test_an_unexpected_exception_in_the_stream_is_logged_and_ends_only_that_stream(model_dir, caplog, monkeypatch):
    svc = fresh_service(model_dir)

    def bug(*args, **kwargs):
        raise KeyError("a bug in the session manager")

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(svc.manager, "open", bug)      # a fault we cannot cause: a bug
    s = SessionStream(svc)
    status = error_of(s.receive(open_req(svc, session="bug")))
    assert s.closed and status.terminal and status.error.code == pb.ERROR_CODE_INTERNAL
    assert status.error.detail.startswith("handling the open message failed (KeyError)")
    [rec] = records(caplog, "shard.session.stream")
    assert rec.levelno == logging.ERROR and rec.exc_info[0] is KeyError
    monkeypatch.undo()
    opened(svc, session="next")                        # the worker serves on


# ------------------------------------------------------------------ the worker's log format

def test_the_worker_log_marks_every_traceback_line_and_catches_thread_crashes():
    out = io.StringIO()
    saved = (sys.excepthook, threading.excepthook, logging.getLogger().handlers[:], logging.getLogger().level)
    try:
        worklog.install(out)
        try:
            {}["missing"]
        except KeyError:
            logging.getLogger("shard.x").exception("lookup failed")
            logging.getLogger("shard.x").info("said already", exc_info=True, extra=worklog.LOG_ONLY)

        def crash():
            raise ValueError("in a stream thread")

        t = threading.Thread(target=crash, name="shard-rpc_7")
        t.start()
        t.join()
    finally:
        sys.excepthook, threading.excepthook = saved[0], saved[1]
        root = logging.getLogger()
        root.handlers[:] = saved[2]
        root.setLevel(saved[3])
    lines = out.getvalue().splitlines()
    heads = [line for line in lines if not worklog.is_trace_line(line)]
    assert heads == ["[worker] ERROR shard.x: lookup failed",
                     "[worker] ERROR meshd.worker: uncaught ValueError in thread shard-rpc_7: in a stream thread"]
    traces = [line for line in lines if worklog.is_trace_line(line)]
    assert any("Traceback (most recent call last):" in line for line in traces)
    assert any("KeyError: 'missing'" in line for line in traces)
    assert any("ValueError: in a stream thread" in line for line in traces)
    assert TRACE_MARK + "[worker] INFO shard.x: said already" in traces      # the whole record, marked


# ------------------------------------------------------------------ a worker that cannot load its model

def _bad_model(root, config: str, safetensors: bytes):
    root.mkdir()
    (root / "config.json").write_text(config)
    (root / "model.safetensors").write_bytes(safetensors)
    return root


LLAMA = ('{"model_type": "llama", "num_hidden_layers": %s, "hidden_size": 64, "intermediate_size": 128, '
         '"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "hidden_act": "%s"}')


def test_malformed_artifacts_are_artifact_errors_that_say_which_file(tmp_path):
    from shard.errors import ArtifactError

    bad_config = _bad_model(tmp_path / "config", LLAMA % ('"two"', "silu"), b"")
    with pytest.raises(ArtifactError, match=r"config.json cannot be read: .*num_hidden_layers"):
        TorchRangeBackend.load(bad_config, 0, 1, progress=None)
    truncated = _bad_model(tmp_path / "truncated", LLAMA % (2, "silu"), os.urandom(2000))
    with pytest.raises(ArtifactError, match=r"model.safetensors is not a readable safetensors file .*re-download"):
        TorchRangeBackend.load(truncated, 0, 1, progress=None)


def test_the_worker_turns_a_load_failure_into_one_line_and_logs_an_unexpected_ones_traceback(tmp_path, caplog):
    import argparse

    from meshd.cli import worker

    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    caplog.set_level(logging.DEBUG)
    odd = _bad_model(tmp_path / "odd", LLAMA % (2, "no_such_act"), b"")
    service, _router, why = worker._load_and_validate(parser.parse_args(["--model", str(odd), "--layers", "0:1"]))
    assert service is None and why == "unexpected KeyError: 'no_such_act' (traceback in the worker log)"
    [rec] = [r for r in caplog.records if r.name == "meshd.worker" and r.levelno == logging.ERROR]
    assert rec.exc_info[0] is KeyError
    truncated = _bad_model(tmp_path / "truncated", LLAMA % (2, "silu"), os.urandom(2000))
    service, _router, why = worker._load_and_validate(parser.parse_args(["--model", str(truncated), "--layers", "0:1"]))
    assert service is None and "model.safetensors is not a readable safetensors file" in why
    [rec] = [r for r in caplog.records if r.name == "meshd.worker" and r.levelno == logging.INFO]
    assert rec.exc_info and getattr(rec, "log_only", False)       # the cause, for worker.log only


@pytest.mark.slow
def test_a_worker_that_cannot_load_its_model_ends_with_one_clear_line(tmp_path):
    llama = ('{"model_type": "llama", "num_hidden_layers": %s, "hidden_size": 64, "intermediate_size": 128, '
             '"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "hidden_act": "%s"}')
    cases = {
        # a safetensors file that does not parse: an ArtifactError in one line (its cause in the log only)
        "corrupt": (_bad_model(tmp_path / "corrupt", llama % (2, "silu"), os.urandom(2000)), "0:1",
                    "is not a readable safetensors file", True),
        # an activation transformers does not know: nothing maps it, so its traceback is logged first
        "unexpected": (_bad_model(tmp_path / "odd", llama % (2, "no_such_act"), b""), "0:1",
                       "unexpected KeyError: 'no_such_act' (traceback in the worker log)", True),
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    procs = {name: subprocess.Popen([sys.executable, "-m", "meshd", "worker", "--model", str(path), "--layers", span],
                                    cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (path, span, _, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
        path, span, why, traced = cases[name]
        lines = err.splitlines()
        assert proc.returncode == 1, err[-2000:]
        assert lines[-1].startswith(f"cannot load {path} layers {span}: ") and why in lines[-1], err[-2000:]
        unmarked = [line for line in lines if not worklog.is_trace_line(line)]
        assert not any(line.startswith(("Traceback", "  File ")) for line in unmarked), err[-2000:]
        assert any(worklog.is_trace_line(line) and "Traceback" in line for line in lines) == traced, err[-2000:]
