"""The entry's side of a pushed route: inputs to the head, tokens from the tail.

``PushDriver`` is the route driver (driver.py: same planning, failover,
cancellation, replay batches, stats) with the push topology, closed into a loop:

    entry --prompt--> head --rows--> hop 2 --rows--> ... --> tail --token--> entry
                       ^                                      |
                       +------------- token ------------------+

hops + 1 messages per decode token (the star takes 2 x hops), of which a token
waits for hops: the tail sends each token it draws straight to the head as
its next input (``SessionOpen.push_loop``; the head is the tail's ``push_next``),
and its answer to the entry travels off the token's path. The tail knows where
the generation ends -- the stop tokens (``TailOptions.stop_token_ids``) and the
session's length -- and the entry applies the same rule to know what the head
was sent (``_note_looped``). The entry still opens one Session stream per hop
(its "control" stream, shard/push/hub.py): the SessionOpen says ``push`` and,
for every non-tail hop, ``push_next`` -- the successor's peer id, endpoint,
certificate pin (from its signed record, as the entry's own connector pins it)
and the epoch of the successor's session. A hop pushes only there. On the
control streams the entry hears the tail's answers, credits from the head,
and failure reports: a hop that cannot reach (or is refused by) its successor
names it in ``ShardStatus.failed_peer_id``; a dead hop's own stream breaks.
Silence is covered by one step deadline for the whole route, learnt from the
route's measured steps (deadlines.py on the tail's link); when it passes,
each remote hop is asked for Health and the first that does not answer is the
failed one (all answer: the tail is blamed, so the driver's slow-peer retry
applies).

The head's decode inputs are numbered DECODE_STEP_BASE + position, by the
entry and by the tail alike, so a second copy of one is a duplicate the head
answers without running it. The head is a loop's head only when the tail can
dial it: a peer's direct endpoint, or this node's own worker unless the node is
private. A tail that cannot reach the head after all reports it; the entry asks
the head for Health: a silent head is a failed hop like any other (a replica
takes over, still looped); a head that answers means the tail cannot dial it,
and the entry turns the loop off for that generation and
restarts the route entry-fed (``_unloop``). Entry-fed (unlooped) routes send
the head every decode input themselves, from the tail's reader thread the
moment the token arrives (the continuation, ``_arm``), before the driver
thread wakes up.

State the entry keeps: the token history (boundary 0), which positions the
head has its input for (sent by the entry or by the tail), which successor
(peer, epoch) each hop pushes to. Boundary rows between hops are kept by the
hops themselves (shard/push/hub.py).

Recovery: the driver's failover picks the replacement route (the prefix
before the failed hop kept, the rest fresh at a bumped epoch); then, before
the next step, every fresh hop is opened, each kept hop whose successor
changed gets a ``PushRepoint`` (it re-sends every row it holds, in the
batches it first sent them, to the replacement, which pushes its outputs on),
and a fresh head is fed the token history in the driver's ``_replay``
batches, the fresh tail looping from the next position on (``push_loop_from``);
a kept head gets its next input from the fresh tail, which re-draws the tokens
of the rows it is re-sent. Answers for positions before the one awaited are
dropped. Same inputs in the same batch shapes on the same recipe: greedy and
seeded tokens are identical with and without a failure.

When push does not fit (a relayed hop -- workers cannot dial relay circuits,
the libp2p host lives in the daemon --, a non-head hop that is this node's own
worker, which peers could only reach on its TLS port, or a hop without a
certificate pin) the route runs as a star (driver.py), and a route that
turns unpushable on failover restarts every hop fresh as a star.
``topology="star"`` forces the star (``meshd bench swarm`` compares both).
"""
from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from meshd.errors import HopFailure
from meshd.generate.driver import WATCHDOG_TICK_S, FailoverEvent, SwarmDriver
from meshd.generate.hop_link import HopLink, LinkSpec, StepCounter, TailOut, read_answer
from meshd.plan.routing import Hop, Route
from proto import fastpath, wire
from proto import shard_runtime_pb2 as pb
from proto.chunking import plan_prefill_chunks
from proto.errors import LocalError, MeshdError
from proto.frames import SCHEMA_VERSION
from proto.hop_transport import HopTransport, TransportError, TransportStatus, Unary
from proto.limits import DECODE_STEP_BASE
from proto.threads import ThreadGroup
from shard.session.stream import HIDDEN, TOKEN_IDS

