"""The daemon's MoE part: expert peers advertise their experts, holders find them.

Expert peer (``meshd join --model DIR --experts 0-3:E4-E7``, no ``--layers``)::

    ExpertPart.run
    ├── (--experts auto) plan the experts from the DHT view and --memory (meshd/plan/experts.py):
    │                  first what holders' capability records say they need (delegated_experts)
    │                  and nobody serves, then the least served
    ├── supervisor  -> ExpertWorkerProcess: ``meshd worker --experts SPEC --expert-listen HOST:0``
    │                  (TLS with the node certificate); ready after its validation forward
    └── advertiser  -> ExpertAdvertiser: the signed expert record under /meshd/experts/<digest>,
                       published only once the worker is ready, republished every ttl/3,
                       withdrawn when the worker dies or the node leaves

Holder (``--layers A:B --experts SPEC``, or ``--offload-experts``)::

    ExpertPart.run
    └── directory   every EXPERT_REFRESH_S: fetch the model's expert records, keep those
                    of our recipe that speak our version and act (placements), write them
                    to <data dir>/expert-peers.json (atomically, only when changed); the
                    worker reloads the file and fails over between the peers it names

An expert peer must be directly dialable: behind NAT (reachability private)
it does not advertise and says so. State owned here: the planned spec, the
directory's last placements; the advertiser and supervisor own theirs.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from dht.expert_records import ExpertClaim, ExpertRecord, sign_experts, sign_experts_withdrawal, validate_experts
from meshd.daemon.advertiser import RecordSchedule
from meshd.daemon.supervisor import Backoff, Supervisor, WorkerState
from meshd.daemon.worker_process import REPO_ROOT, ChildProcess, WorkerProcess, ready_or_exit
from meshd.errors import WorkerFailed
from meshd.plan.experts import ExpertFootprint, coverage, demand, placements, plan_experts, runs_of
from meshd.reach.tls import TlsMaterial
from proto import moe as W

log = logging.getLogger(__name__)

# Holders look for expert peers this often (a new peer is used within this delay).
EXPERT_REFRESH_S = 2.0
# An --experts auto peer waits this long for the DHT to show what others serve.
AUTO_PLAN_WAIT_S = 6.0
PEERS_FILE = "expert-peers.json"


def wall_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- the expert worker process


@dataclass(frozen=True, slots=True)
class ExpertWorkerSpec:
    model: Path
    experts: str
    run_dir: Path
    tls: TlsMaterial
    tls_host: str = "127.0.0.1"
    dtype: str = "float32"
    torch_threads: int = 1
    ready_timeout_s: float = 900.0

    def command(self, ready_file: Path) -> list[str]:
        import sys

        return [sys.executable, "-m", "meshd", "worker", "--model", str(self.model), "--experts", self.experts,
                "--expert-listen", f"{self.tls_host}:0", "--tls-cert", str(self.tls.cert_path),
                "--tls-key", str(self.tls.key_path), "--ready-file", str(ready_file), "--dtype", self.dtype,
                "--threads", str(self.torch_threads)]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                 if p])
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(self.torch_threads)
        env["PYTHONUNBUFFERED"] = "1"
        return env


@dataclass(frozen=True, slots=True)
class ExpertReady:
    port: int
    pid: int
    info: dict


class ExpertWorkerProcess(WorkerProcess):
    """The life of ``meshd worker --experts``: spawn, wait for its ready file, then for its exit."""

    async def life(self, on_ready, state: WorkerState) -> int:
        spec = self.spec
        spec.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ready_file = spec.run_dir / "expert-worker-ready.json"
        ready_file.unlink(missing_ok=True)
        ready_line = trio.Event()
        proc = ChildProcess.spawn(spec.command(ready_file), spec.env())
        state.pid = proc.pid
        log_path = spec.run_dir / "expert-worker.log"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, proc.stdout, log_path, state, ready_line)
                nursery.start_soon(self._pump, proc.stderr, log_path, state, None)
                await ready_or_exit(proc, ready_line, spec.ready_timeout_s, "the expert worker")
                if proc.returncode is not None:
                    nursery.cancel_scope.cancel()
                    return proc.returncode
                try:
                    info = json.loads(ready_file.read_text()[:65536])
                    port = int(str(info["expert_listen"]).rpartition(":")[2])
                except (OSError, ValueError, KeyError) as exc:
                    raise WorkerFailed(f"the expert worker's ready file is unusable: {exc}") from exc
                if not info.get("validation", {}).get("ok"):
                    raise WorkerFailed("the expert worker did not validate its experts")
                state.endpoint = f"{spec.tls_host}:{port}"
                await on_ready(ExpertReady(port, proc.pid, info))
                code = await proc.wait()
                nursery.cancel_scope.cancel()
                return code
        finally:
            with trio.CancelScope(shield=True):
                await self.stop_and_drain(proc, log_path, state)


# --------------------------------------------------------------------------- the advertiser


class ExpertAdvertiser(RecordSchedule[ExpertClaim, ExpertRecord]):
    """Advertiser's schedule (publish, republish every ttl/3, withdraw) for an expert record."""

    def _sign(self, claim: ExpertClaim) -> ExpertRecord:
        now = self.wall_ms()
        raw = sign_experts(claim, self.identity.signing_key, peer_id=self.identity.peer_id,
                           sequence=self._next_sequence(now), now_ms=now, ttl_ms=self.ttl_ms)
        return validate_experts(raw, now)

    def _withdrawal(self, digest: str) -> ExpertRecord:
        now = self.wall_ms()
        raw = sign_experts_withdrawal(digest, self.identity.signing_key, peer_id=self.identity.peer_id,
                                      sequence=self._next_sequence(now), now_ms=now, ttl_ms=self.ttl_ms)
        return validate_experts(raw, now)


