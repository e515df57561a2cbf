"""A route whose middle hop is relayed (real relay, home node, workers on loopback) equals the whole model."""
from __future__ import annotations

import numpy as np
import pytest

from meshd.benchmarks import relay_harness as H

pytestmark = pytest.mark.slow


def test_relayed_middle_hop_gives_the_whole_models_tokens(tmp_path):
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel

    model = build_random_llama(seed=0)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 380, size=40)]
    kids: list[H.Child] = []
    try:
        relay = H.spawn_relay(tmp_path, "/ip4/127.0.0.1/tcp/0")
        kids.append(relay)
        workers = [H.spawn_worker(tmp_path, model, r, wait=False) for r in ("0:2", "2:4", "4:6")]
        kids += workers
        head, middle, tail = (H.wait_ready(w) for w in workers)
        node = H.spawn_home_node(tmp_path, "home", "/ip4/127.0.0.1/tcp/0", relay.ready["addrs"][0],
                                 middle.ready["unix"])   # a home node serves its worker's Unix socket
        kids.append(node)
        peer = node.ready["peer_id"]

        def hop(endpoint, a, b):
            return {"endpoint": endpoint, "start": a, "end": b, "num_layers": 6}

        base = {"prompt": prompt, "max_new_tokens": 12, "chunk_tokens": 16, "return_logits": True}
        direct = H.drive({**base, "hops": [hop(head.ready["listen"], 0, 2), hop(middle.ready["listen"], 2, 4),
                                           hop(tail.ready["listen"], 4, 6)]})
        relayed = H.drive({**base, "hops": [hop(head.ready["listen"], 0, 2), hop("p2p:" + peer, 2, 4),
                                            hop(tail.ready["listen"], 4, 6)],
                           "relayed": {peer: node.ready["relayed_addrs"][0]}})
        whole = WholeModel(model).generate(prompt, 12, chunk_tokens=16)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(relayed["logits"], direct["logits"]))
        print(f"relayed vs direct max logit diff {diff}")
        assert relayed["tokens"] == direct["tokens"] == whole.tokens
        assert diff == 0.0      # same workers, same bytes: the transport cannot change a bit
    finally:
        for kid in reversed(kids):
            kid.stop()


def test_a_relay_that_dies_mid_generation_fails_the_hop_promptly(tmp_path):
    """The driver gets a HopFailure for the relayed hop (to re-plan), never a hang; on a fixed
    route nothing replaces it, so the generation ends with RouteFailed caused by it."""
    import os
    import signal
    import time

    from meshd.errors import HopFailure
    from meshd.generate.driver import RouteFailed
    from meshd.testing.models import build_random_llama

    model = build_random_llama(seed=0)
    kids: list[H.Child] = []
    try:
        relay = H.spawn_relay(tmp_path, "/ip4/127.0.0.1/tcp/0")
        kids.append(relay)
        workers = [H.spawn_worker(tmp_path, model, r, wait=False) for r in ("0:3", "3:6")]
        kids += workers
        head, tail = (H.wait_ready(w) for w in workers)
        node = H.spawn_home_node(tmp_path, "home", "/ip4/127.0.0.1/tcp/0", relay.ready["addrs"][0],
                                 tail.ready["unix"])     # a home node serves its worker's Unix socket
        kids.append(node)
        peer = node.ready["peer_id"]
        spec = {"hops": [{"endpoint": head.ready["listen"], "start": 0, "end": 3, "num_layers": 6},
                         {"endpoint": "p2p:" + peer, "start": 3, "end": 6, "num_layers": 6}],
                "relayed": {peer: node.ready["relayed_addrs"][0]}, "prompt": list(range(5, 25)),
                "max_new_tokens": 200, "chunk_tokens": 16}

        def kill_relay(count: int) -> None:
            if count == 8:
                os.kill(relay.proc.pid, signal.SIGKILL)

        started = time.monotonic()
        with pytest.raises(RouteFailed) as err:
            H.drive(spec, on_sent=kill_relay)
        print(f"hop failed after {time.monotonic() - started:.1f} s: {err.value}")
        failure = err.value.__cause__
        assert isinstance(failure, HopFailure) and failure.index == 1
        assert "transport" in failure.detail   # a transport failure: re-plan, do not give up
    finally:
        for kid in reversed(kids):
            kid.stop()
