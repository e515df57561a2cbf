"""The sparse MoE block when some of its experts live elsewhere: route here, add in local order.

Math of one sparse MoE layer on rows ``h`` [S, hidden] (transformers 5.23's
eager experts path, ``Qwen3MoeExperts.forward`` / ``Qwen2MoeSparseMoeBlock``)::

    _, w, sel = gate(h)                       # router: softmax, top-k, (normalized) weights
    out = 0
    for e in experts hit, ascending:          # rows in torch.where order over (k, S)
        y_e = down_e(act(gate_e(h[rows_e])) * up_e(h[rows_e]))
        out.index_add_(rows_e, y_e * w[rows_e, k_e])
    Qwen2-MoE: out = out + sigmoid(shared_gate(h)) * shared_expert(h)

``MoeDispatch`` computes exactly that, but each ``y_e`` (and the shared
expert's output) comes from wherever the expert is: ``expert_ffn`` here for
held experts, an ``ExpertExchange`` (shard/experts/pool.py: the expert peers)
for the others. The peers return the *unweighted* ``y_e`` for exactly the
rows, in exactly the order, this node would have fed the expert; the
weighting and the additions stay here in the local order -- so with float32
rows the result is bit-identical to running every expert here. Router,
shared-expert gate, attention and norms never leave the holder.

An expert the exchange cannot serve (no peer, every peer's link failed) is
computed here when held; otherwise the forward raises ``ExpertsUnavailable``
and the session layer reports the hop as failed (the route driver fails over).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proto.errors import MeshdError
from proto.moe.wire import SHARED

__all__ = ["MoeDispatch", "ExpertExchange", "ExpertsUnavailable", "expert_ffn", "route_rows", "HeldExperts"]


class ExpertsUnavailable(MeshdError):
    """Experts of a layer are neither held here nor reachable on any expert peer."""


class ExpertExchange(Protocol):
    """Runs experts of one layer elsewhere (shard/experts/pool.py: ExpertRouter)."""

    prefer_remote: bool

    def note_positions(self, count: int) -> None:
        """The backend ran ``count`` more positions (bytes per position are reported)."""
        ...

    def can_serve(self, layer: int, expert: int) -> bool: ...

    def run(self, layer: int, rows: np.ndarray,
            items: list[tuple[int, np.ndarray]]) -> tuple[dict[int, np.ndarray], list[int]]:
        """(outputs by expert id, expert ids no peer served). rows: float32 [S, hidden]."""
        ...


def expert_ffn(gate_up: torch.Tensor, down: torch.Tensor, act_fn, x: torch.Tensor) -> torch.Tensor:
    """One routed expert on its rows, unweighted: the ops of transformers' eager experts loop."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act_fn(gate) * up, down)


def route_rows(top_k_index: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(expert, token rows, top-k slot)] for every expert hit, ascending, rows in eager's order."""
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    out = []
    for expert in hit[:, 0].tolist():
        if expert == num_experts:
            continue
        top_k_pos, token_idx = torch.where(mask[expert])
        out.append((expert, token_idx, top_k_pos))
    return out


class HeldExperts(nn.Module):
    """The routed experts this node holds for one layer, stacked like transformers' experts
    (``gate_up_proj`` [n, 2 * moe_intermediate, hidden], ``down_proj`` [n, hidden, moe_intermediate])."""

    def __init__(self, held: tuple[int, ...], hidden: int, intermediate: int, act_fn) -> None:
        super().__init__()
        self.held = held
        self.position = {e: i for i, e in enumerate(held)}
        self.act_fn = act_fn
        self.gate_up_proj = nn.Parameter(torch.empty(len(held), 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(len(held), hidden, intermediate))

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        i = self.position[expert]
        return expert_ffn(self.gate_up_proj[i], self.down_proj[i], self.act_fn, x)


def _rows_f32(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32).contiguous().numpy()


class MoeDispatch(nn.Module):
    """Drop-in for a transformers sparse MoE block (same parameter names) whose experts may be remote.

    ``block``: the transformers block built on meta (its router and shared-expert
    gate are kept as they are); ``held``: the routed experts loaded here;
    ``shared_held``: whether the shared expert (Qwen2-MoE) is loaded here.
    """

    def __init__(self, block: nn.Module, *, layer: int, num_experts: int, held: tuple[int, ...],
                 shared_held: bool, hidden: int, intermediate: int, act_fn,
                 exchange: ExpertExchange | None) -> None:
        super().__init__()
        self.layer, self.num_experts, self.hidden = layer, num_experts, hidden
        self.gate = block.get_submodule("gate")
        self.experts = HeldExperts(held, hidden, intermediate, act_fn)
        self.has_shared = hasattr(block, "shared_expert")
        self.shared_expert = block.get_submodule("shared_expert") if self.has_shared and shared_held else None
        self.shared_expert_gate = block.get_submodule("shared_expert_gate") if self.has_shared else None
        self.exchange = exchange

    def _local(self, expert: int) -> bool:
        held = expert in self.experts.position if expert != SHARED else self.shared_expert is not None
        if not held:
            return False
        return not (self.exchange is not None and self.exchange.prefer_remote
                    and self.exchange.can_serve(self.layer, expert))

    def _compute(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if expert == SHARED:
            if self.shared_expert is None:
                raise ExpertsUnavailable(f"layer {self.layer}: the shared expert is neither held here nor "
                                         "reachable on an expert peer")
            return self.shared_expert(x)
        if expert not in self.experts.position:
            raise ExpertsUnavailable(f"layer {self.layer}: expert {expert} is neither held here nor reachable "
                                     "on an expert peer; start an expert peer for it (meshd join --experts)")
        return self.experts.run(expert, x)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        h = hidden_states.view(-1, hidden)
        _, weights, selected = self.gate(h)
        routes = route_rows(selected, self.num_experts)
        wanted = [(e, rows) for e, rows, _ in routes]
        if self.has_shared:
            wanted.append((SHARED, torch.arange(h.shape[0])))
        remote = [(e, rows.numpy()) for e, rows in wanted if not self._local(e)]
        outputs: dict[int, torch.Tensor] = {}
        if remote:
            if self.exchange is None:
                unserved = [e for e, _ in remote]
            else:
                got, unserved = self.exchange.run(self.layer, _rows_f32(h), remote)
                for e, rows_out in got.items():
                    outputs[e] = torch.from_numpy(np.array(rows_out, dtype=np.float32)).to(h.dtype)
            for e in unserved:   # failover of last resort: compute what we hold
                rows = dict(wanted)[e]
                outputs[e] = self._compute(e, h[rows])
        final = torch.zeros_like(h)
        for expert, token_idx, top_k_pos in routes:
            y = outputs[expert] if expert in outputs else self._compute(expert, h[token_idx])
            y = y * weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        if self.shared_expert_gate is not None:   # the block has a shared expert
            shared = outputs[SHARED] if SHARED in outputs else self._compute(SHARED, h)
            shared = torch.sigmoid(self.shared_expert_gate(h)) * shared
            final = final + shared
        return final.reshape(batch, seq, hidden)