TOPOLOGIES = ("push", "star")
# Health probe of a hop after the route's step deadline passed.
PROBE_TIMEOUT_S = 2.0
# A release is a courtesy; never wait long for its acknowledgement.
RELEASE_WAIT_S = 2.0
# A closed link's reader thread ends with its stream; it may first finish a frame it is handling.
READER_JOIN_S = 5.0


class PushLink(HopLink):
    """A hop's control stream of a pushed route: sends inputs (head), a reader thread hears the rest."""

    def __init__(self, index: int, spec: LinkSpec, connect: Callable[[], HopTransport], *, patience: float,
                 events: queue.Queue, threads: ThreadGroup, own: bool = False) -> None:
        super().__init__(index, spec, connect, patience=patience)
        self._events = events
        self._threads = threads            # the generation's: joined when it ends
        self._own = own                    # our own worker (never asked for Health)
        self._opened = False
        self._closing = False
        self._cond = threading.Condition()
        self._credits = 0
        self._released = threading.Event()
        self._reader: threading.Thread | None = None
        self.fed = 0                       # positions the head has (or will have) its input for
        self.loop = False                  # the tail of a looped route: sends its tokens to the head
        self.loop_from = 0                 # ... drawn for positions from this one on
        self.fed_at_ns = 0                 # perf_counter_ns of the last decode step sent to this hop
        self.continued = 0                 # ``fed`` right after the continuation's last send
        # the tail's: called with each decode answer before the driver hears it
        self.continuation: Callable[[pb.SessionResponse], None] | None = None
        self.target: pb.PushTarget | None = None
        self.successor: tuple[str, int] | None = None

    @property
    def is_open(self) -> bool:
        return self._opened

    def open(self) -> None:
        resp = self._open_session(push=True, push_next=self.target, push_loop=self.loop,
                                  push_loop_from=self.loop_from)
        self._credits = resp.accepted.flow_control.credits_granted
        self.successor = None if self.target is None else (self.target.peer_id, self.target.route_epoch)
        self._opened = True
        self._reader = self._threads.start(self._read_loop, name=f"push-hop-{self.index}")

    # ------------------------------------------------------------------ reader thread
    def _read_loop(self) -> None:
        events = self._events
        try:
            while (body := self.stream.receive()) is not None:
                self.received_bytes += len(body)
                try:
                    resp, tensors = read_answer(body)
                except MeshdError as exc:
                    events.put((self, self.fail(f"bad response: {exc}", pb.ERROR_CODE_PROTOCOL_VIOLATION)))
                    return
                kind = resp.WhichOneof("kind")
                if kind == "flow_control":
                    with self._cond:
                        self._credits += resp.flow_control.credits_granted
                        self._cond.notify_all()
                elif kind == "status":
                    st, err = resp.status, resp.status.error
                    name = pb.ErrorCode.Name(err.code) if err.code in pb.ErrorCode.values() else str(err.code)
                    if st.failed_peer_id:   # our successor failed, not us
                        failure = HopFailure(self.index + 1, st.failed_peer_id, f"{name}: {err.detail}", err.code)
                    else:
                        failure = self.fail(f"{name}: {err.detail}", err.code)
                    events.put((self, failure))
                    if st.terminal:
                        return
                elif kind == "ack":
                    self._released.set()
                elif kind in ("decode", "chunk"):
                    continuation = self.continuation
                    if continuation is not None and kind == "decode":
                        continuation(resp)
                    events.put((self, (resp, tensors, len(body))))
            if not self._closing:
                events.put((self, self.fail("the stream ended", pb.ERROR_CODE_PROTOCOL_VIOLATION)))
        except TransportError as exc:
            if not self._closing:
                events.put((self, self.fail(f"transport: {exc.status.value}")))
        finally:
            self._released.set()

    # ------------------------------------------------------------------ sending
    def _credit(self, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._credits > 0 or self._closing, timeout_s):
                raise self.fail(f"no flow-control credit for {timeout_s:.1f} s", pb.ERROR_CODE_DEADLINE_EXCEEDED)
            self._credits -= 1

    def try_feed_token(self, token: int, step: StepCounter) -> bool:
        """Send the decode step of position ``fed`` with ``token`` as its input if a credit is there
        now (never waits: the continuation runs on the tail's reader thread); False otherwise."""
        with self._cond:
            if self._credits <= 0 or self._closing:
                return False
            self._credits -= 1
        first = self.fed
        idem = DECODE_STEP_BASE + first    # as a looped tail numbers the head's inputs
        self.fed_at_ns = time.perf_counter_ns()
        ids = np.array([token], dtype=np.int64)
        body = fastpath.decode_request_bytes(idem, first, first, TOKEN_IDS, ids, legs=1) or wire.request_decode(
            pb.DecodeStep(idempotency_step=idem, position=first, expected_past_len=first, legs=1), TOKEN_IDS, ids)
        self.fed = self.continued = first + 1   # before the send: its answer may come back at once
        self._send(body, work=False)
        return True

    def feed(self, inputs: np.ndarray, step: StepCounter, timeout_s: float) -> None:
        """Send positions ``[fed, fed + n)`` (the head; no answer awaited here)."""
        first, n = self.fed, int(inputs.shape[0])
        name = TOKEN_IDS if self.spec.effective_start == 0 else HIDDEN
        if n == 1 and first > 0:
            head = pb.DecodeStep(idempotency_step=DECODE_STEP_BASE + first, position=first, expected_past_len=first,
                                 legs=1)
            body = wire.request_decode(head, name, inputs)
            self._credit(timeout_s)
            self.fed_at_ns = time.perf_counter_ns()
            self.fed = first + 1               # before the send: the continuation checks it on the answer
            self._send(body, work=False)
            return
        plan = plan_prefill_chunks(n, self.spec.chunk_tokens)
        s = self.spec
        for index, (offset, count) in enumerate(plan):
            idem = step.next()
            env = pb.Envelope(
                schema_version=SCHEMA_VERSION, work_id=f"{s.session_id}:{s.epoch}:{idem}",
                route_session_id=s.session_id, route_epoch=s.epoch, fingerprint=s.fingerprint,
                shard_range=pb.ShardRange(start_layer=s.start, end_layer=s.end,
                                          effective_start_layer=s.effective_start),
                phase=pb.PHASE_PREFILL, position=pb.PositionSpan(first_position=first + offset, token_count=count),
                idempotency_step=idem,
                cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=first + offset),
                chunk=pb.ChunkInfo(chunk_index=index, chunk_count=len(plan), final_chunk=index == len(plan) - 1))
            self._credit(timeout_s)
            self._send(wire.request_chunk(env, {name: inputs[offset:offset + count]}), work=False)
        self.fed = first + n

    def repoint(self, target: pb.PushTarget) -> None:
        self._send(pb.SessionRequest(repoint=pb.PushRepoint(next=target)).SerializeToString(), work=False)
        self.target, self.successor = target, (target.peer_id, target.route_epoch)

    def probe(self) -> bool:
        """Does the peer answer Health within PROBE_TIMEOUT_S, transport set-up included? (True when it
        cannot be asked: our own worker, a transport without unary calls.) A frozen peer also stalls
        the first TLS handshake of a frames transport's gRPC fallback, so the whole probe runs against
        one clock, in a thread that ends by itself (the call's own timeout, the certificate fetch's)."""
        if self._own or self.transport is None:
            return True
        transport = self.transport
        answered, verdict = threading.Event(), [False]

        def ask() -> None:
            try:
                transport.unary(Unary.HEALTH, pb.HealthRequest(schema_version=SCHEMA_VERSION).SerializeToString(),
                                PROBE_TIMEOUT_S)
                verdict[0] = True
            except TransportError as exc:
                verdict[0] = exc.status == TransportStatus.UNIMPLEMENTED
            except MeshdError:      # cannot even reach it for a channel (frames' gRPC fallback)
                verdict[0] = False
            finally:
                answered.set()

        self._threads.start(ask, name=f"push-probe-{self.index}")
        return answered.wait(PROBE_TIMEOUT_S) and verdict[0]

    def close(self, *, release: bool) -> None:
        if self.transport is None:
            return
        self._closing = True
        with self._cond:
            self._cond.notify_all()
        try:
            if release and self._opened:
                s = self.spec
                self._send(pb.SessionRequest(release=pb.ReleaseSignal(
                    route_session_id=s.session_id, route_epoch=s.epoch)).SerializeToString(), work=False)
                self._released.wait(RELEASE_WAIT_S)
        finally:
            self._opened = False
            if self._stream is not None:
                self._stream.close_send()
                self._stream.cancel()
            if self._reader is not None and self._reader is not threading.current_thread():
                self._reader.join(READER_JOIN_S)    # it ends with its stream (cancelled above)
            self.transport.close()


