"""``GET /metrics``: Prometheus metrics of one entry node, in a registry of its own.

Serving metrics follow the meanings of llama.cpp server's (``llamacpp:*``):

    meshd_prompt_tokens_total              prompt tokens processed
    meshd_prompt_seconds_total             time spent on prompts (request start -> first token)
    meshd_tokens_predicted_total           generated tokens
    meshd_tokens_predicted_seconds_total   time spent generating (first -> last token)
    meshd_prompt_tokens_seconds            average prompt throughput, tokens/s
    meshd_predicted_tokens_seconds         average generation throughput, tokens/s
    meshd_requests_processing              generations running now
    meshd_requests_deferred                generations waiting for a slot
    meshd_kv_cache_usage_ratio             our worker's KV use, 0..1 (its Health)
    meshd_kv_cache_tokens                  our worker's KV tokens in use

and the mesh's own:

    meshd_requests_total{edge,outcome}     finished requests by edge (http, control) and outcome
    meshd_time_to_first_token_seconds      histogram
    meshd_hop_step_seconds{peer,transport} decode-step round trip per hop, seen from here (histogram;
                                           star routes: a pushed route answers from its tail only)
    meshd_hop_bytes_total{peer,transport,direction}   Session frame bytes per hop
    meshd_hop_sessions_total{transport}    hop sessions opened (own worker, direct, relayed)
    meshd_relayed_hops_ratio               share of those sessions that went through a relay
    meshd_failovers_total                  hop failures the driver routed around
    meshd_draft_tokens_total               tokens drafted for speculative decoding
    meshd_draft_accepted_tokens_total      drafted tokens the route's tail accepted
    meshd_layer_coverage{layer}            peers serving each layer (0: a gap)
    meshd_tracker_role                     1 while this node has tracker duty
    meshd_audits_total                     steps re-run on another replica and compared (generate/audit.py)
    meshd_audit_mismatches_total           audits whose replica disagreed (the peer was excluded)
    meshd_audits_skipped_total             steps picked for an audit that no replica could re-run
    meshd_excluded_peers                   peers this entry's routes avoid after a mismatch

State: the registry and its metrics. Counters are updated from trio and
from the driver's thread (prometheus_client is thread-safe); the gauges
that describe the node (KV, coverage, tracker) are read at scrape time
through the ``probe`` callable the daemon gives (``NodeProbe``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Distinct peer label values we keep; more peers than this share "other"
# (the model index holds at most 128 peers per model).
MAX_PEER_LABELS = 128
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# {"kv_ratio", "kv_tokens", "coverage": [n per layer], "on_duty": bool, "audits": AuditBook.snapshot()}
NodeProbe = Callable[[], dict]


class _NodeCollector:
    def __init__(self, probe: NodeProbe) -> None:
        self._probe = probe

    def collect(self):
        try:
            state = self._probe() or {}
        except Exception:  # noqa: BLE001 - a scrape must not fail because the node is mid-change
            state = {}
        kv = GaugeMetricFamily("meshd_kv_cache_usage_ratio", "KV cache use of this node's worker, 0..1")
        kv.add_metric([], float(state.get("kv_ratio") or 0.0))
        kv_tokens = GaugeMetricFamily("meshd_kv_cache_tokens", "KV cache tokens in use on this node's worker")
        kv_tokens.add_metric([], float(state.get("kv_tokens") or 0))
        coverage = GaugeMetricFamily("meshd_layer_coverage", "Peers serving each layer of the model (0: a gap)",
                                     labels=["layer"])
        for layer, count in enumerate(state.get("coverage") or ()):
            coverage.add_metric([str(layer)], float(count))
        duty = GaugeMetricFamily("meshd_tracker_role", "1 while this node has tracker duty")
        duty.add_metric([], 1.0 if state.get("on_duty") else 0.0)
        audits = state.get("audits") or {}
        counts = [CounterMetricFamily(name, doc, value=float(audits.get(key) or 0)) for name, doc, key in (
            ("meshd_audits", "Steps re-run on another replica and compared", "audits"),
            ("meshd_audit_mismatches", "Audits whose replica disagreed (the peer was excluded)", "mismatches"),
            ("meshd_audits_skipped", "Steps picked for an audit that no replica could re-run", "unaudited"))]
        excluded = GaugeMetricFamily("meshd_excluded_peers", "Peers this entry's routes avoid after a mismatch",
                                     value=float(len(audits.get("excluded") or ())))
        return [kv, kv_tokens, coverage, duty, *counts, excluded]


class ApiMetrics:
    """The entry's metrics; also the hop meter's observer (meshd/generate/hop_meter.py)."""

    def __init__(self, probe: NodeProbe | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter("meshd_prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_seconds = Counter("meshd_prompt_seconds", "Prompt processing time (start to first token)",
                                      registry=r)
        self.predicted_tokens = Counter("meshd_tokens_predicted", "Generated tokens", registry=r)
        self.predicted_seconds = Counter("meshd_tokens_predicted_seconds", "Generation time (first to last token)",
                                         registry=r)
        self.prompt_rate = Gauge("meshd_prompt_tokens_seconds", "Average prompt throughput in tokens/s", registry=r)
        self.predicted_rate = Gauge("meshd_predicted_tokens_seconds", "Average generation throughput in tokens/s",
                                    registry=r)
        self.processing = Gauge("meshd_requests_processing", "Generations running now", registry=r)
        self.deferred = Gauge("meshd_requests_deferred", "Generations waiting for a slot", registry=r)
        self.requests = Counter("meshd_requests", "Finished generation requests", ["edge", "outcome"], registry=r)
        self.ttft = Histogram("meshd_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.step = Histogram("meshd_hop_step_seconds", "Decode step round trip per hop, seen from the entry",
                              ["peer", "transport"], buckets=STEP_BUCKETS, registry=r)
        self.bytes_per_hop = Counter("meshd_hop_bytes", "Session frame bytes per hop",
                                     ["peer", "transport", "direction"], registry=r)
        self.hop_sessions = Counter("meshd_hop_sessions", "Hop sessions opened", ["transport"], registry=r)
        self.relayed_ratio = Gauge("meshd_relayed_hops_ratio", "Share of hop sessions through a relay", registry=r)
        self.failovers = Counter("meshd_failovers", "Hop failures the driver routed around", registry=r)
        self.drafted = Counter("meshd_draft_tokens", "Tokens drafted for speculative decoding", registry=r)
        self.accepted = Counter("meshd_draft_accepted_tokens", "Drafted tokens the route's tail accepted",
                                registry=r)
        if probe is not None:
            r.register(_NodeCollector(probe))
        self._lock = threading.Lock()
        self._peers: set[str] = set()
        self._sessions = {"own": 0, "direct": 0, "relayed": 0}
        self._sums = [0.0, 0.0, 0.0, 0.0]   # prompt tokens, prompt s, predicted tokens, predicted s

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> dict:
        """The serving totals and average rates (the dashboard's throughput line)."""
        with self._lock:
            prompt, prompt_s, predicted, predicted_s = self._sums
        return {"prompt_tokens_total": int(prompt), "tokens_predicted_total": int(predicted),
                "prompt_tokens_per_s": round(prompt / prompt_s, 2) if prompt_s > 0 else None,
                "predicted_tokens_per_s": round(predicted / predicted_s, 2) if predicted_s > 0 else None}

    # ------------------------------------------------------------------ generations
    def generation(self, *, prompt_tokens: int, prompt_s: float, predicted: int, predicted_s: float,
                   failovers: int, drafted: int = 0, accepted: int = 0) -> None:
        with self._lock:
            s = self._sums
            s[0] += prompt_tokens
            s[1] += prompt_s
            s[2] += predicted
            s[3] += predicted_s
            prompt_rate = s[0] / s[1] if s[1] > 0 else 0.0
            predicted_rate = s[2] / s[3] if s[3] > 0 else 0.0
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_seconds.inc(prompt_s)
        self.predicted_tokens.inc(predicted)
        self.predicted_seconds.inc(predicted_s)
        self.prompt_rate.set(prompt_rate)
        self.predicted_rate.set(predicted_rate)
        if failovers:
            self.failovers.inc(failovers)
        if drafted:
            self.drafted.inc(drafted)
            self.accepted.inc(accepted)

    # ------------------------------------------------------------------ HopObserver
    def _peer(self, peer_id: str) -> str:
        with self._lock:
            if peer_id in self._peers:
                return peer_id
            if len(self._peers) < MAX_PEER_LABELS:
                self._peers.add(peer_id)
                return peer_id
        return "other"

    def hop_opened(self, peer_id: str, transport: str) -> None:
        self.hop_sessions.labels(transport).inc()
        with self._lock:
            self._sessions[transport] = self._sessions.get(transport, 0) + 1
            total = sum(self._sessions.values())
            ratio = self._sessions.get("relayed", 0) / total if total else 0.0
        self.relayed_ratio.set(ratio)

    def hop_step(self, peer_id: str, transport: str, seconds: float) -> None:
        self.step.labels(self._peer(peer_id), transport).observe(seconds)

    def hop_bytes(self, peer_id: str, transport: str, sent: int, received: int) -> None:
        peer = self._peer(peer_id)
        if sent:
            self.bytes_per_hop.labels(peer, transport, "sent").inc(sent)
        if received:
            self.bytes_per_hop.labels(peer, transport, "received").inc(received)
