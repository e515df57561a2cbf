"""Experts: MoE layers whose experts may live on other nodes, and the expert peers that serve them.

Files and roles (a holder runs router, attention and norms; an expert peer runs experts only):

    spec.py        ExpertSpec: which (layer, expert) pairs a node holds ("0-3:E4-E7")
    adapters.py    the MoE model families (Qwen3-MoE, Qwen2-MoE): per-expert keys stacked, eager
                   experts, held subsets; they register themselves with shard/model/adapters.py
                   when this module is imported
    dispatch.py    MoeDispatch: the router and the additions here, missing experts through an
                   ExpertExchange, in the local order (bit-exact in float32)
    pool.py        ExpertRouter (the holder's ExpertExchange): its expert peers, rows once per
                   peer, failover, byte counters
    transport.py   the one exchange function: framed request/reply over a (pinned TLS) socket;
                   the TLS contexts the worker's frame port shares
    store.py       an expert peer's weights (experts without their layers), compute, validation
    server.py      an expert peer's side of one connection (serve_connection, counters); its
                   listener is the edge shard/edges/expert_server.py

Public surface: the light pieces below. The torch modules (adapters,
dispatch, store) are imported by their own path, so that the daemon, which
plans and advertises experts, never loads torch; a process that loads a MoE
model's range imports ``shard.experts.adapters`` first (the worker does).
"""
from shard.experts.pool import ExpertRouter, Placement, placements_from_json, placements_to_json
from shard.experts.spec import SHARED, ExpertSpec, ExpertSpecError
from shard.experts.transport import ExpertConnection, client_tls_context, server_tls_context

__all__ = ["ExpertSpec", "ExpertSpecError", "SHARED", "ExpertRouter", "Placement", "placements_from_json",
           "placements_to_json", "ExpertConnection", "client_tls_context", "server_tls_context"]