# --------------------------------------------------------------------------- the part


def _model_facts(model: Path, dtype: str) -> tuple[dict, ExpertFootprint, str]:
    """(config.json, the expert footprint, the torch recipe digest) -- blocking, run in a thread."""
    from shard.experts.adapters import moe_layers
    from shard.model.artifact import torch_recipe

    config = json.loads((model / "config.json").read_text())
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model).get_text_config(decoder=True)
    width = 2 if dtype == "bfloat16" else 4
    inter = int(getattr(cfg, "moe_intermediate_size", 0) or 0)
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    footprint = ExpertFootprint(num_layers=cfg.num_hidden_layers, moe_layers=tuple(moe_layers(cfg)),
                                num_experts=int(getattr(cfg, "num_experts", 0) or 0), has_shared=shared > 0,
                                routed_bytes=3 * cfg.hidden_size * inter * width,
                                shared_bytes=(3 * cfg.hidden_size * shared + cfg.hidden_size) * width)
    return config, footprint, torch_recipe(dtype, config["model_type"]).digest()


class ExpertPart:
    def __init__(self, node) -> None:
        self.node = node
        self.config = node.config
        self.peers_file = self.config.data_dir / PEERS_FILE
        self.holder = self.config.layers is not None and (self.config.experts is not None
                                                          or self.config.offload_experts)
        self.expert_peer = self.config.expert_peer
        self.digest: str | None = None
        self.footprint: ExpertFootprint | None = None
        self.spec: str | None = None if self.config.experts == "auto" else self.config.experts
        self.supervisor: Supervisor | None = None
        self.advertiser = ExpertAdvertiser(node.identity, node.dht.publish_experts, ttl_s=self.config.record_ttl_s,
                                           wall_ms=wall_ms)
        self._ready: ExpertReady | None = None
        self.last_placements: list = []
        self.note = ""

    def act(self) -> int:
        return W.ACT_Q8 if self.config.expert_act == "q8" else W.ACT_F32

    async def _describe(self) -> str:
        from meshd.plan.modelinfo import model_digest

        self.digest = await trio.to_thread.run_sync(model_digest, self.config.model)
        _, self.footprint, recipe = await trio.to_thread.run_sync(_model_facts, self.config.model,
                                                                  self.config.worker.dtype)
        return recipe

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()   # the shard worker starts meanwhile (a holder's waits for the peer file)
        recipe = await self._describe()
        async with trio.open_nursery() as nursery:
            if self.holder:
                nursery.start_soon(self._directory, recipe)
            if self.expert_peer:
                await nursery.start(self.advertiser.run)
                if self.spec is None:
                    self.spec = await self._plan_auto()
                w = self.config.worker
                # The expert worker reuses WorkerProcess's log pump and stop with a spec of its own.
                worker = ExpertWorkerProcess(ExpertWorkerSpec(  # type: ignore[arg-type]
                    model=self.config.model, experts=self.spec, run_dir=self.config.data_dir, tls=self.node.tls,
                    tls_host=self.node.tls_bind_host, dtype=w.dtype, torch_threads=w.torch_threads,
                    ready_timeout_s=w.ready_timeout_s), progress=lambda line: self.node.progress(f"experts: {line}"))
                # The supervisor hands on_ready whatever its life reports ready: here an ExpertReady.
                self.supervisor = Supervisor(worker.life, on_ready=self._on_ready,  # type: ignore[arg-type]
                                             on_down=self._on_down,
                                             backoff=Backoff(w.restart_backoff_s, w.restart_backoff_max_s))
                self.node.progress(f"starting the expert worker for experts {self.spec} of {self.config.model}")
                await nursery.start(self.supervisor.run)

    # ------------------------------------------------------------------ expert peer
    async def _plan_auto(self) -> str:
        assert self.footprint is not None and self.digest is not None
        with trio.move_on_after(AUTO_PLAN_WAIT_S):
            while not self.node.host.get_connected_peers():  # noqa: ASYNC110 - py-libp2p has no connection event
                await trio.sleep(0.5)
        await trio.sleep(min(2.0, AUTO_PLAN_WAIT_S))   # let the records reach us
        from dht import keys as K

        records = await self.node.dht.fetch_experts(self.digest)
        holders = await self.node.dht.fetch(K.model_key(self.digest))
        now = wall_ms()
        needed = demand(holders, now)   # what holders said they lack, first
        spec = plan_experts(self.footprint, coverage(records, now), int(self.config.memory_bytes),
                            needed=needed)
        if not len(spec):
            raise WorkerFailed(f"--memory {self.config.memory_bytes} B holds not even one expert "
                               f"({self.footprint.routed_bytes} B each)")
        self.node.progress(f"experts auto: taking {spec} ({len(spec)} experts) from the DHT view")
        return str(spec)

    async def _on_ready(self, ready: ExpertReady) -> None:
        self._ready = ready
        self.refresh_claim()

    async def _on_down(self) -> None:
        self._ready = None
        if self.advertiser.claim is not None:
            self.node.progress("expert worker down: withdrawing our expert record")
        self.advertiser.set_claim(None)

    def refresh_claim(self) -> None:
        """(Re)build the expert claim; only a directly dialable node advertises an endpoint."""
        ready, relaying = self._ready, self.node.relaying
        if ready is None or not relaying.decided:
            return
        if relaying.private:
            self._note("expert peers must be directly dialable; this node is behind NAT: not advertising")
            return
        from shard.experts.spec import ExpertSpec

        info, fp = ready.info, self.footprint
        assert fp is not None   # read with the model, before the worker started
        claim = ExpertClaim(model_artifact_digest=info["fingerprint"]["artifact"],
                            runtime_recipe_digest=info["fingerprint"]["recipe"],
                            runs=runs_of(ExpertSpec.parse(info["experts"])), num_layers=fp.num_layers,
                            num_experts=fp.num_experts, endpoint=f"{self.node.advertise_host}:{ready.port}",
                            tls_cert_sha256=self.node.tls.sha256, protocol_versions=tuple(info["versions"]),
                            acts=tuple(info["acts"]),
                            ms_per_expert_row=float(info["validation"]["ms_per_expert_row"]),
                            weight_bytes=int(info.get("weight_bytes", 0)))
        if self.advertiser.claim == claim:
            return
        first = self.advertiser.claim is None
        self.advertiser.set_claim(claim)
        if first:
            self.node.progress(f"ready: serving experts {info['experts']} at {claim.endpoint}, advertising")

    async def withdraw_now(self) -> None:
        await self.advertiser.withdraw_now()

    # ------------------------------------------------------------------ holder
    async def _directory(self, recipe: str) -> None:
        from shard.experts.pool import placements_to_json

        me = self.node.identity.peer_id
        last = None
        while True:
            try:
                records = await self.node.dht.fetch_experts(self.digest)
                found = placements(records, recipe=recipe, now_ms=wall_ms(), act=self.act(), exclude={me})
                text = placements_to_json(found)
                if text != last:
                    tmp = self.peers_file.with_name(f".{PEERS_FILE}.{os.getpid()}.tmp")
                    tmp.write_text(text)
                    os.replace(tmp, self.peers_file)
                    last = text
                    self.last_placements = found
                    self.node.progress("expert peers: " + (", ".join(f"{p.peer_id[-8:]} {p.experts}" for p in found)
                                                           or "none yet"))
            except Exception as exc:  # noqa: BLE001 - the DHT layer's faults: keep the last file, retry
                log.info("expert directory refresh failed: %s", exc)
            await trio.sleep(EXPERT_REFRESH_S)

    def _note(self, line: str) -> None:
        if line != self.note:
            self.node.progress(line)
        self.note = line

    def status(self) -> dict:
        out: dict = {"role": "expert peer" if self.expert_peer else "holder", "experts": self.spec}
        if self.expert_peer:
            advert = self.advertiser.status()
            out.update(advertising=advert.advertising, sequence=advert.sequence,
                       worker=self.supervisor.state.as_dict() if self.supervisor else {"state": "none"})
        if self.holder:
            out["peers"] = [{"peer_id": p.peer_id, "endpoint": f"{p.host}:{p.port}", "experts": str(p.experts)}
                            for p in self.last_placements]
        return out
