"""Advertiser: keeps this node's capability record alive in the DHT.

State: the current claim (what the validated worker can do, or None), the
last sequence number used, and the digest last advertised. Owned here; the
supervisor sets or clears the claim, the daemon reads ``status()``.

Schedule (trio time, so tests run it under MockClock):
* a new claim is published at once, then republished every
  ``ttl / 3`` (two republishes may fail before the record expires);
* clearing the claim (worker died, or shutdown) publishes a withdrawal at
  once -- a tombstone with a higher sequence that hides the live record
  everywhere until it would have expired anyway;
* a failed publish is retried after ``RETRY_S`` (or sooner if the claim changes).

Sequence numbers are ``max(last + 1, wall ms)``: strictly increasing within a
run and, with a sane clock, across restarts without any stored state.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import trio

from dht.identity import Identity
from dht.records import CapabilityClaim, CapabilityRecord, sign_capability, sign_withdrawal, validate_capability
from proto import shard_runtime_pb2 as pb

log = logging.getLogger(__name__)

# A publish that failed outright is retried this soon, not a full interval later.
RETRY_S = 2.0
# Bound on the withdrawal at shutdown: leaving must not hang on a dead swarm.
WITHDRAW_TIMEOUT_S = 10.0



class _Claim(Protocol):
    @property
    def model_artifact_digest(self) -> str: ...


class _Record(Protocol):
    @property
    def model_artifact_digest(self) -> str: ...
    @property
    def sequence(self) -> int: ...
    @property
    def expires_at_ms(self) -> int: ...
    @property
    def withdrawn(self) -> bool: ...


ClaimT = TypeVar("ClaimT", bound=_Claim)
RecordT = TypeVar("RecordT", bound=_Record)
Publish = Callable[[RecordT], Awaitable[int]]

BACKEND_ENUM = {"torch": pb.BACKEND_TORCH, "llama.cpp": pb.BACKEND_LLAMA_CPP}


def claim_from_report(report: pb.CapabilityReport, *, grpc_endpoint: str, tls_cert_sha256: bytes,
                      direct_addrs: tuple[str, ...], free_kv_tokens: int | None = None,
                      frames_endpoint: str = "", fetch_endpoint: str = "",
                      held: tuple[int, int] | None = None, artifact_sha256: str = "") -> CapabilityClaim:
    """Turn the worker's validated CapabilityReport into what we sign and advertise;
    ``free_kv_tokens`` is the worker's latest free KV (None: the whole budget, as at start)."""
    fp, r = report.fingerprint, report.shard_range
    return CapabilityClaim(
        model_artifact_digest=fp.model_artifact_digest, runtime_recipe_digest=fp.runtime_recipe_digest,
        start_layer=r.start_layer, end_layer=r.end_layer, num_layers=report.num_layers,
        backend=BACKEND_ENUM.get(report.backend, pb.BACKEND_UNSPECIFIED),
        dtypes=(report.boundary_dtype,) if report.boundary_dtype else (),
        model_id=report.model_id[:256], direct_addrs=direct_addrs,
        grpc_endpoint=grpc_endpoint, tls_cert_sha256=tls_cert_sha256,
        frames_endpoint=frames_endpoint if grpc_endpoint else "",
        free_kv_tokens=report.kv_budget_tokens if free_kv_tokens is None else free_kv_tokens,
        decode_ms_per_layer=report.decode_ms_per_layer, prefill_tokens_per_s=report.prefill_tokens_per_s,
        delegated_experts=tuple(report.delegated_experts),
        fetch_endpoint=fetch_endpoint if tls_cert_sha256 else "",
        held_start=held[0] if held else 0, held_end=held[1] if held else 0, artifact_sha256=artifact_sha256)


@dataclass(frozen=True, slots=True)
class AdvertStatus:
    advertising: bool
    sequence: int
    expires_at_ms: int
    last_acks: int
    withdrawn: bool


