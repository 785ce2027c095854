"""How a node's trainer joins its group and which strategy that picks (docs/architecture.md:
One training step): the collectives are Ray's and torch.distributed's, so they are made here, in the
actor layer, and handed to the Ray-free strategies of :mod:`hpsray.training.strategies`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from hpsray.actors.timing import StageClock
from hpsray.training.devices import DevicePart, DeviceSteps
from hpsray.training.engine import TrainerEngine
from hpsray.training.relaxed import RelaxedSteps
from hpsray.training.strategies import BspSteps, DenseReduce, LocalSteps, Strategy


class Joining(Protocol):
    """What joining reads of the :class:`~hpsray.actors.trainer.Trainer` that joins: its node,
    its device on the node, its engine and clock, and the strategy it trained with so far."""

    @property
    def node(self) -> int: ...
    @property
    def n_devices(self) -> int: ...
    @property
    def device_index(self) -> int: ...
    @property
    def engine(self) -> TrainerEngine: ...
    @property
    def clock(self) -> StageClock: ...
    @property
    def strategy(self) -> Strategy: ...


def join_group(
    trainer: Joining, world: int, name: str, sync: Any, aggregators: Sequence[Any] | None, board: Any
) -> Strategy:
    """One device per node: the collective group (with ``world > 1``), then the strategy of
    ``sync.consistency``: BSP, or a relaxed mode with its update exchange (push and pull start
    this trainer's mailbox and find the others'; relay uses ``board``)."""
    steps = _join_group(trainer, world, name, sync, aggregators, board)
    steps.sent = trainer.strategy.sent  # the payloads so far carry over a re-formed group
    return steps


def _join_group(
    trainer: Joining, world: int, name: str, sync: Any, aggregators: Sequence[Any] | None, board: Any
) -> Strategy:
    from hpsray.cluster.collective import CollectiveGroup

    engine, timed = trainer.engine, trainer.clock.timed
    if world == 1 and sync.consistency == "bsp":
        return LocalSteps(engine, timed)
    backend = "nccl" if engine.device.is_cuda else "gloo"
    timeout_s = getattr(sync, "fault_timeout_s", None)
    group = CollectiveGroup(world, trainer.node, name, backend, timeout_s=timeout_s)
    straggle = straggler(sync, trainer.node)
    if sync.consistency != "bsp":
        from hpsray.cluster import consistency

        propagation = getattr(sync, "propagation", "relay")
        exchange, _mailbox = consistency.join_exchange(propagation, name, world, trainer.node, board)
        steps = RelaxedSteps(engine, trainer.node, world, sync, exchange, group, straggle, timed)
        steps.mailbox = _mailbox  # type: ignore[attr-defined]  # the actor handle lives as long as the strategy
        return steps
    reduce: DenseReduce = group.allreduce_sum
    if sync.dense == "chunked":
        reducer = _aggregator(aggregators, world, trainer.node, sync, timeout_s)

        def reduce(flat: torch.Tensor) -> torch.Tensor:
            out = reducer.reduce(flat, engine.step)
            group.bytes_sent += flat.numel() * flat.element_size()
            return out

    return BspSteps(engine, group, reduce, straggle, timed)


def join_mesh(
    trainer: Joining,
    address: str,
    n_nodes: int,
    chunked: bool,
    aggregators: Sequence[Any] | None,
    sync: Any,
    peers: Callable[[], list[DevicePart]],
) -> DeviceSteps:
    """``D > 1`` devices per node: the device mesh, and the strategy over it; with ``chunked``
    dense gradients are summed per node, across nodes by device 0's chunked aggregator, then
    broadcast back to the node."""
    from hpsray.cluster.mesh import DeviceMesh

    engine = trainer.engine
    backend = "nccl" if engine.device.is_cuda else "gloo"
    mesh = DeviceMesh(address, n_nodes, trainer.n_devices, trainer.node, trainer.device_index, backend)
    reduce: DenseReduce = mesh.allreduce_sum
    if chunked:
        reducer = None
        if trainer.device_index == 0 and aggregators is not None:
            reducer = _aggregator(aggregators, n_nodes, trainer.node, sync, getattr(sync, "fault_timeout_s", None))

        def reduce(flat: torch.Tensor) -> torch.Tensor:
            total = mesh.node_sum(flat)
            if reducer is not None:
                total = reducer.reduce(total, engine.step)
            return mesh.node_broadcast(total)

    steps = DeviceSteps(engine, trainer.n_devices, trainer.device_index, mesh, reduce, peers, trainer.clock.timed)
    steps.sent = trainer.strategy.sent  # the payloads so far carry over a re-formed mesh
    return steps


def _aggregator(aggregators: Sequence[Any] | None, world: int, node: int, sync: Any, timeout_s: float | None) -> Any:
    from hpsray.cluster.aggregation import ChunkedAggregator

    assert aggregators is not None  # the pipeline starts them for chunked dense sync
    return ChunkedAggregator(aggregators, world, node, chunk_bytes=sync.chunk_bytes, timeout_s=timeout_s)


def straggler(sync: Any, node: int) -> Callable[[int], None]:
    """``SyncSettings(straggler_delay_s=...)``: the trainer of ``straggler_node`` sleeps before
    mini-batch ``clock`` for a seeded delay, ``delay * U(0, 2)`` with probability
    ``straggler_probability`` (the same delays in every mode, for experiments)."""
    delay = getattr(sync, "straggler_delay_s", 0.0)

    def straggle(clock: int) -> None:
        if not delay or node != sync.straggler_node:
            return
        rng = np.random.default_rng([sync.straggler_seed, node, clock])
        if rng.random() < sync.straggler_probability:
            time.sleep(delay * rng.uniform(0.0, 2.0))

    return straggle
