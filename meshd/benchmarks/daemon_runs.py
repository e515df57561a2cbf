"""What ``meshd bench swarm`` (both lanes) and ``pipeline`` share: the product path timed beside the whole model.

    options        --model PATH (an artifact directory), --layers A:B,C:D (a fixed
                   split: one ``meshd join --layers`` daemon per range), --backend
                   (passed to the daemons); ``bench_model`` / ``parse_splits`` check them
    daemons        ``start_split`` starts one fixed-range daemon per range (1 compute
                   thread each, THREADS of meshd/daemon/local_swarm.py; the product's record
                   lifetime, BENCH_RECORD_TTL_S) and waits until the entry sees the model
                   covered; ``entry_of`` is the daemon serving layer 0
    one run        ``generate`` asks a daemon through its control socket (the generate
                   op, as ``meshd generate`` does) and returns the done event, which carries
                   the driver's own timings (prefill, per-step wall and execution time,
                   tail bytes per decode step)
    reference      ``Reference``: shard/model/reference.py's WholeModel in this process, with the
                   same thread count, greedy, cut at the tokenizer's stop ids as the
                   daemon's generation is
    logits check   ``route_logits``: the same route driven by the route driver in this
                   process over the daemons' pinned TLS endpoints (from ``status``), asking
                   the tail for its logits rows -- only for max_abs_logit_diff, never timed
    failover       ``measure_failover``: a backup for the middle hop's range, that hop's
                   daemon killed after the first token; same tokens? how long to recover?
                   (both lanes of ``meshd bench swarm``)

Blocking code; every wait is bounded (meshd/daemon/local_swarm.py).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshd.config import DEFAULT_RECORD_TTL_S
from meshd.errors import ConfigError

# Timed generations ask for this many tokens (quick: QUICK_NEW_TOKENS).
NEW_TOKENS = 64
QUICK_NEW_TOKENS = 32
# Daemons load a model and validate it before they advertise: generous on a busy 2-core box.
START_TIMEOUT_S = 600.0
# Daemons in a benchmark republish as a user's do: the tests' short lifetimes (8 s, so a killed
# node leaves the map quickly) make every daemon republish every 2.7 s, which measurably takes
# CPU from the workers beside it (16 vs 4 ms/s per idle daemon here).
BENCH_RECORD_TTL_S = DEFAULT_RECORD_TTL_S
# A text of two prefill chunks (128 tokens each) with SmolLM2's tokenizer (212 tokens).
PROMPT_TEXT = ("A shard is a contiguous range of transformer layers. Each home machine serves one range, "
               "and activations travel from node to node until the last one picks the next token. ") * 6


def bench_model(options, default: Callable[[], Path]) -> Path:
    """The artifact to bench: ``--model`` or the default; refuses what has no whole-model reference."""
    backend = getattr(options, "backend", None) or "torch"
    if backend != "torch":
        raise ConfigError("meshd bench pipeline compares torch daemons against the whole model in torch; "
                          "for llama.cpp use meshd bench swarm --backend llama.cpp (whole-model llama.cpp "
                          "reference, 2 and 3 daemons)")
    model = getattr(options, "model", None)
    path = Path(model).expanduser() if model else default()
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a model artifact directory (config.json + *.safetensors); "
                          "meshd bench needs one for the in-process reference")
    return path


def parse_splits(text: str, num_layers: int) -> list[str]:
    """``"0:4,4:8"`` -> ["0:4", "4:8"]: contiguous ranges from 0 to the model's last layer."""
    specs = [part.strip() for part in text.split(",") if part.strip()]
    at = 0
    for spec in specs:
        try:
            a, b = (int(x) for x in spec.split(":"))
        except ValueError:
            raise ConfigError(f"--layers wants ranges like 0:4,4:8, not {text!r}") from None
        if a != at or not a < b:
            raise ConfigError(f"--layers {text}: range {spec} must start at {at} and end above it")
        at = b
    if not specs or at != num_layers:
        raise ConfigError(f"--layers {text} must cover layers 0..{num_layers} of the model")
    return specs


