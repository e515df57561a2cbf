"""A Qwen3-MoE swarm of real ``meshd join`` daemons where no node holds all experts of any MoE layer.

    experts-a, experts-b   expert peers: experts 4..7 of every layer (no layers)
    head                   layers 0:3, experts 0..3 of them
    tail                   layers 3:6, experts 0..3 of them

The generation enters at the head through the control API (the product
path), crosses both holders, and every sparse layer sends its rows for
experts 4..7 to an expert peer. Then the expert peer the holders use is
SIGKILLed mid-generation: the holders fail over to the other one and the
greedy tokens are those of the whole model. Run pushed (the default: the head's
worker sends its rows to the tail, the tail its token to the entry) and as a
star (the entry carries the boundary).
"""
from __future__ import annotations

import signal

import pytest
import torch

from meshd.daemon.local_swarm import LocalSwarm, wait_for
from meshd.daemon.worker_process import HEALTH_INTERVAL_S
from meshd.testing.models import build_random_qwen3_moe

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
# Long enough that the generation is still running when the test, reading the event stream, kills the
# victim: a looped route decodes this model at ~200 tok/s, so 24 tokens could end before the 6th token
# event was read on a busy machine, and nothing would fail over.
NEW_TOKENS = 128
KILL_AFTER = 6
START_TIMEOUT_S = 600
HEALTH_SNAPSHOTS = 6      # health snapshots to wait for one taken after the kill


def _reference_tokens(path, prompt_ids, new_tokens):
    """The whole model in this process, at the workers' one compute thread (numerics depend on it)."""
    import shard.experts.adapters  # noqa: F401 - the MoE families register themselves
    from shard.model.reference import WholeModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return WholeModel(path).generate(prompt_ids, new_tokens).tokens
    finally:
        torch.set_num_threads(threads)


# push only: the default topology, which the star shares its expert exchange with (the star route
# itself is covered by tests/test_swarm_e2e.py and the client-only tests); two minutes a topology.
@pytest.mark.parametrize("topology", ["push"])
def test_moe_swarm_with_delegated_experts_survives_an_expert_peer_death(tmp_path, topology):
    path = build_random_qwen3_moe()
    # push is the default topology: its run passes no flag, so it also checks the default
    flags = () if topology == "push" else ("--topology", topology)
    with LocalSwarm(tmp_path, path, record_ttl_s=8.0, extra=flags) as swarm:
        experts_a = swarm.add(layers=None, name="experts-a", extra=("--experts", "0-5:E4-E7"))
        experts_b = swarm.add(layers=None, name="experts-b", extra=("--experts", "0-5:E4-E7"))
        head = swarm.add(layers="0:3", name="head", extra=("--experts", "0-2:E0-E3"))
        tail = swarm.add(layers="3:6", name="tail", extra=("--experts", "3-5:E0-E3"))
        swarm.wait_covered(START_TIMEOUT_S, peers=2, via=head)

        def both_peers_known(holder):
            status = holder.query("status") or {}
            peers = (status.get("experts") or {}).get("peers") or []
            return peers if len(peers) == 2 else None
        # both holders must know both peers, or the one that knew only the victim has nowhere to fail over to
        peers = wait_for(lambda: both_peers_known(head), "both expert peers in the head's directory",
                         START_TIMEOUT_S, head)
        wait_for(lambda: both_peers_known(tail), "both expert peers in the tail's directory", START_TIMEOUT_S, tail)
        used = min(p["peer_id"] for p in peers)     # holders prefer the lowest peer id
        victim = experts_a if (experts_a.query("status") or {}).get("peer_id") == used else experts_b

        first = list(head.generate(PROMPT, max_tokens=NEW_TOKENS, temperature=0, raw=True))
        done = first[-1]
        assert done.get("ok"), done
        assert done["topology"] == topology, done
        tokens = done["tokens"]

        events, killed = [], False
        for event in head.generate(PROMPT, max_tokens=NEW_TOKENS, temperature=0, raw=True):
            events.append(event)
            if not killed and sum("token" in e for e in events) == KILL_AFTER:
                victim.stop(signal.SIGKILL)
                killed = True
        assert killed and events[-1].get("ok"), events[-1]
        assert events[-1]["tokens"] == tokens
        assert events[-1]["topology"] == topology, events[-1]
        print(f"\n[moe swarm {topology}] after the kill: {events[-1]}")

        from meshd.generate.tokenizer import EntryTokenizer

        prompt_ids = EntryTokenizer(path).encode_prompt(PROMPT, True)
        assert tokens == _reference_tokens(path, prompt_ids, NEW_TOKENS)[:len(tokens)]
        # Both holders used the victim and fail over to the other peer. The daemon polls its worker's
        # health every HEALTH_INTERVAL_S, so the first snapshot may predate the kill (a generation takes
        # about a second): wait, bounded, for one that counts the failover.
        for holder in (head, tail):
            def failed_over(holder=holder):
                moe = (((holder.query("status") or {}).get("worker") or {}).get("health") or {}).get("experts")
                return moe if moe and moe["failovers"] >= 1 else None
            moe = wait_for(failed_over, f"a failover in the {holder.name}'s expert health",
                           HEALTH_SNAPSHOTS * HEALTH_INTERVAL_S, holder)
            print(f"\n[moe swarm {topology}] tokens {tokens}; {holder.name}'s exchange: {moe}")
            assert moe["bytes_sent_per_position"] > 0 and moe["bytes_received_per_position"] > 0
