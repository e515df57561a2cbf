"""The daemon's swarm part: tracker duty, automatic ranges, directives, generation.

    Swarm.run  (child of the daemon's nursery; meshd/daemon/node.py starts it)
    ├── worker slot     meshd/daemon/worker_slot.py   (only with --layers auto)
    └── refresh loop    every DUTY_REFRESH_S:
          read the model's live ads (meshd/swarm/view.py)
          not serving yet (auto)  -> meshd/swarm/member.py join_step: wait for the swarm's records,
                                     plan our own range (no tracker), or ask the tracker (/meshd/join/1)
          on tracker duty         -> push the moves that close a gap (meshd/swarm/tracker_duty.py);
                                     a refused or undelivered move is reported back to the duty
    stream handlers: /meshd/join/1 (answered by TrackerDuty when on duty),
                     /meshd/directive/1 (accepted via directives.accept_directive)
    control API:     "generate" (meshd/generate/service.py), "swarm" (this view)

A directive is acted on only after ``accept_directive`` said yes in this
node's own view (current tracker, expiry, replay ledger, no gap while our
worker has sessions; meshd/swarm/member.py take_directive); LOAD (re)starts
the worker on the range, DROP stops it.
Nodes started with a fixed ``--layers A:B`` refuse directives: the user chose.

A client-only node (``--layers none``) has no tracker duty at all (it holds
no layers, so the ranking, which counts layer-0 servers, never names it
either): its refresh loop only keeps the snapshot and the mesh fresh, it
refuses join asks and directives, and its generations plan routes whose
every hop is a remote peer (meshd/generate/service.py).

A ``.gguf`` is a model like an artifact directory: its digest (a slice's:
its source's), footprint (tensor infos) and tokenizer (its metadata) come
from the file. A node holding a slice plans, asks and accepts only ranges
inside it, and advertises no memory budget (never moved by rebalancing).

A node started with ``--model ROOT`` holds no file at first: the fetch part
(meshd/daemon/fetch_part.py) gives the model's facts from its manifest and
metadata, every range it is to serve -- the tracker's assignment, a LOAD, or
a fixed ``--layers A:B`` -- is fetched first (``WorkerSlot(resolve=...)``),
and it asks the tracker to prefer the range it already holds. It is not
bound to what it holds: it fetches whatever the tracker assigns.

``pool_status`` is what this node says about layers without a server (the
status reply, the dashboard, the API's 503): meshd/swarm/view.py over the
latest snapshot.

State: the model digest and footprint (from the artifact or, with ``--model
ROOT``, its manifest, once, with the
lane's estimates of working memory and process bases; each refresh plans
with the figures nodes of our backend measured instead, once the records
carry any: meshd/plan/footprint.py measured_footprint), the last
snapshot, the directive ledger, the worker slot. Everything else is the
daemon's (Node) and is read through it. ``Swarm`` is also what the generate
core sees of the node (meshd/generate/entry_view.py ``EntryView``: identity,
model, snapshot, own worker), so generate/ never reaches into the daemon.
"""
from __future__ import annotations

import logging
import random
import time

import trio

from meshd.daemon.worker_slot import WorkerSlot
from meshd.errors import DaemonError
from meshd.generate.audit import AuditBook
from meshd.generate.entry_view import OwnWorker
from meshd.generate.routes import LoadBook
from meshd.plan.adverts import CoverageMap, Span
from meshd.plan.assignment import JoinRequest, ModelFootprint
from meshd.plan.directives import DirectiveLedger, NodeView
from meshd.plan.tracker import current_tracker, epoch_at
from meshd.sizes import format_size
from meshd.swarm.member import PlanOwn, Wait, join_step, open_for, take_directive
from meshd.swarm.tracker_duty import DUTY_REFRESH_S, TrackerDuty
from meshd.swarm.view import SwarmSnapshot, fetch_snapshot, pool_status
from meshd.swarm.wire import DIRECTIVE_PROTOCOL, JOIN_PROTOCOL, SwarmUnreachable, exchange, serve
from proto import shard_runtime_pb2 as pb
from proto.errors import MeshdError

log = logging.getLogger(__name__)