def even_splits(num_layers: int, parts: int) -> list[str]:
    cuts = [round(i * num_layers / parts) for i in range(parts + 1)]
    return [f"{a}:{b}" for a, b in zip(cuts, cuts[1:])]


def start_split(root: Path, model: Path, specs: Sequence[str], *, backend: str | None = None,
                kv_budget_tokens: int = 1024, record_ttl_s: float = BENCH_RECORD_TTL_S):
    """One ``meshd join --layers SPEC`` daemon per range, covering the model; returns the LocalSwarm."""
    from meshd.daemon.local_swarm import LocalSwarm

    root.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(root, model, kv_budget_tokens=kv_budget_tokens, backend=backend, record_ttl_s=record_ttl_s)
    try:
        first = swarm.add(layers=specs[0])
        for spec in specs[1:]:
            swarm.add(layers=spec)
        for daemon in swarm.daemons:
            swarm.wait_serving(daemon, START_TIMEOUT_S)
        swarm.wait_covered(START_TIMEOUT_S, peers=len(specs), via=first)
    except BaseException:
        swarm.close()
        raise
    return swarm


def entry_of(swarm):
    """The daemon serving layer 0 (its own hop goes over its worker's frame socket)."""
    for daemon in swarm.daemons:
        view = daemon.swarm() or {}
        if view.get("layers") and view["layers"][0] == 0:
            return daemon
    return swarm.daemons[0]


def generate(daemon, prompt: str, n: int, on_token=None) -> dict:
    """One generation through the daemon's control socket; the done event."""
    done, count = None, 0
    for event in daemon.generate(prompt, max_tokens=n, raw=True):
        if "token" in event:
            count += 1
            if on_token is not None:
                on_token(count)
        if event.get("done"):
            done = event
    if done is None:
        raise RuntimeError(f"{daemon.name} ended the generation without a done event")
    return done


@dataclass
class RunFigures:
    """One daemon generation's figures, from its done event."""

    tokens: list[int]
    decode_tok_s: float
    prefill_s: float
    step_wall_ms: list[float]
    step_execution_ms: list[float]
    hops: int
    tail_bytes: float | None
    route: list[str]
    looped: bool = False     # the tail sent each token straight to the head (meshd/generate/push.py)

    @classmethod
    def of(cls, done: dict) -> RunFigures:
        hops = done["step_hops"][-1] if done.get("step_hops") else len(done["route"])
        return cls(done["tokens"], done["decode_tokens_per_s"] or 0.0, done["prefill_s"], done["step_wall_ms"],
                   done["step_execution_ms"], hops, done.get("tail_bytes_per_decode_step"), done["route"],
                   bool(done.get("looped")))

    @property
    def overhead_per_hop_median_ms(self) -> float:
        return statistics.median(w - e for w, e in zip(self.step_wall_ms, self.step_execution_ms)) / self.hops

    @property
    def overhead_per_hop_mean_ms(self) -> float:
        steps = len(self.step_wall_ms)
        return (sum(self.step_wall_ms) - sum(self.step_execution_ms)) / steps / self.hops


class Reference:
    """The whole model in this process (transformers, sdpa, DynamicCache), ``threads`` compute threads."""

    def __init__(self, model: Path, threads: int) -> None:
        import torch

        from meshd.generate.tokenizer import EntryTokenizer
        from shard.model.reference import WholeModel

        torch.set_num_threads(threads)
        self.whole = WholeModel(model)
        self.tokenizer = EntryTokenizer(model)

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, raw=True)

    def generate(self, prompt: str, n: int):
        """(tokens cut at the first stop id, decode tok/s, prefill s, the ReferenceResult)."""
        ref = self.whole.generate(self.ids(prompt), n)
        stops = self.tokenizer.stop_ids
        cut = next((i for i, t in enumerate(ref.tokens) if t in stops), None)
        tokens = ref.tokens if cut is None else ref.tokens[:cut + 1]
        rate = (len(ref.tokens) - 1) / ref.decode_s if ref.decode_s else 0.0
        return tokens, rate, ref.prefill_s, ref