class PushDriver(SwarmDriver):
    """The route driver with the push topology (module docstring); ``topology="star"``: the star."""

    def __init__(self, *args, topology: str = "push", loop: bool = True, **kwargs) -> None:
        if topology not in TOPOLOGIES:
            raise LocalError(f"topology must be one of {TOPOLOGIES}")
        super().__init__(*args, **kwargs)
        self.topology = topology
        self.loop_wanted = loop            # close pushed routes into a loop when the head can be dialled
        self.looped = False                # the route in use is a loop (tail -> head)
        self._events: queue.Queue = queue.Queue()
        self._pushing = False
        # The continuation (see _arm): at most one armed at a time, under this lock.
        self._cont_lock = threading.Lock()
        self._armed: tuple[int, PushLink] | None = None
        self._looped_at = -1               # head.fed right after a looped token was noted

    @property
    def pushing(self) -> bool:
        """The route in use is pushed (False: a star, forced or because push does not fit)."""
        return self._pushing

    # ------------------------------------------------------------------ route shape
    def _target_of(self, hop: Hop, *, head: bool = False) -> pb.PushTarget | None:
        """Where a worker may push to ``hop`` (None: it cannot; the connector knows how peers reach
        it: routes.PeerConnector.push_dial)."""
        dial = self.connector.push_dial(hop, head=head)
        if dial is None:
            return None
        return pb.PushTarget(peer_id=hop.peer_id, endpoint=dial.endpoint, tls_cert_sha256=dial.pin,
                             frames_endpoint=dial.frames,
                             shard_range=pb.ShardRange(start_layer=hop.start, end_layer=hop.end,
                                                       effective_start_layer=hop.effective_start),
                             owner_token=self.owner_token(hop.peer_id, hop.start, hop.end))

    def pushable(self, route: Route) -> bool:
        return self.topology == "push" and len(route.hops) > 1 and \
            all(self._target_of(h) is not None for h in route.hops[1:]) and not route.hops[0].relayed

    def _set_route(self, route: Route, keep=None) -> None:
        pushing = self.pushable(route)
        if keep and pushing != self._pushing:       # the topology changes: every hop starts afresh
            for link in keep.values():
                link.close(release=True)
            keep = None
        self._pushing = pushing
        self.looped = pushing and self.loop_wanted and bool(self._tail.stop_token_ids or not self._stop_ids) \
            and self._target_of(route.hops[0], head=True) is not None
        super()._set_route(route, keep)

    @property
    def _push_links(self) -> list[PushLink]:
        """The route's links while pushing (``_new_link`` made each one a PushLink)."""
        return cast(list[PushLink], self._links)

    def _new_link(self, index: int, hop: Hop, num_layers: int) -> HopLink:
        link = super()._new_link(index, hop, num_layers)
        if not self._pushing:
            return link
        return PushLink(index, link.spec, functools.partial(self.connector.transport, hop),
                        patience=link.deadlines.patience, events=self._events, threads=self.threads,
                        own=hop.peer_id == self.connector.self_peer_id)

    def _target(self, index: int, *, head: bool = False) -> pb.PushTarget:
        """The PushTarget of the route's hop ``index`` at its link's epoch (it is pushable)."""
        route = self._route
        assert route is not None   # a pushed step runs on a route
        target = self._target_of(route.hops[index], head=head)
        if target is None:   # pushable() checked every hop this is asked for
            raise LocalError(f"hop {index} cannot be pushed to")
        target.route_epoch = self._links[index].spec.epoch
        return target

    # ------------------------------------------------------------------ stepping
    def _advance(self, target: int) -> TailOut | np.ndarray:
        if not self._pushing:
            answer = super()._advance(target)
            if self.stats.step_hops and len(self.stats.step_legs) < len(self.stats.step_hops):
                self.stats.step_legs.append(2 * self.stats.step_hops[-1])   # counted: one send, one answer per hop
            return answer
        links = self._push_links
        looped = self.looped
        for i in range(len(links) - 1, -1, -1):     # successors first: their sessions exist when pushed to
            link = links[i]
            if not link.is_open:
                if i + 1 < len(links):
                    link.target = self._target(i + 1)
                elif looped:                          # the tail: tokens go to the head from here on
                    link.target, link.loop = self._target(0, head=True), True
                    # a fresh head is fed every known position by us; a kept one has them, or gets the
                    # last one from this tail (it re-draws it from the rows it is re-sent)
                    link.loop_from = target if not links[0].is_open else max(0, target - 1)
                else:
                    link.target = None
                link.open()
        for i, link in enumerate(links[:-1]):
            succ = links[i + 1]
            if link.successor != (succ.spec.peer_id, succ.spec.epoch):
                link.repoint(self._target(i + 1))
        head, tail = links[0], links[-1]
        rows = self._rows[0]
        # the continuation (or, on a loop, the tail) already sent this step's input
        ahead = head.fed == target and (head.continued == target or (looped and self._looped_at == target))
        plain = ahead or head.fed == target - 1 > 0
        positions = max(1, target - head.fed)
        t0 = head.fed_at_ns if ahead else time.perf_counter_ns()
        # A decode step's deadline comes from the route's own measured step times (decode_done below
        # records the whole route's), so it already spans every hop; a chunk's is per hop.
        budget = tail.deadlines.decode_s() if plain else tail.deadlines.chunk_s(positions) * len(links)
        if not looped:                              # armed first: the answer may beat this thread back
            self._arm(target, head, tail)
        try:
            for a, b in self._replay(head.fed, target):
                head.feed(rows.read(a, b), self._steps, budget)
            resp, tensors, nbytes = self._await(target, budget)
        finally:
            self._disarm(tail)
        if looped:
            self._note_looped(target, resp, head, tail)
        elapsed = (time.perf_counter_ns() - t0) / 1e9
        if plain:
            tail.deadlines.decode_done(elapsed)
        else:
            tail.deadlines.chunk_done(positions, elapsed)
        holder = resp.decode if resp.WhichOneof("kind") == "decode" else resp.chunk
        if not holder.HasField("sample"):
            raise tail.fail("the tail sent no sampled token", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        if plain:
            s = self.stats
            s.step_wall_ns.append(time.perf_counter_ns() - t0)
            s.step_execution_ns.append(int(resp.decode.execution_nanos))   # every hop's, summed along the way
            s.step_tail_bytes.append(nbytes)
            s.step_hops.append(len(links))
            s.step_legs.append(int(resp.decode.legs))
        return TailOut(holder.sample, tensors.get("logits"))

    def _note_looped(self, target: int, resp, head: PushLink, tail: PushLink) -> None:
        """The tail drew position ``target``'s token: the same rule as the tail's (PushSession.
        loop_token) says whether it went on to the head, so the head has input up to there."""
        holder = resp.decode if resp.WhichOneof("kind") == "decode" else resp.chunk
        if not holder.HasField("sample"):
            return
        token = int(holder.sample.token_id)
        if target >= tail.loop_from and token not in self._stop_ids and target + 1 < self._max_tokens:
            head.fed = max(head.fed, target + 1)
            head.fed_at_ns = time.perf_counter_ns()
            self._looped_at = target + 1
            self.stats.looped_steps += 1

    # ------------------------------------------------------------------ the continuation
    # In steady decode the next step's input is the token the tail is about to send, so the
    # tail's reader thread sends it to the head the moment it arrives (``try_feed_token``), before
    # the driver thread wakes up: the entry's share of a token's critical path is one parse and
    # one send instead of a thread hand-off, the driver's bookkeeping and the token's delivery.
    # It sends exactly the frame the driver would send next, and only when the driver would:
    # the answer is for the position awaited, the token is no stop id, the generation wants a
    # token more, nothing was cancelled, the head has a credit. Everything else (failures,
    # stats, stop strings, logprobs) stays with the driver; a stop string found by the caller
    # after the token costs the head one step that is released with the session.
    def _arm(self, target: int, head: PushLink, tail: PushLink) -> None:
        """Arm the continuation for the answer at ``target`` (before this step's input is sent:
        ``_continue`` checks that it was)."""
        if target + 1 >= self._max_tokens or head is tail:
            return
        with self._cont_lock:
            self._armed = (target, head)
        tail.continuation = self._continue

    def _disarm(self, tail: PushLink) -> None:
        tail.continuation = None
        with self._cont_lock:
            self._armed = None

    def _continue(self, resp: pb.SessionResponse) -> None:
        decode = resp.decode
        with self._cont_lock:
            armed = self._armed
            if armed is None or decode.past_len != armed[0] or not decode.HasField("sample"):
                return
            self._armed = None
            target, head = armed
            token = int(decode.sample.token_id)
            if self._cancel.is_set() or token in self._stop_ids or head.fed != target:
                return
            try:
                if head.try_feed_token(token, self._steps):
                    self.stats.continued_steps += 1
            except Exception:   # noqa: BLE001 - the driver meets the broken link itself, next step
                pass

    def _await(self, target: int, budget: float):
        deadline = time.monotonic() + budget
        current = set(map(id, self._links))
        tail = self._links[-1]
        while True:
            self._check_cancel()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._silent(budget)
            try:
                link, item = self._events.get(timeout=min(left, WATCHDOG_TICK_S))
            except queue.Empty:
                continue
            if id(link) not in current:
                continue                              # a dropped hop's late words
            if isinstance(item, HopFailure):
                if item.peer_id != link.spec.peer_id and (link.successor is None or item.peer_id != link.successor[0]):
                    continue                          # about a successor this hop no longer pushes to
                raise item
            resp, tensors, nbytes = item
            if link is not tail:
                continue
            kind = resp.WhichOneof("kind")
            done = resp.decode.past_len if kind == "decode" else \
                resp.chunk.envelope.position.first_position + resp.chunk.envelope.position.token_count
            if done == target:
                return resp, tensors, nbytes
            # an answer for an earlier position (a replacement tail re-prefilled): not news

    def _unloop(self, failure: HopFailure, target: int) -> None:
        """The tail could not send a token to the head, whose own stream is fine: the loop is off for
        this generation and the same route restarts entry-fed, every hop fresh at a new epoch."""
        self.loop_wanted = False
        route = self._route
        assert route is not None   # a failover happens on a route
        for link in self._links:
            link.close(release=True)
        while True:                                   # what the old sessions still say is history
            try:
                self._events.get_nowait()
            except queue.Empty:
                break
        self._epoch += 1
        self._set_route(route)
        event = FailoverEvent(failure.peer_id, target, f"{failure} (the loop is off)", route,
                                   tuple(range(len(route.hops))), time.monotonic())
        self.stats.failovers.append(event)
        if self.on_failover is not None:
            self.on_failover(event)

    def _silent(self, budget: float) -> HopFailure:
        for link in self._push_links:
            if not link.probe():
                return HopFailure(link.index, link.spec.peer_id, f"silent past the route's step deadline "
                                  f"({budget:.1f} s) and not answering Health", pb.ERROR_CODE_DEADLINE_EXCEEDED)
        tail = self._links[-1]
        return HopFailure(tail.index, tail.spec.peer_id, f"no token within the route's step deadline ({budget:.1f} s)",
                          pb.ERROR_CODE_DEADLINE_EXCEEDED)

    def _failover(self, failure: HopFailure, target: int) -> None:
        links = self._push_links if self._pushing else self._links
        if self.looped and failure.index == len(links) and links and failure.peer_id == links[0].spec.peer_id:
            # The tail could not reach the head. A head that is gone takes the ordinary failover (a
            # replica, the loop kept); only a head that still answers means the tail cannot dial it.
            head = self._push_links[0]   # looped: pushing
            if head.probe():
                self._unloop(failure, target)
                return
            failure = HopFailure(head.index, head.spec.peer_id,
                                 f"not answering Health after the tail could not reach it ({failure.detail})")
        super()._failover(failure, target)
        while True:                                   # what the old route still says is history
            try:
                self._events.get_nowait()
            except queue.Empty:
                break
        if not self._pushing:
            return
        route = self._route
        assert route is not None   # a failover happens on a route
        fresh_seen = False                            # a kept hop after a fresh one would get rows twice
        for i, link in enumerate(self._push_links):
            if not link.is_open:
                fresh_seen = True
            elif fresh_seen:
                link.close(release=True)
                self._links[i] = self._new_link(i, route.hops[i], link.spec.num_layers)
