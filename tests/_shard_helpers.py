"""Shared helpers for the shard tests (not a test module)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shard.model.reference import greedy


def run_split(parts, prompt, new_tokens, *, chunk=16, effective=None):
    """Greedy generation through in-process backends; returns (tokens, logits)."""
    caches = [p.new_cache(len(prompt) + new_tokens + 8) for p in parts]
    effective = effective or [p.layer_range.start for p in parts]

    def run(ids):
        x = np.array(ids, dtype=np.int64)
        for p, c, e in zip(parts, caches, effective):
            x = p.forward(c, x, effective_start=e)
        return x

    for first in range(0, len(prompt), chunk):
        logits = run(prompt[first:first + chunk])
    tokens, all_logits = [], []
    for i in range(new_tokens):
        all_logits.append(logits)
        tokens.append(greedy(logits))
        if i + 1 < new_tokens:
            logits = run([tokens[-1]])
    return tokens, all_logits


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


PROMPT = list(range(5, 45))


def fixed_source(workers, specs, num_layers):
    """A fixed route over disjoint ranges ``specs`` ("A:B") served by ``workers`` (their loopback ports)."""
    from meshd.generate.routes import fixed_route

    bounds = [tuple(int(x) for x in spec.split(":")) for spec in specs]
    return fixed_route([(w.endpoint, a, b) for w, (a, b) in zip(workers, bounds)], num_layers)


@dataclass
class Generated:
    tokens: list[int]
    logits: list[np.ndarray]
    stats: object
    fingerprint: object


def drive_fixed(source, prompt, new_tokens, *, connector=None, fingerprint=None, chunk=16, **request_kw):
    """One generation through the route driver (SwarmDriver) over a fixed route."""
    from meshd.generate.driver import GenerationRequest, SwarmDriver
    from meshd.generate.routes import PeerConnector, discover_fingerprint

    connector = connector or PeerConnector(insecure_loopback=True)
    fingerprint = fingerprint or discover_fingerprint(connector, source.route)
    driver = SwarmDriver(source, connector, fingerprint=fingerprint)
    tokens = [t.id for t in driver.generate(GenerationRequest(tuple(prompt), new_tokens, chunk_tokens=chunk,
                                                               **request_kw))]
    return Generated(tokens, driver.stats.logits, driver.stats, fingerprint)


def check_route_equals_whole(path, workers, specs, num_layers, *, dtype="float32", prompt=PROMPT,
                             new_tokens=32, chunk=16, label=""):
    """32 greedy tokens through the workers equal the whole model; returns the max logit diff."""
    from shard.model.reference import WholeModel

    got = drive_fixed(fixed_source(workers, specs, num_layers), prompt, new_tokens, chunk=chunk,
                      return_logits=True)
    ref = WholeModel(path, dtype).generate(prompt, new_tokens, chunk_tokens=chunk)
    diff = max_diff(got.logits, ref.logits)
    print(f"\n[{label or path.name} {dtype} {len(specs)} workers] tokens equal: {got.tokens == ref.tokens}; "
          f"max abs logit diff: {diff}")
    assert got.tokens == ref.tokens
    return diff


class StatusError(Exception):
    """A worker answered a raw stream with a ShardStatus (``.error`` is its ShardError)."""

    def __init__(self, error) -> None:
        super().__init__(f"{error.code}: {error.detail}")
        self.error = error


class RawStream:
    """A bare Session call for sending hand-made (and bad) frames to a worker."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0) -> None:
        import grpc

        from shard.edges.grpc_server import GRPC_OPTIONS, SERVICE_NAME
        from shard.session.request_queue import RequestQueue

        self.channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
        self._queue = RequestQueue(16)
        call = self.channel.stream_stream(f"/{SERVICE_NAME}/Session", request_serializer=None,
                                          response_deserializer=None)
        self._responses = call(self._queue, timeout=timeout_s)

    def send(self, body: bytes, **_ignored) -> None:
        self._queue.put(body)

    def recv(self):
        """The next non-flow-control (response, tensors); a ShardStatus (or a transport error) raises
        StatusError."""
        import grpc

        from proto import shard_runtime_pb2 as pb
        from proto.zerocopy import read_response

        while True:
            try:
                body = next(self._responses)
            except grpc.RpcError as exc:   # the transport refused (e.g. an oversized frame)
                raise StatusError(pb.ShardError(code=pb.ERROR_CODE_INTERNAL,
                                                detail=f"transport: {exc.code().name}")) from exc
            resp, tensors = read_response(body)
            kind = resp.WhichOneof("kind")
            if kind == "flow_control":
                continue
            if kind == "status":
                raise StatusError(resp.status.error)
            return resp, tensors

    def close(self) -> None:
        self._queue.finish()
        self._responses.cancel()
        self.channel.close()
