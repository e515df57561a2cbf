"""Errors of the pure planners (adverts, tracker, assignment, directives, routing).

They hang off the project tree in proto/errors.py and say whose fault they are::

    MeshdError
    ├── LocalError                   our own misuse, never sent to a peer
    │   ├── PlanInputError           a planner called with invalid arguments (a bug here)
    │   └── SizeError                a human size we cannot read (the user's --memory)
    ├── ProtocolError                the remote peer's fault
    │   └── ProtocolViolation
    │       ├── AdvertRejected       a capability payload that fails validation
    │       └── DirectiveRefused     a directive this node must not obey (.reason)
    └── PlanningError                the swarm cannot do it right now; nobody's bug
        ├── MissingLayersError       no route: some layers have no live server (.spans)
        └── NoFitError               a node's memory cannot hold any range worth loading

``PlanInputError`` and ``SizeError`` are also ``ValueError`` so argparse and
plain callers can treat them as bad values. Every message says what to do.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from meshd.errors import SizeError  # noqa: F401 - re-exported: the planners' callers catch it here
from proto.errors import LocalError, MeshdError, ProtocolViolation


class LayerSpan(Protocol):
    """A half-open layer interval as these errors see it (meshd/plan/adverts.py ``Span``): the
    planners' errors sit below the planners' inputs, so they name no input type."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def length(self) -> int: ...


class PlanInputError(LocalError, ValueError):
    """A planner was called with arguments that break its contract (our bug)."""


class AdvertRejected(ProtocolViolation):
    """A peer's capability advert is malformed or unsupported; ignore the record."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class RefusalReason(enum.Enum):
    """Why a node refuses a rebalance directive (one row of the refusal table)."""

    MALFORMED = "malformed"              # bad schema version, action, range or id
    WRONG_TARGET = "wrong_target"        # addressed to another peer
    WRONG_MODEL = "wrong_model"          # for a model this node does not plan for
    SIGNER_MISMATCH = "signer_mismatch"  # signed by someone other than tracker_peer_id
    NOT_TRACKER = "not_tracker"          # signer is not the current tracker in our view
    EXPIRED = "expired"                  # past expires_at (beyond clock skew)
    FUTURE_DATED = "future_dated"        # issued (or epoch) ahead of our clock beyond skew
    REPLAYED = "replayed"                # directive_id already seen, or epoch older than seen
    WOULD_LEAVE_GAP = "would_leave_gap"  # DROP that uncovers layers while sessions use them
    NOT_SERVING = "not_serving"          # DROP of a range this node does not serve
    TOO_MANY = "too_many"                # replay ledger full of unexpired ids: a flood


class DirectiveRefused(ProtocolViolation):
    """A rebalance directive this node must not obey; ``reason`` says which rule."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(f"directive refused ({reason.value}): {message}")
        self.reason = reason


class PlanningError(MeshdError):
    """The swarm, as currently advertised, cannot satisfy the request."""


class MissingLayersError(PlanningError):
    """No route: nobody live serves ``spans`` of the model."""

    def __init__(self, spans: Sequence[LayerSpan], *, model_digest: str, num_layers: int,
                 excluded: Sequence[str] = (), recipe_digest: str = "") -> None:
        self.spans = tuple(spans)
        self.model_digest = model_digest
        self.num_layers = num_layers
        self.excluded = tuple(excluded)
        self.recipe_digest = recipe_digest
        listed = ", ".join(str(s) for s in self.spans)
        recipe = f" with runtime recipe {recipe_digest}" if recipe_digest else ""
        note = f" (after excluding failed peers {', '.join(self.excluded)})" if self.excluded else ""
        super().__init__(
            f"no live peer serves layer(s) {listed} of model {model_digest}{recipe} "
            f"({num_layers} layers){note}. Start a node for them with "
            "`meshd join --layers auto` (the tracker assigns the gap), or wait for the "
            "DHT to refresh if a node is restarting."
        )


class NoFitError(PlanningError):
    """The declared memory cannot hold even the smallest useful range."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
