"""Dense-gradient aggregation across trainers (docs/architecture.md: Chunked aggregation).

Two interchangeable :class:`DenseReducer`\\ s sum the trainers' flat ``float32`` dense gradients:

- :class:`ChunkedAggregator` — PHub's streamed chunks over plain TCP, bit-identical on every rank
  in one documented order (within a node in rank order, then across nodes in node order); with
  an optimizer the chunks' owners also step it and stream back weights.
- :class:`AllReduceDense` — ``ray.util.collective.allreduce`` on an existing group: the
  backend's order, so ranks agree only within float rounding of the rank-ordered sum.

:func:`start_aggregators` starts the one actor the scheme needs, a directory where the ranks
find each other's address once; no gradient passes through Ray.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from hpsray.cluster import faults
from hpsray.cluster.aggregation_mesh import Mesh, build_mesh, start_directory
from hpsray.cluster.aggregation_stream import OwnerOptimizer, StreamEngine
from hpsray.cluster.aggregation_topology import (
    DEFAULT_CHUNK_BYTES,
    ELEMENT_BYTES,
    ChunkPlan,
    Topology,
    assign_chunks,
    chunk_elements,
    hierarchical_sum,
    n_chunks,
)

DEFAULT_WORKERS = 2
"""Aggregation workers per node (worker 0 in the caller's thread, the others in threads of their
own, each with its own connections and chunks): on the loaded 2-core development machine two
kept ≥ 1.3× gloo in every run, one ranged 0.9–2.2× (docs/benchmarks.md, "Notes from the code");
nodes with cores to spare may take more."""


DEFAULT_OPTIMIZER_BYTES = 256 * 1024
"""With the optimizer at the owners, how many bytes of chunks one optimizer call steps: a torch
optimizer costs ~0.2 ms a call beyond its arithmetic, so stepping every 32 KiB chunk alone took
4× as long as the replicas' optimizers over the model's tensors (docs/benchmarks.md, "Notes from
the code")."""


@runtime_checkable
class DenseReducer(Protocol):
    """What a trainer needs to synchronise its dense gradient after a mini-batch."""

    def reduce(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """Element-wise SUM of ``flat`` over all ranks for ``step``; ``flat`` is left unchanged.

        Every rank calls it once per step with a 1-D ``float32`` tensor of the same length.
        """
        ...


def start_aggregators(
    world: int,
    node_ids: Sequence[str] | None = None,
    name_prefix: str | None = None,
    workers: int = DEFAULT_WORKERS,
    timeout_s: float | None = None,
) -> list:
    """Start what chunked aggregation needs for ``world`` trainers; returns the handles to give
    every :class:`ChunkedAggregator` (and to ``ray.kill`` at the end).

    That is one :class:`~hpsray.cluster.aggregation_mesh.AggregatorDirectory` actor (on
    ``node_ids[0]`` when given; no CPU reserved), holding the default ``workers`` per node. The
    aggregation itself runs in the trainers. Named ``{name_prefix}:AggregatorDirectory``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    name = f"{name_prefix}:AggregatorDirectory" if name_prefix else None
    node = node_ids[0] if node_ids else None
    return [start_directory(world, workers, node, name, timeout_s)]


def _check_flat(flat: torch.Tensor) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.float32:
        got = f"{flat.dtype}{list(flat.shape)}" if isinstance(flat, torch.Tensor) else type(flat).__name__
        raise TypeError(f"dense reduce needs a 1-D float32 tensor, got {got}")


def _host(flat: torch.Tensor) -> np.ndarray:
    return flat.detach().to("cpu").contiguous().numpy()


class ChunkedAggregator:
    """A trainer's side of streamed chunked aggregation (a :class:`DenseReducer`).

    Args:
        handles: what :func:`start_aggregators` returned, the same on every rank.
        world: number of trainers; rank: this trainer, ``0 <= rank < world``.
        chunk_bytes: chunk size, a multiple of 4 (default 32 KiB).
        workers: aggregation workers per node; ``None``: the directory's.
        optimizer, lr: the dense optimizer (``adam``, ``adagrad``, ``sgd``) the owners step for
            :meth:`update` / :meth:`step_models`; the same on every rank.
        optimizer_bytes: the owners step their chunks in runs of this many bytes (whole chunks,
            at least one), each once it is reduced; 0: :data:`DEFAULT_OPTIMIZER_BYTES`.
        timeout_s: how long any wait on another rank may last before
            :class:`~hpsray.errors.FaultTimeout` (``None``: the fault timeout).

    Every rank connects on its first call (or :meth:`connect`, which every rank calls at once).
    """

    def __init__(
        self,
        handles: Sequence,
        world: int,
        rank: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        workers: int | None = None,
        optimizer: str | None = None,
        lr: float | None = None,
        optimizer_bytes: int = 0,
        timeout_s: float | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        if world > 1 and not handles:
            raise ValueError("ChunkedAggregator needs the handles of start_aggregators")
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        chunk_elements(chunk_bytes)  # validates
        self.handles, self.world, self.rank, self.chunk_bytes = list(handles), world, rank, chunk_bytes
        # every wait on another rank (registering, connecting, a step's data) ends within this
        self.workers, self.timeout_s = workers, faults.fault_timeout() if timeout_s is None else timeout_s
        self.optimizer, self.lr = optimizer, lr
        self._engine: StreamEngine | None = None
        self._opt: OwnerOptimizer | None = None
        if optimizer is not None:
            if lr is None:
                raise ValueError("an optimizer at the aggregators needs its lr")
            per = chunk_elements(chunk_bytes)
            segment = per * max(1, (optimizer_bytes or DEFAULT_OPTIMIZER_BYTES) // chunk_bytes)
            self._opt = OwnerOptimizer(optimizer, float(lr), segment)

    def connect(self) -> ChunkedAggregator:
        """Open this rank's connections (every rank at once); a no-op when open."""
        self._connected()
        return self

    def _connected(self) -> StreamEngine:
        if self._engine is None:
            if self.world == 1:
                w = self.workers or DEFAULT_WORKERS
                mesh = Mesh(Topology((0,)), 0, w, [{}] * w, [{}] * w, [{}] * w, [None] * w)
            else:
                mesh = build_mesh(self.handles[0], self.rank, self.world, self.workers, self.timeout_s)
            self._engine = engine = StreamEngine(mesh, self.chunk_bytes, self.timeout_s)
            self._finalizer = weakref.finalize(self, engine.close)
        return self._engine

    @property
    def workers_per_node(self) -> int:
        """Aggregation workers per node (after :meth:`connect`)."""
        return self._connected().mesh.workers

    @property
    def topology(self) -> Topology:
        """The ranks' nodes (after :meth:`connect`)."""
        return self._connected().mesh.topology

    def plan(self, n_elements: int) -> ChunkPlan:
        """The chunk plan for a gradient of ``n_elements`` values (slot ``w * n_nodes + k``)."""
        engine = self._connected()
        return engine.mesh.topology.plan(n_elements, engine.mesh.workers, self.chunk_bytes)

    def reduce(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """Sum ``flat`` over all ranks, bit-identical on every rank (order: module docstring)."""
        _check_flat(flat)
        out = torch.from_numpy(self._connected().run(step, _host(flat)))
        return out if flat.device.type == "cpu" else out.to(flat.device)

    def update(self, grad: torch.Tensor, params: torch.Tensor, step: int) -> torch.Tensor:
        """One optimizer step at the owners: the weights after stepping ``params`` (equal on every
        rank) with the summed ``grad``; bit-identical on every rank."""
        if self.optimizer is None:
            raise ValueError("update needs ChunkedAggregator(..., optimizer=..., lr=...)")
        _check_flat(grad)
        _check_flat(params)
        if params.shape != grad.shape:
            raise ValueError(f"params {list(params.shape)} and grad {list(grad.shape)} differ")
        out = torch.from_numpy(self._connected().run(step, _host(grad), _host(params), self._opt))
        return out if grad.device.type == "cpu" else out.to(grad.device)

    def step_models(self, models: Sequence[torch.nn.Module], step: int) -> None:
        """The dense step of a trainer's replicas with the optimizer at the aggregators: sum the
        replicas' gradients (zeros for parameters without one), :meth:`update`, and write the
        weights into every replica (their own optimizers are not used)."""
        params = [list(m.parameters()) for m in models]
        with torch.no_grad():
            flat = torch.cat(
                [
                    sum((p.grad for p in group if p.grad is not None), torch.zeros_like(group[0])).reshape(-1)
                    for group in zip(*params)
                ]
            )
            weights = torch.cat([p.detach().reshape(-1) for p in params[0]])
            new = self.update(flat, weights, step)
            offset = 0
            for group in zip(*params):
                n = group[0].numel()
                piece = new[offset : offset + n].view_as(group[0])
                for p in group:
                    p.copy_(piece)
                offset += n

    def optimizer_state(self) -> dict:
        """The state of the optimizer steps this rank ran as an owner (for a checkpoint)."""
        return self._opt.state_dict() if self._opt is not None else {}

    def load_optimizer_state(self, state: dict) -> None:
        """Continue from this rank's :meth:`optimizer_state` (same world, ranks, chunks, workers)."""
        if self._opt is None:
            raise ValueError("no optimizer at the aggregators to load a state into")
        self._opt.load_state_dict(state)

    def close(self) -> None:
        """Close the connections (also done when the aggregator is collected)."""
        if self._engine is not None:
            self._finalizer()
            self._engine = None


class AllReduceDense:
    """``ray.util.collective.allreduce`` (SUM) over an initialised group (a :class:`DenseReducer`).

    The caller's process must already be a member of ``group_name``
    (``ray.util.collective.init_collective_group``). ``flat`` is copied, then reduced in place.
    """

    def __init__(self, group_name: str) -> None:
        self.group_name = group_name

    def reduce(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """Sum ``flat`` over the group's ranks (``step`` is not needed by the collective)."""
        import ray.util.collective as col

        _check_flat(flat)
        out = flat.detach().clone().contiguous()
        col.allreduce(out, group_name=self.group_name)
        return out


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_OPTIMIZER_BYTES",
    "DEFAULT_WORKERS",
    "ELEMENT_BYTES",
    "AllReduceDense",
    "ChunkPlan",
    "ChunkedAggregator",
    "DenseReducer",
    "Topology",
    "assign_chunks",
    "chunk_elements",
    "hierarchical_sum",
    "n_chunks",
    "start_aggregators",
]