def route_logits(entry, prompt_ids: Sequence[int], n: int):
    """The logits rows of the entry's route, driven in this process over the daemons' pinned endpoints
    (their framed fast path when their records offer it), and the transport that carried each hop."""
    from meshd.generate.driver import GenerationRequest, SwarmDriver
    from meshd.generate.routes import FixedRouteSource, PeerConnector, discover_fingerprint
    from meshd.plan.routing import Hop, Route

    status = entry.query("status") or {}
    (entries,) = status["coverage"].values()
    chain, at = [], 0
    while at < entries[0]["num_layers"]:
        e = next(e for e in entries if e["start"] == at)
        chain.append(e)
        at = e["end"]
    hops = tuple(Hop(e["peer_id"], e["start"], e["end"], e["start"], False, e["grpc_endpoint"]) for e in chain)
    connector = PeerConnector(pins={e["peer_id"]: bytes.fromhex(e["tls_cert_sha256"]) for e in chain},
                              frames={e["peer_id"]: e["frames_endpoint"] for e in chain if e.get("frames_endpoint")})
    source = FixedRouteSource(Route("", entries[0]["num_layers"], hops))
    made: list = []

    class Recording:   # the product's connector, keeping its transports to say which carried each hop
        self_peer_id = connector.self_peer_id

        def transport(self, hop):
            made.append(connector.transport(hop))
            return made[-1]

        def retry_same_peer(self, peer_id: str) -> bool:
            return connector.retry_same_peer(peer_id)

        def push_dial(self, hop, *, head: bool = False):
            return connector.push_dial(hop, head=head)

    recording = Recording()
    driver = SwarmDriver(source, recording, fingerprint=discover_fingerprint(recording, source.route))
    tokens = [t.id for t in driver.generate(GenerationRequest(tuple(prompt_ids), n, return_logits=True))]
    # the sessions' transports are the last ones made (after the capability questions)
    return tokens, driver.stats.logits, [t.kind for t in made[-len(hops):]]


def measure_failover(swarm, entry, reference, prompt: str, new_tokens: int, result: dict,
                     say: Callable[[str], None]) -> None:
    """A backup for the middle hop's range, then that hop's daemon SIGKILLed after the first token
    (``meshd bench swarm``, both lanes): ``result`` gets whether the tokens stayed the same and
    the recovery time."""
    by_peer = {(d.swarm() or {}).get("peer_id"): d for d in swarm.daemons}
    ads = {a["peer_id"]: a for a in entry.swarm()["ads"]}
    route = result["route"]
    middle = ads[route[len(route) // 2].split(":")[0]]
    backup = swarm.add(layers=f"{middle['start']}:{middle['end']}", name="backup")
    swarm.wait_serving(backup, START_TIMEOUT_S)
    swarm.wait_covered(120, peers=len(ads) + 1)
    probe = generate(entry, prompt, 2)["route"]  # which of the two twins this entry's route uses
    victim = by_peer.get(probe[len(probe) // 2].split(":")[0]) or backup
    say(f"backup serves {middle['start']}:{middle['end']}; entry {entry.name}; "
                   f"killing {victim.name} (middle hop, daemon and worker) after the first token")
    killed: list[float] = []

    def kill(count: int) -> None:
        if count == 1 and not killed:
            killed.append(victim.kill_node())

    n = max(new_tokens, 48)
    failed = generate(entry, prompt, n, on_token=kill)
    expected = reference.generate(prompt, n)[0]
    fo = failed["failovers"]
    result.update(tokens_equal_with_failure=failed["tokens"] == expected, failovers=len(fo))
    if fo and fo[0].get("next_token_at") and killed:
        result["recovery_s"] = round(fo[0]["next_token_at"] - killed[0], 3)
        result["failover_to_token_s"] = round(fo[0]["next_token_at"] - fo[0]["failed_at"], 3)
    say(f"failure run: {len(fo)} failover(s), recovery {result.get('recovery_s')} s")
