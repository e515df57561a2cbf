"""The worker of a node whose range is assigned at run time (``--layers auto``).

``WorkerSlot.run`` is a child of the daemon's nursery and owns one inner
nursery; ``load(layers)`` stops the current supervisor (its worker gets
SIGTERM; the daemon withdraws its records through ``on_down``) and starts a
new ``Supervisor`` for the new range in that nursery. With ``resolve`` (a
node started with ``--model ROOT``) the model file of a range comes from it
first -- a fetch when the node does not hold the range yet -- inside the
same task, so ``load`` returns at once and a LOAD directive is answered
while the weights arrive. A worker that fails
before it is ever ready ends only its own supervisor, not the daemon: the
slot records the failure (``failure``) and the node asks the tracker again.

State: the current range, the supervisor's cancel scope, the last failure.
The daemon's ``Node.supervisor`` is pointed at the live supervisor so that
``meshd status`` shows it.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import trio

from meshd.daemon.supervisor import Backoff, Supervisor, WorkerReady
from meshd.daemon.worker_process import WorkerProcess, WorkerSpec
from meshd.errors import WorkerFailed
from proto.errors import MeshdError

log = logging.getLogger(__name__)


class WorkerSlot:
    def __init__(self, node, *, memory_bytes: int = 0, on_loaded: Callable[[tuple[int, int]], None] | None = None,
                 resolve: Callable[[tuple[int, int]], Awaitable[Path]] | None = None):
        self.node = node
        self.resolve = resolve
        self.fetching: tuple[int, int] | None = None
        self.memory_bytes = memory_bytes
        self.on_loaded = on_loaded
        self.layers: tuple[int, int] | None = None
        self.ready = False
        self.failure: str | None = None
        self._nursery: trio.Nursery | None = None
        self._scope: trio.CancelScope | None = None
        self._stopped: trio.Event | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def spec(self, layers: tuple[int, int], model: Path | None = None) -> WorkerSpec:
        spec = WorkerSpec.of_node(self.node.config, layers, tls=self.node.tls, tls_host=self.node.tls_bind_host,
                                  node_key=self.node.identity.signing_key)
        return spec if model is None else replace(spec, model=model)

    async def drop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            if self._stopped is not None:   # set with the scope
                await self._stopped.wait()
            self._scope = None
        self.layers, self.ready = None, False

    async def load(self, layers: tuple[int, int]) -> None:
        """Serve ``layers`` from now on (restarting the worker if it served another range)."""
        if layers == self.layers and self.failure is None:
            return
        await self.drop()
        self.layers, self.failure = layers, None
        assert self._nursery is not None, "WorkerSlot.run must be started first"
        self._scope = await self._nursery.start(self._supervise, layers)

    def _supervisor(self, layers: tuple[int, int], model: Path | None) -> Supervisor:
        node, w = self.node, self.node.config.worker
        worker = WorkerProcess(self.spec(layers, model), progress=lambda line: node.progress(f"worker: {line}"))
        supervisor = Supervisor(worker.life, on_ready=self._on_ready, on_down=self._on_down,
                                backoff=Backoff(w.restart_backoff_s, w.restart_backoff_max_s,
                                                w.restart_backoff_reset_s),
                                give_up_before_ready=True)   # a range it cannot load: ask the tracker again
        node.supervisor = supervisor
        node.progress(f"starting the worker for layers {layers[0]}:{layers[1]} of {model or node.config.model}")
        return supervisor

    async def _supervise(self, layers, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        stopped = self._stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                try:
                    model = None
                    if self.resolve is not None:
                        self.fetching = layers
                        try:
                            model = await self.resolve(layers)
                        finally:
                            self.fetching = None
                    await self._supervisor(layers, model).run()
                except (WorkerFailed, MeshdError) as exc:
                    self.failure = str(exc)
                    self.node.progress(f"worker for layers {layers[0]}:{layers[1]} failed: {exc}")
        finally:
            stopped.set()

    async def _on_ready(self, ready: WorkerReady) -> None:
        # Our record offers our memory to the tracker (a rebalancing candidate), in every claim the
        # node builds from now on -- also those rebuilt later for a new reachability verdict or free KV.
        self.node.memory_budget_bytes = self.memory_bytes
        await self.node.on_worker_ready(ready)
        self.ready = True
        if self.on_loaded is not None and self.layers is not None:
            self.on_loaded(self.layers)

    async def _on_down(self) -> None:
        self.ready = False
        await self.node.on_worker_down()