class RecordSchedule(Generic[ClaimT, RecordT]):
    """The schedule above for one kind of signed record; a subclass signs its claims and withdrawals."""

    def __init__(self, identity: Identity, publish: Publish[RecordT], *, ttl_s: float,
                 wall_ms: Callable[[], int]) -> None:
        self.identity = identity
        self._publish = publish
        self.ttl_ms = int(ttl_s * 1000)
        self.interval_s = ttl_s / 3.0
        self.wall_ms = wall_ms
        self._claim: ClaimT | None = None
        self._changed = trio.Event()
        self._sequence = 0
        self._advertised_digest: str | None = None
        self.last: RecordT | None = None
        self.last_acks = 0

    # ------------------------------------------------------------------ control

    def set_claim(self, claim: ClaimT | None) -> None:
        self._claim = claim
        self._changed.set()

    @property
    def claim(self) -> ClaimT | None:
        return self._claim

    def status(self) -> AdvertStatus:
        last = self.last
        return AdvertStatus(advertising=self._claim is not None and last is not None and not last.withdrawn,
                            sequence=last.sequence if last else 0,
                            expires_at_ms=last.expires_at_ms if last else 0,
                            last_acks=self.last_acks, withdrawn=bool(last and last.withdrawn))

    # ------------------------------------------------------------------ loop

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._changed = trio.Event()
            claim = self._claim
            # The cadence counts from the start of a publish, and a publish never
            # outlasts one interval: a remote store stalled on a dead-but-connected
            # peer must not delay the next local store until our own record expires.
            next_at = math.inf
            try:
                if claim is not None:
                    next_at = trio.current_time() + self.interval_s
                    with trio.move_on_at(next_at):
                        if self._advertised_digest not in (None, claim.model_artifact_digest):
                            await self._withdraw()  # the worker now serves another model: retract the old one
                        await self._publish_record(self._sign(claim))
                elif self._advertised_digest is not None:
                    await self._withdraw()
            except Exception as exc:  # noqa: BLE001 - network faults of the DHT layer: retry soon
                log.warning("publishing the capability record failed (%s); retrying in %.0f s", exc, RETRY_S)
                next_at = trio.current_time() + RETRY_S
            with trio.move_on_at(next_at):
                await self._changed.wait()

    async def withdraw_now(self) -> None:
        """Stop advertising and publish the withdrawal (bounded); used on graceful leave."""
        self._claim = None
        self._changed.set()
        if self._advertised_digest is None:
            return
        with trio.move_on_after(WITHDRAW_TIMEOUT_S):
            await self._withdraw()

    # ------------------------------------------------------------------ helpers

    def _next_sequence(self, now_ms: int) -> int:
        self._sequence = max(self._sequence + 1, now_ms)
        return self._sequence

    def _sign(self, claim: ClaimT) -> RecordT:
        raise NotImplementedError

    def _withdrawal(self, digest: str) -> RecordT:
        raise NotImplementedError

    async def _withdraw(self) -> None:
        digest = self._advertised_digest
        assert digest is not None
        await self._publish_record(self._withdrawal(digest))
        self._advertised_digest = None

    async def _publish_record(self, record: RecordT) -> None:
        self.last = record
        if not record.withdrawn:
            # set before the remote stores: the local store happens first, so a
            # publish cut short by the cadence still leaves a record to withdraw
            self._advertised_digest = record.model_artifact_digest
        self.last_acks = await self._publish(record)


class Advertiser(RecordSchedule[CapabilityClaim, CapabilityRecord]):
    """This node's capability record."""

    def _sign(self, claim: CapabilityClaim) -> CapabilityRecord:
        now = self.wall_ms()
        raw = sign_capability(claim, self.identity.signing_key, peer_id=self.identity.peer_id,
                              sequence=self._next_sequence(now), now_ms=now, ttl_ms=self.ttl_ms)
        return validate_capability(raw, now)

    def _withdrawal(self, digest: str) -> CapabilityRecord:
        now = self.wall_ms()
        raw = sign_withdrawal(digest, self.identity.signing_key, peer_id=self.identity.peer_id,
                              sequence=self._next_sequence(now), now_ms=now, ttl_ms=self.ttl_ms)
        return validate_capability(raw, now)
