"""ShardService: the state one worker shares across all its streams.

Owns the backend (weights), the SessionManager (per-session KV), one lock that
serializes every manager call (the manager is sans-I/O and single-threaded),
the continuous-batching scheduler every manager forward goes through
(``shard/session/batching.py``: it waits on that lock's condition, so streams whose
steps are ready together share one forward), and the capability report. Unary
RPCs (GetCapability, Health, Release, Cancel) are plain methods
here taking and returning protobuf messages; ``shard/session/stream.py`` runs the
Session stream on top; ``shard/edges/grpc_server.py`` is the gRPC edge.

Capability is *validated*: ``validate()`` runs a bounded real forward over the
range (a short prefill and decode steps on a throwaway cache, outputs checked
for shape and finiteness) and only then reports ``validated=True`` with the
measured decode ms/layer and prefill tokens/s. A failed validation keeps its
reason in ``detail`` (the exception's type and message, bounded by
MAX_DETAIL_CHARS) and logs the traceback in the worker's log.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from proto.frames import SCHEMA_VERSION
from proto.hop_transport import PushDialer
from proto.limits import DEFAULT_MAX_INFLIGHT_CHUNKS, DEFAULT_PREFILL_CHUNK_TOKENS, MAX_FRAME_BYTES
from proto.receipts import ReceiptSigner
from shard.errors import MAX_DETAIL_CHARS, InternalError, ShardRefusal, log_failure, to_shard_error
from shard.model.backend import RangeBackend
from shard.session.batching import BatchingBackend
from shard.session.sessions import LOCAL_OWNER, Owner, SessionKey, SessionManager, SessionPolicy

# Validation forward: one whole prefill chunk (the largest forward a session sends: the flow
# control's max_prefill_chunk_tokens), so the peak it reaches is the backend's working memory
# (shard/model/memory.py); fewer when the KV a session may hold is smaller. Then a few decode steps.
VALIDATION_PREFILL_TOKENS = DEFAULT_PREFILL_CHUNK_TOKENS
VALIDATION_DECODE_STEPS = 4
VALIDATION_SEED = 1234
ACCEPTED_COMPRESSION = (pb.COMPRESSION_NONE, pb.COMPRESSION_ZSTD)
BOUNDARY_DTYPES = {"float32": pb.DTYPE_FLOAT32, "bfloat16": pb.DTYPE_BFLOAT16}

log = logging.getLogger(__name__)


def _bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    text = " ".join(text.split())          # one line: tracebacks and torch messages span several
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            import os

            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def _machine_memory() -> int:
    """MemTotal, or the memory cgroup's limit when that is lower (a worker in a container)."""
    total = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
        for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
            if os.path.exists(path):
                with open(path) as fh:
                    text = fh.read().strip()
                if text.isdigit() and 0 < int(text) < total:
                    total = int(text)
                break
    except OSError:
        pass
    return total


