"""``meshd bench`` options: fixed splits, the model check, refusals (no daemons started)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from meshd.benchmarks.daemon_runs import bench_model, even_splits, parse_splits
from meshd.errors import ConfigError
from meshd.testing.procs import REPO_ROOT, child_env


def test_fixed_splits_must_cover_the_model_in_order():
    assert parse_splits("0:4,4:8", 8) == ["0:4", "4:8"]
    assert parse_splits(" 0:2, 2:5 ,5:8 ", 8) == ["0:2", "2:5", "5:8"]
    for bad in ("0:4", "0:4,5:8", "1:8", "0:4,4:4,4:8", "0-4,4:8", "", "0:9"):
        with pytest.raises(ConfigError):
            parse_splits(bad, 8)
    assert even_splits(30, 2) == ["0:15", "15:30"] and even_splits(30, 3) == ["0:10", "10:20", "20:30"]


def test_the_model_must_be_an_artifact_with_a_torch_reference(tmp_path):
    class Options:
        model, backend = str(tmp_path), "torch"

    with pytest.raises(ConfigError, match="not a model artifact"):
        bench_model(Options, lambda: tmp_path)
    Options.backend = "llama.cpp"
    with pytest.raises(ConfigError, match="llama.cpp"):
        bench_model(Options, lambda: tmp_path)


@pytest.mark.parametrize("args, code, message", [
    (["pipeline", "--backend", "llama.cpp", "--json"], 1, "bench swarm --backend llama.cpp"),
    (["swarm", "--backend", "llama.cpp", "--model", "README.md", "--json"], 1, "is not a .gguf file"),
    (["swarm", "--backend", "llama.cpp", "--layers", "0:4,4:30", "--json"], 1, "takes no --layers"),
    (["codec", "--layers", "0:4,4:8"], 2, "takes no --model"),
    (["codec", "--sim"], 2, "only bench dht takes --sim"),
    (["dht", "--nodes", "50"], 2, "--nodes and --seed go with bench dht --sim"),
    (["dht", "--sim", "--nodes", "1"], 2, "--nodes must be at least 2"),
])
def test_bench_refuses_clearly(args, code, message):
    out = subprocess.run([sys.executable, "-m", "meshd", "bench", *args], cwd=REPO_ROOT, env=child_env(1),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == code and message in out.stderr, out.stderr[-2000:]


def test_every_benchmark_takes_the_clis_call():
    """``meshd bench NAME`` calls ``run(quick=, progress=, options=)`` on every registered module."""
    import importlib
    import inspect

    from meshd.cli.bench import BENCHMARKS

    for name, module in BENCHMARKS.items():
        params = inspect.signature(importlib.import_module(module).run).parameters
        assert {"quick", "progress", "options"} <= set(params), name