# Peers of our model we dial per refresh when not connected yet, and how long
# each dial may take. A home swarm becomes a full mesh among the nodes of a
# model, so records reach every node directly and the swarm survives the
# death of the node everyone bootstrapped through.
MAX_MESH_DIALS = 8
MESH_DIAL_TIMEOUT_S = 5.0
# An auto node with bootstrap peers (or mDNS) that sees no tracker plans its own range
# only after this long: right after start its DHT view may not hold the
# swarm's records yet, and nine joiners that plan against an empty view all
# take the same first window (the tracker, once seen, tracks what it assigned).
NO_TRACKER_GRACE_S = 20.0


def wall_ms() -> int:
    return int(time.time() * 1000)


class Swarm:
    def __init__(self, node, *, refresh_s: float = DUTY_REFRESH_S) -> None:
        self.node = node
        self.config = node.config
        self.refresh_s = refresh_s
        self.auto = bool(self.config.auto_layers)
        self.client = bool(self.config.client_only)   # --layers none: no duty, no range, generate only
        self.by_root = self.config.model_root is not None   # --model ROOT: every range is fetched first
        self.kv_budget = self.config.worker.kv_budget_tokens   # the worker admits against the same number
        resolve = self._resolve if self.by_root else None
        self.slot = WorkerSlot(node, memory_bytes=self.config.memory_bytes or 0, resolve=resolve) \
            if self.auto or self.by_root else None
        self.digest: str | None = None
        self.num_layers = 0
        self.held: Span | None = None  # the layers a GGUF slice holds (None: the whole model)
        self.duty: TrackerDuty | None = None
        self.estimated: ModelFootprint | None = None   # the model's footprint with the lane's estimates
        self.snapshot: SwarmSnapshot | None = None
        self.ledger = DirectiveLedger()
        self.pins: dict[str, bytes] = {}
        self.frames: dict[str, str] = {}   # peer id -> framed fast path, from the record that gave its pin
        self.last_join: str = ""
        self.tokenizer = None
        self.tokenizer_path = None   # the file or directory the entry's tokenizer is read from
        self._tokenizer_known = trio.Event()
        self.context_tokens = 0   # the model's trained context (set with the model's description)
        self.load = LoadBook()   # our running generations' sessions per peer (routes spread by it)
        self.audit_book = AuditBook()   # our audits' figures and the peers they caught (generate/audit.py)
        self.started = time.monotonic()

    # ------------------------------------------------------------------ setup
    async def _describe_by_root(self) -> None:
        from meshd.fetch.facts import footprint

        fetch = self.node.fetch
        facts = await fetch.describe()
        self.digest, self.num_layers, self.context_tokens = self.config.model_root, facts.num_layers, \
            facts.context_tokens
        self.held = None      # nothing binds us: any range can be fetched
        fp = footprint(facts, fetch.manifest, self.config.worker.backend, self.config.worker.dtype)
        self.estimated = fp   # the lane's estimates; measured figures replace them (_measured)
        self.duty = TrackerDuty(self.node.identity.peer_id, fp, self.node.identity.signing_key,
                                self.kv_budget, rng=random.Random())
        self.node.progress(f"model {self.digest[:23]}...: {self.num_layers} layers, "
                           f"{fetch.manifest.total_bytes / 1e6:.0f} MB in all; serving a range fetched from peers")

    async def _resolve(self, layers: tuple[int, int]):
        """--model ROOT: the slice to run ``layers`` from (fetched first when we do not hold it)."""
        path = await self.node.fetch.ensure(layers)
        if self.tokenizer_path is None:
            self._known_tokenizer(path)
        return path

    def _known_tokenizer(self, path) -> None:
        self.tokenizer_path = path
        self._tokenizer_known.set()

    async def _describe_model(self) -> None:
        from meshd.plan.footprint import model_footprint
        from meshd.plan.modelinfo import held_layers, model_context_tokens, model_digest, model_num_layers

        if self.by_root:
            await self._describe_by_root()
            return
        model, w = self.config.model, self.config.worker
        self.num_layers = model_num_layers(model)
        self.context_tokens = model_context_tokens(model)   # the driver refuses longer generations at once
        held = held_layers(model)
        self.held = Span(*held) if held else None
        if held is not None:
            self.node.progress(f"{model.name} is a slice holding layers {held[0]}:{held[1]}: "
                               "serving ranges inside it only")
            if self.slot is not None:
                self.slot.memory_bytes = 0  # never a rebalancing candidate: it cannot move outside its slice
        self.node.progress("the model artifact's digest (tracker duty, route planning; cached per file)")
        self.digest = await trio.to_thread.run_sync(model_digest, model, self.node.progress)
        self._known_tokenizer(model)
        if self.client:
            self.node.progress("client-only: holding no layers, generating through the swarm's peers")
            return   # no footprint, no tracker duty: nothing is ever planned for or by this node
        footprint = await trio.to_thread.run_sync(model_footprint, model, self.digest, w.backend, w.dtype)
        self.estimated = footprint   # the lane's estimates; measured figures replace them (_measured)
        self.duty = TrackerDuty(self.node.identity.peer_id, footprint, self.node.identity.signing_key,
                                self.kv_budget, rng=random.Random())

    @property
    def _digest(self) -> str:
        """The model's digest, once read (every caller runs after that)."""
        if self.digest is None:
            raise DaemonError("the model's digest is not read yet")
        return self.digest

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if not self.config.has_model:
            task_status.started()
            return
        await self._describe_model()
        serve(self.node.host, JOIN_PROTOCOL, self._on_join)
        serve(self.node.host, DIRECTIVE_PROTOCOL, self._on_directive)
        async with trio.open_nursery() as nursery:
            if self.slot is not None:
                await nursery.start(self.slot.run)
                if self.by_root and not self.auto:
                    await self.slot.load(self.config.layers)     # a fixed range, fetched first
            if self.config.model is not None and not self.client:
                nursery.start_soon(self.node.fetch.serve_path, self.config.model)   # our copy, for peers
            nursery.start_soon(self._preload_tokenizer)
            task_status.started()
            self.started = time.monotonic()   # the grace before planning alone counts from the first refresh
            while self.digest is not None:
                try:
                    await self.refresh()
                except MeshdError as exc:
                    log.info("swarm refresh: %s", exc)
                await trio.sleep(self.refresh_s)

    async def _preload_tokenizer(self) -> None:
        """The entry's tokenizer, loaded once in the background (transformers imports take seconds)."""
        from meshd.generate.service import load_tokenizer

        await self._tokenizer_known.wait()    # --model ROOT: the first slice we fetch has it
        try:
            tokenizer = await trio.to_thread.run_sync(load_tokenizer, self.tokenizer_path)
        except Exception as exc:  # noqa: BLE001 - generate loads it again and reports the error
            log.info("could not preload the tokenizer: %s", exc)
            return
        self.tokenizer = self.tokenizer or tokenizer

    # ------------------------------------------------------------------ refresh
    async def fresh_snapshot(self) -> SwarmSnapshot:
        snap = await fetch_snapshot(self.node.dht, self._digest, wall_ms())
        self.snapshot = snap
        self.node.fetch.update(snap)    # who we may fetch from
        self.pins.update(snap.pins)
        for peer in snap.pins:   # a peer that stopped offering the fast path loses it here
            if peer in snap.frames:
                self.frames[peer] = snap.frames[peer]
            else:
                self.frames.pop(peer, None)
        return snap

    async def _mesh(self, snap: SwarmSnapshot) -> None:
        """Connect to the model's peers we are not connected to yet (bounded, concurrent)."""
        import multiaddr
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo

        host = self.node.host
        connected = {p.to_base58() for p in host.get_connected_peers()}
        todo = [(p, a) for p, a in snap.addrs.items()
                if a and p != self.node.identity.peer_id and p not in connected][:MAX_MESH_DIALS]

        async def dial(peer: str, addrs: tuple[str, ...]) -> None:
            with trio.move_on_after(MESH_DIAL_TIMEOUT_S):
                try:
                    await host.connect(PeerInfo(ID.from_base58(peer),
                                                [multiaddr.Multiaddr(a.split("/p2p/")[0]) for a in addrs]))
                except Exception as exc:  # noqa: BLE001 - an unreachable peer is the routing planner's business
                    log.info("mesh dial to %s failed: %s", peer[:16], exc)

        async with trio.open_nursery() as nursery:
            for peer, addrs in todo:
                nursery.start_soon(dial, peer, addrs)

    def _measured(self, snap: SwarmSnapshot) -> None:
        """Plan with the working memory and bases nodes of our backend measured and published
        (meshd/plan/footprint.py measured_footprint), not the lane's estimates, once there are any."""
        from meshd.plan.footprint import measured_footprint

        if self.duty is not None and self.estimated is not None:
            self.duty.footprint = measured_footprint(self.estimated, snap.ads, self.config.worker.backend)

    async def refresh(self) -> None:
        snap = await self.fresh_snapshot()
        await self._mesh(snap)
        if self.duty is None:
            return   # a client-only node: the view and the mesh are all it keeps
        self._measured(snap)
        now = wall_ms()
        if self.auto and self.slot is not None and (self.slot.layers is None or self.slot.failure):
            await self._join(snap, now)
        for target, records in self.duty.rebalance(snap, now):
            await self._push(target, records, snap)

    async def _join(self, snap: SwarmSnapshot, now: int) -> None:
        duty, slot = self.duty, self.slot
        assert duty is not None and slot is not None   # refresh() checked both
        prefer = self.node.fetch.prefer() if self.by_root else None   # --model ROOT: what we fetched before
        request = JoinRequest(self.node.identity.peer_id, int(self.config.memory_bytes), self.kv_budget, self.held,
                              Span(*prefer) if prefer else None)
        waiting = self.node.expects_peers and time.monotonic() - self.started < NO_TRACKER_GRACE_S
        step = join_step(duty, snap, now, request, waiting=waiting)
        if isinstance(step, Wait):
            self._note_join(step.note)
            return
        if isinstance(step, PlanOwn):
            plan = step.assignment
            self.node.progress(f"no tracker for the model yet: taking layers {plan.span.start}:{plan.span.end} "
                               f"({format_size(plan.needed_bytes)} of {format_size(request.memory_bytes)})")
            await slot.load((plan.span.start, plan.span.end))
            return
        tracker = step.tracker
        try:
            raw = await exchange(self.node.host, tracker, snap.addrs.get(tracker, ()), JOIN_PROTOCOL,
                                 step.ask.SerializeToString(), relayed=snap.relayed.get(tracker, ()))
            reply = pb.JoinReply.FromString(raw)
        except (SwarmUnreachable, MeshdError, ValueError) as exc:
            self._note_join(f"tracker {tracker[:16]} unreachable: {exc}")
            return
        if not reply.HasField("directive"):
            self._note_join(f"tracker {tracker[:16]} refused: {reply.refusal[:300]}")
            return
        ack = await self._apply(reply.directive.SerializeToString())
        if not ack.accepted:
            self._note_join(f"refused the tracker's directive: {ack.detail}")

    def _note_join(self, line: str) -> None:
        if line != self.last_join:
            self.node.progress(line)
        self.last_join = line

    async def _push(self, target: str, records: list[bytes], snap: SwarmSnapshot) -> None:
        duty = self.duty
        assert duty is not None   # only a serving node's tracker duty pushes
        for record in records:
            try:
                raw = await exchange(self.node.host, target, snap.addrs.get(target, ()), DIRECTIVE_PROTOCOL, record,
                                     relayed=snap.relayed.get(target, ()))
                ack = pb.DirectiveAck.FromString(raw)
            except (MeshdError, ValueError) as exc:
                log.info("directive to %s not delivered: %s", target[:16], exc)
                duty.push_failed(target, wall_ms())
                return
            self.node.progress(f"tracker: directive to {target[:16]}: "
                               + ("accepted" if ack.accepted else f"refused ({ack.reason}: {ack.detail[:200]})"))
            if not ack.accepted:
                duty.push_failed(target, wall_ms())
                return

    # ------------------------------------------------------------------ directives
    def _active_sessions(self) -> int:
        sup = self.node.supervisor
        return int(sup.state.health.get("active_sessions", 0)) if sup is not None else 0

    async def _apply(self, record: bytes) -> pb.DirectiveAck:
        """Verify and accept one signed directive in our own fresh view (meshd/swarm/member.py); act on it."""
        role = "client" if self.client else "auto" if self.auto and self.slot is not None else "fixed"
        opened = open_for(record, role)
        if isinstance(opened, pb.DirectiveAck):
            return opened
        directive, signer = opened
        snap = await self.fresh_snapshot()
        view = NodeView(self.node.identity.peer_id, self._digest, self.num_layers, snap.ads,
                        active_sessions=self._active_sessions())
        verdict = take_directive(directive, signer, view=view, ledger=self.ledger, now_ms=wall_ms(), held=self.held)
        if verdict.ledger is not None:
            self.ledger = verdict.ledger
        if verdict.note:
            self.node.progress(verdict.note)
        slot = self.slot
        if slot is None:   # open_for refuses load/drop directives to fixed and client nodes
            return verdict.ack
        if verdict.action == pb.DIRECTIVE_ACTION_DROP_SHARD:
            await slot.drop()
        elif verdict.action == pb.DIRECTIVE_ACTION_LOAD_SHARD and verdict.span is not None:
            await slot.load((verdict.span.start, verdict.span.end))
        return verdict.ack

    async def _on_directive(self, remote: str, body: bytes) -> bytes:
        return (await self._apply(body)).SerializeToString()

    async def _on_join(self, remote: str, body: bytes) -> bytes:
        try:
            ask = pb.JoinAsk.FromString(body)
        except ValueError:
            return pb.JoinReply(refusal="JoinAsk does not parse").SerializeToString()
        if self.duty is None:
            return pb.JoinReply(refusal="this node has no tracker duty").SerializeToString()
        snap = await self.fresh_snapshot()
        self._measured(snap)
        return self.duty.answer_join(remote, ask, snap, wall_ms()).SerializeToString()

    # ------------------------------------------------------------------ the generate core's view
    @property
    def peer_id(self) -> str:
        return self.node.identity.peer_id

    def own_worker(self) -> OwnWorker | None:
        claim, supervisor = self.node.advertiser.claim, self.node.supervisor
        if claim is None or supervisor is None:
            return None
        return OwnWorker(pb.Fingerprint(model_artifact_digest=claim.model_artifact_digest,
                                        runtime_recipe_digest=claim.runtime_recipe_digest),
                         supervisor.state.endpoint, supervisor.state.unix)

    @property
    def own_dialable(self) -> bool:
        return not self.node.relaying.private

    @property
    def relay_dialer(self):
        return self.node.relay_dialer

    # ------------------------------------------------------------------ control API
    def tracker(self, snap: SwarmSnapshot, now_ms: int) -> str | None:
        """The model's current tracker in this view (the pure ranking; a client-only node has no
        duty of its own but names the tracker as every other node does)."""
        if self.duty is not None:
            return self.duty.tracker(snap, now_ms)
        return current_tracker(snap.ads, model_digest=self._digest, epoch=epoch_at(now_ms), now_ms=now_ms)

    def pool_status(self, exclude=()) -> dict | None:
        """Layers without a server and what closes them, from the latest snapshot (meshd/swarm/view.py):
        the same answer on every node; the tracker adds the loads it is waiting for."""
        snap = self.snapshot
        if snap is None or not self.digest or not self.num_layers:
            return None
        now = wall_ms()
        tracker = self.tracker(snap, now)
        pending = None
        if self.duty is not None and tracker == self.node.identity.peer_id:
            pending = {peer: span for peer, (span, until) in self.duty.pending.items() if until > now}
        return pool_status(snap, self.duty.footprint if self.duty is not None else None, self.kv_budget, now,
                           num_layers=self.num_layers, tracker=tracker, pending=pending, exclude=exclude)

    async def view(self) -> dict:
        snap = await self.fresh_snapshot() if self.digest else None
        now = wall_ms()
        tracker = self.tracker(snap, now) if snap else None
        coverage = None
        if snap is not None:
            cmap = CoverageMap.build(snap.ads, model_digest=self._digest, num_layers=self.num_layers)
            coverage = {"fully_covered": cmap.fully_covered, "counts": list(cmap.counts),
                        "gaps": [[g.start, g.end] for g in cmap.gaps()]}
        return {"peer_id": self.node.identity.peer_id, "role": self.config.role,
                "model_digest": self.digest, "num_layers": self.num_layers,
                "tracker": tracker, "on_duty": tracker == self.node.identity.peer_id,
                "auto": self.auto, "layers": list(self.slot.layers) if self.slot and self.slot.layers else
                (list(self.config.layers) if self.config.layers else None),
                "serving": bool(self.node.advertiser.claim), "coverage": coverage,
                "pool": self.pool_status() if snap else None,
                "ads": [{"peer_id": a.peer_id, "start": a.start, "end": a.end} for a in snap.ads] if snap else [],
                "relayed": {pid: list(addrs) for pid, addrs in snap.relayed.items()} if snap else {}}