class ShardService:
    def __init__(self, backend: RangeBackend, policy: SessionPolicy, *, model_id: str = "",
                 clock: Callable[[], float] = time.monotonic, batching: bool = True) -> None:
        self.backend = backend
        self.lock = threading.Lock()
        self.batcher = BatchingBackend(backend, self.lock, enabled=batching)
        self.manager = SessionManager(self.batcher, policy, clock)
        self.model_id = model_id
        self.local_flow = pb.FlowControl(max_inflight_chunks=DEFAULT_MAX_INFLIGHT_CHUNKS,
                                         max_chunk_bytes=MAX_FRAME_BYTES,
                                         max_prefill_chunk_tokens=DEFAULT_PREFILL_CHUNK_TOKENS)
        self._capability: pb.CapabilityReport | None = None
        self.validation_tokens = 0   # the prefill positions validate() ran (its memory forward)
        # Push topology (shard/push/hub.py): how this worker dials a successor the entry named
        # (set by the worker CLI: TLS pinned to the target's certificate hash), and its pushed sessions.
        self.push_dialer: PushDialer | None = None   # how pushed sessions reach successors (push/)
        self.push_hub = None
        # Step receipts (proto/receipts.py): the worker's certified per-run key, set by the worker
        # CLI when its daemon handed it one; None: answers carry no receipts.
        self.receipts: ReceiptSigner | None = None

    # -- capability ------------------------------------------------------------------
    def _validation_inputs(self, count: int, rng: np.random.Generator) -> np.ndarray:
        b = self.backend
        if b.layer_range.is_head:
            return rng.integers(0, b.vocab_size, size=count, dtype=np.int64)
        return rng.standard_normal((count, b.hidden_size)).astype(np.float32).astype(b.boundary_dtype)

    def validate(self) -> pb.CapabilityReport:
        """Run the bounded real forward and record the validated capability."""
        b, lr = self.backend, self.backend.layer_range
        rng = np.random.default_rng(VALIDATION_SEED)
        detail = "validated by a real forward over the range"
        ok = True
        cache = None
        room = min(self.manager.policy.kv_budget_tokens, getattr(b, "max_session_tokens", None) or 1 << 30)
        prefill = self.validation_tokens = max(1, min(VALIDATION_PREFILL_TOKENS, room - VALIDATION_DECODE_STEPS))
        try:
            cache = b.new_cache(prefill + VALIDATION_DECODE_STEPS)
            t0 = time.perf_counter()
            out = b.forward(cache, self._validation_inputs(prefill, rng), effective_start=lr.start)
            prefill_s = time.perf_counter() - t0
            decode_s = 0.0
            for _ in range(VALIDATION_DECODE_STEPS):
                t0 = time.perf_counter()
                out = b.forward(cache, self._validation_inputs(1, rng), effective_start=lr.start)
                decode_s += time.perf_counter() - t0
            want = (b.vocab_size,) if lr.is_tail else (1, b.hidden_size)
            if out.shape != want:
                ok, detail = False, f"validation output has shape {tuple(out.shape)}, expected {want}"
            elif not np.isfinite(np.asarray(out, np.float32)).all():
                ok, detail = False, "validation output holds NaN or infinite values (broken weights?)"
            if not ok:
                log.error("validation of layers %s failed: %s", lr, detail)
        except Exception as exc:  # the capability says why (bounded); the traceback goes to the log
            log.error("validation of layers %s failed", lr, exc_info=exc)
            ok, prefill_s, decode_s = False, 0, 0
            detail = _bounded(f"validation forward failed: {type(exc).__name__}: {exc}")
        finally:
            if cache is not None:
                cache.release()
        stats = self.manager.stats()
        self._capability = pb.CapabilityReport(
            schema_version=SCHEMA_VERSION,
            fingerprint=b.fingerprint,
            shard_range=pb.ShardRange(start_layer=lr.start, end_layer=lr.end, effective_start_layer=lr.start),
            backend=b.backend_name, device="cpu", validated=ok, detail=detail,
            max_concurrent_sessions=self.manager.policy.max_sessions,
            max_context_tokens=stats.kv_budget_tokens,
            flow_control=self.local_flow,
            accepted_compression=ACCEPTED_COMPRESSION,
            supported_schema_versions=[SCHEMA_VERSION],
            validated_at_unix_nanos=time.time_ns() if ok else 0,
            num_layers=lr.num_layers, hidden_size=b.hidden_size,
            boundary_dtype=BOUNDARY_DTYPES.get(np.dtype(b.boundary_dtype).name, pb.DTYPE_UNSPECIFIED),
            decode_ms_per_layer=(decode_s / VALIDATION_DECODE_STEPS) * 1000 / lr.count if ok else 0.0,
            prefill_tokens_per_s=prefill / prefill_s if ok and prefill_s else 0.0,
            kv_budget_tokens=stats.kv_budget_tokens,
            model_id=self.model_id,
        )
        delegated = getattr(getattr(b, "adapter", None), "delegated", None)   # MoE: experts left to peers
        if delegated is not None:
            self._capability.delegated_experts.extend(delegated(lr).to_runs())
        return self._capability

    def record_memory(self, figures: pb.MemoryFigures) -> None:
        """Attach what the worker measured of its memory at validation (shard/model/memory.py)."""
        if self._capability is not None:
            self._capability.memory.CopyFrom(figures)

    def capability(self, request: pb.CapabilityRequest | None = None) -> pb.CapabilityReport:
        if self._capability is None:
            lr = self.backend.layer_range
            return pb.CapabilityReport(schema_version=SCHEMA_VERSION, validated=False,
                                       detail="not validated yet", backend=self.backend.backend_name,
                                       shard_range=pb.ShardRange(start_layer=lr.start, end_layer=lr.end))
        return self._capability

    # -- health and out-of-band control ----------------------------------------------
    def health(self, request: pb.HealthRequest | None = None) -> pb.HealthReport:
        with self.lock:
            self.manager.expire()
            stats = self.manager.stats()
            m = self.manager.meter
            meter = (m.decode_ms_per_layer, m.prefill_tokens_per_s, m.decode_positions, m.prefill_positions)
        validated = self._capability is not None and self._capability.validated
        exchange = getattr(self.backend, "exchange", None)   # MoE: experts on expert peers
        moe = exchange.stats() if exchange is not None else {}
        pushed: dict[str, int] = self.push_hub.streams if self.push_hub is not None else {}
        return pb.HealthReport(
            push_streams_frames=pushed.get("frames", 0), push_streams_grpc=pushed.get("grpc", 0),
            expert_bytes_sent=moe.get("bytes_sent", 0), expert_bytes_received=moe.get("bytes_received", 0),
            expert_positions=moe.get("positions", 0), expert_failovers=moe.get("failovers", 0),
            schema_version=SCHEMA_VERSION,
            state=pb.SERVING_STATE_SERVING if validated else pb.SERVING_STATE_NOT_SERVING,
            active_sessions=stats.active_sessions, kv_pressure=stats.kv_pressure,
            resident_bytes=_rss_bytes(), kv_tokens_used=stats.kv_reserved_tokens,
            kv_budget_tokens=stats.kv_budget_tokens,
            queued_chunks=self.batcher.queue_depth, batch_occupancy=self.batcher.last_batch_rows,
            cpu_cores=_cores(), machine_memory_bytes=_machine_memory(),
            recent_decode_ms_per_layer=meter[0], recent_prefill_tokens_per_s=meter[1],
            decode_positions=meter[2], prefill_positions=meter[3],
            detail=f"{stats.kv_cached_tokens} tokens cached")

    def _key(self, session_id: str, epoch: int) -> SessionKey:
        return SessionKey(session_id, int(epoch))

    def release(self, request: pb.ReleaseRequest, peer: str = LOCAL_OWNER.peer) -> pb.ReleaseResponse:
        """Release by unary RPC: ``peer`` is who the edge saw; the request's owner_token must match."""
        try:
            key = self._key(request.route_session_id, request.route_epoch)
            owner = Owner.of(peer, request.owner_token)
            with self.lock:
                return pb.ReleaseResponse(released=self.manager.release(key, owner))
        except (ProtocolError, ShardRefusal) as exc:
            return pb.ReleaseResponse(released=False, error=to_shard_error(exc))
        except Exception as exc:  # noqa: BLE001 - ours (a backend's cache release): logged, typed
            log_failure(log, exc, "releasing a session")
            return pb.ReleaseResponse(released=False, error=to_shard_error(
                InternalError(f"releasing the session failed ({type(exc).__name__}); see the worker's log")))

    def release_all(self) -> int:
        """The worker is stopping (every edge is closed and joined): free every session's KV."""
        with self.lock:
            return self.manager.release_all()

    def cancel(self, request: pb.CancelRequest, peer: str = LOCAL_OWNER.peer) -> pb.CancelResponse:
        try:
            key = self._key(request.route_session_id, request.route_epoch)
            owner = Owner.of(peer, request.owner_token)
            with self.lock:
                return pb.CancelResponse(cancelled_work_items=self.manager.cancel(key, owner))
        except (ProtocolError, ShardRefusal) as exc:
            return pb.CancelResponse(error=to_shard_error(exc))
        except Exception as exc:  # noqa: BLE001 - ours (a backend's cache release): logged, typed
            log_failure(log, exc, "cancelling a session")
            return pb.CancelResponse(error=to_shard_error(
                InternalError(f"cancelling the session failed ({type(exc).__name__}); see the worker's log")))
