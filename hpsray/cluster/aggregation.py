"""Dense-gradient aggregation across trainers: PHub-style key chunks, or a collective all-reduce.

Every trainer holds the same replicated dense parameters; after each mini-batch the trainers
sum their flat ``float32`` dense gradients. Two interchangeable :class:`DenseReducer`\\ s do it:

- :class:`AllReduceDense` — ``ray.util.collective.allreduce`` on an existing group (gloo on
  CPU, NCCL on GPU). The summation order is the backend's, so ranks agree only within float
  rounding of the rank-ordered sum.
- :class:`ChunkedAggregator` — PHub's scheme: the flat gradient is cut into fixed chunks
  (default 32 KiB = 8192 ``float32``), each chunk has exactly one aggregator actor
  (:func:`assign_chunks`, a fixed balanced assignment), every trainer pushes each aggregator
  its chunks, the aggregator waits for all ``world`` contributions of the step, sums them in
  rank order (rank 0 + rank 1 + ...) and returns the sum to every trainer. Every rank gets a
  bit-identical result, equal to the rank-ordered sum.

Aggregators are async Ray actors (:func:`start_aggregators`), one per node by default, placed
with :func:`hpsray.cluster.runtime.on_node`. An aggregator holds a *contiguous* run of chunks,
so a trainer sends one message per aggregator and step by default (``message_bytes`` splits it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

DEFAULT_CHUNK_BYTES = 32 * 1024
"""PHub's chunk: 32 KiB, 8192 ``float32`` values."""

DEFAULT_MESSAGE_BYTES: int | None = None
"""Most gradient bytes a trainer sends an aggregator in one call; ``None``: all its chunks in one
call, because Ray's per-call cost outweighs the object-store hop (docs/benchmarks.md, "Notes from
the code")."""

ELEMENT_BYTES = 4  # float32


@runtime_checkable
class DenseReducer(Protocol):
    """What a trainer needs to synchronise its dense gradient after a mini-batch."""

    def reduce(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """Element-wise SUM of ``flat`` over all ranks for ``step``; ``flat`` is left unchanged.

        Every rank calls it once per step with a 1-D ``float32`` tensor of the same length.
        """
        ...


# -- the fixed chunk -> aggregator assignment (pure functions) ------------------------------------


def chunk_elements(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """``float32`` values per chunk; ``chunk_bytes`` must be a positive multiple of 4."""
    if not isinstance(chunk_bytes, (int, np.integer)) or chunk_bytes < ELEMENT_BYTES or chunk_bytes % ELEMENT_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ELEMENT_BYTES}, got {chunk_bytes!r}")
    return int(chunk_bytes) // ELEMENT_BYTES


def n_chunks(n_elements: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Chunks of a flat gradient of ``n_elements`` values (the last one may be short)."""
    if n_elements < 0:
        raise ValueError(f"n_elements must be >= 0, got {n_elements}")
    per = chunk_elements(chunk_bytes)
    return -(-int(n_elements) // per)


def assign_chunks(n_chunks_: int, n_aggregators: int) -> np.ndarray:
    """Owner aggregator of every chunk: ``int64[n_chunks]``, non-decreasing.

    Aggregator ``a`` gets the contiguous run of chunks ``[start_a, start_a + count_a)`` where
    the last ``n_chunks % n_aggregators`` aggregators take one chunk more than the others. So
    every chunk has exactly one aggregator and chunk counts differ by at most one; the short last
    chunk (if any) lands on the last aggregator, which holds as many chunks as any other, so byte
    loads differ by at most one chunk's bytes.
    """
    if n_aggregators < 1:
        raise ValueError(f"need at least one aggregator, got {n_aggregators}")
    if n_chunks_ < 0:
        raise ValueError(f"n_chunks must be >= 0, got {n_chunks_}")
    base, extra = divmod(int(n_chunks_), int(n_aggregators))
    counts = np.full(n_aggregators, base, dtype=np.int64)
    counts[n_aggregators - extra :] += 1
    return np.repeat(np.arange(n_aggregators, dtype=np.int64), counts)


@dataclass(frozen=True)
class ChunkPlan:
    """How a flat gradient of ``n_elements`` ``float32`` values is spread over the aggregators.

    ``owner[c]`` is chunk ``c``'s aggregator; aggregator ``a`` reduces the element range
    ``bounds[a] = (lo, hi)`` (empty when ``lo == hi``: more aggregators than chunks).
    """

    n_elements: int
    chunk_bytes: int
    n_aggregators: int
    owner: np.ndarray
    bounds: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, n_elements: int, n_aggregators: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ChunkPlan:
        """The plan of :func:`assign_chunks` for this gradient size."""
        per = chunk_elements(chunk_bytes)
        owner = assign_chunks(n_chunks(n_elements, chunk_bytes), n_aggregators)
        counts = np.bincount(owner, minlength=n_aggregators)
        first = np.concatenate([[0], np.cumsum(counts)])
        bounds = tuple(
            (min(int(first[a]) * per, n_elements), min(int(first[a + 1]) * per, n_elements))
            for a in range(n_aggregators)
        )
        return cls(int(n_elements), int(chunk_bytes), int(n_aggregators), owner, bounds)

    @property
    def n_chunks(self) -> int:
        """Number of chunks."""
        return len(self.owner)

    def chunk_counts(self) -> list[int]:
        """Chunks per aggregator."""
        return np.bincount(self.owner, minlength=self.n_aggregators).tolist()

    def byte_loads(self) -> list[int]:
        """Gradient bytes per aggregator (per trainer and step)."""
        return [(hi - lo) * ELEMENT_BYTES for lo, hi in self.bounds]


# -- the aggregator actor -------------------------------------------------------------------------


class _Round:
    """One step's contributions at one aggregator."""

    __slots__ = ("arrived", "done", "parts", "result", "served")

    def __init__(self, world: int) -> None:
        self.parts: list[np.ndarray | None] = [None] * world
        self.arrived = 0
        self.done = asyncio.Event()
        self.result: np.ndarray | BaseException | None = None
        self.served = 0


class ChunkAggregatorActor:
    """Reduces its chunks of every step over ``world`` trainers (use as an async Ray actor).

    ``push(step, rank, payload)`` returns, once all ``world`` ranks pushed ``step``, the sum of
    the payloads in rank order. Payloads of one step must have equal lengths; a rank may push a
    step once. A step not completed within ``timeout_s`` fails for every waiting rank.
    """

    def __init__(self, index: int, world: int, node: int | None = None, timeout_s: float = 300.0) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.index, self.world, self.node, self.timeout_s = index, world, node, timeout_s
        self._rounds: dict[tuple[int, int], _Round] = {}
        self.steps_reduced = 0
        self.bytes_in = 0

    def __repr__(self) -> str:
        where = f"node {self.node}" if self.node is not None else f"#{self.index}"
        return f"Aggregator[{where}]"

    async def push(self, step: int, rank: int, payload: np.ndarray, part: int = 0) -> np.ndarray:
        """Contribute ``rank``'s chunks of ``step``; returns their sum over all ranks.

        ``part`` tells apart several messages of one step (e.g. the first chunk's index).
        """
        if not 0 <= rank < self.world:
            raise ValueError(f"{self!r}: rank {rank} outside world of {self.world}")
        key = (step, part)
        r = self._rounds.get(key)
        if r is None:
            r = self._rounds[key] = _Round(self.world)
        if r.done.is_set():
            raise ValueError(f"{self!r}: step {step} is already closed (rank {rank} came too late)")
        if r.parts[rank] is not None:
            raise ValueError(f"{self!r}: rank {rank} pushed step {step} twice")
        payload = np.asarray(payload)
        if payload.dtype != np.float32 or payload.ndim != 1:
            raise TypeError(f"{self!r}: payload must be 1-D float32, got {payload.dtype}{list(payload.shape)}")
        r.parts[rank] = payload
        r.arrived += 1
        self.bytes_in += payload.nbytes
        if r.arrived == self.world:
            r.result = self._sum(step, r.parts)
            r.parts = []
            r.done.set()
        else:
            try:
                await asyncio.wait_for(r.done.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                missing = [i for i, p in enumerate(r.parts) if p is None]
                r.result = TimeoutError(
                    f"{self!r}: step {step} incomplete after {self.timeout_s:g} s; no contribution from ranks {missing}"
                )
                r.done.set()
        r.served += 1
        if r.served == r.arrived or r.served == self.world:
            self._rounds.pop(key, None)
        if isinstance(r.result, BaseException):
            raise r.result
        return r.result

    def _sum(self, step: int, parts: list[np.ndarray | None]) -> np.ndarray | BaseException:
        sizes = {p.shape[0] for p in parts if p is not None}
        if len(sizes) != 1:
            return ValueError(f"{self!r}: step {step}: ranks pushed different lengths {[len(p) for p in parts]}")
        total = np.array(parts[0], dtype=np.float32, copy=True)
        for p in parts[1:]:
            np.add(total, p, out=total)  # fixed rank order: identical result for every rank
        self.steps_reduced += 1
        return total

    def stats(self) -> dict:
        """Steps reduced, bytes received and steps still open."""
        return {
            "aggregator": repr(self),
            "steps_reduced": self.steps_reduced,
            "bytes_in": self.bytes_in,
            "open_steps": sorted(self._rounds),
        }


def start_aggregators(
    world: int,
    node_ids: Sequence[str] | None = None,
    n: int | None = None,
    name_prefix: str | None = None,
    num_cpus: float = 0,
    timeout_s: float = 300.0,
) -> list:
    """Start the aggregator actors; returns their handles in aggregator order.

    With ``node_ids``, aggregator ``i`` is pinned to ``node_ids[i]`` (one per node, shown as
    ``Aggregator[node i]``); otherwise ``n`` aggregators (default 1) go wherever Ray puts them.
    ``num_cpus=0`` by default: aggregators mostly wait on messages and must fit beside a node's
    trainer. Named ``{name_prefix}:Aggregator[node i]`` when ``name_prefix`` is given.
    """
    import ray

    from hpsray.cluster.runtime import on_node

    cls = ray.remote(ChunkAggregatorActor)
    count = len(node_ids) if node_ids is not None else (n or 1)
    if count < 1:
        raise ValueError("need at least one aggregator")
    handles = []
    for i in range(count):
        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": max(1000, 4 * world)}
        if node_ids is not None:
            opts["scheduling_strategy"] = on_node(node_ids[i])
        label = f"node {i}" if node_ids is not None else f"#{i}"
        if name_prefix:
            opts["name"] = f"{name_prefix}:Aggregator[{label}]"
        handles.append(cls.options(**opts).remote(i, world, i if node_ids is not None else None, timeout_s))
    return handles


# -- the reducers a trainer uses ------------------------------------------------------------------


def _check_flat(flat: torch.Tensor) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.float32:
        got = f"{flat.dtype}{list(flat.shape)}" if isinstance(flat, torch.Tensor) else type(flat).__name__
        raise TypeError(f"dense reduce needs a 1-D float32 tensor, got {got}")


class ChunkedAggregator:
    """A trainer's side of chunked aggregation (a :class:`DenseReducer`).

    Args:
        handles: the aggregator actors (:func:`start_aggregators`), the same list on every rank.
        world: number of trainers; rank: this trainer, ``0 <= rank < world``.
        chunk_bytes: chunk size, a multiple of 4 (default 32 KiB).
        message_bytes: most gradient bytes in one push (rounded down to whole chunks, at least
            one chunk); ``None``: one push per aggregator and step with all its chunks.
    """

    def __init__(
        self,
        handles: Sequence,
        world: int,
        rank: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    ) -> None:
        if not handles:
            raise ValueError("ChunkedAggregator needs at least one aggregator handle")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        per = chunk_elements(chunk_bytes)  # validates
        self.handles, self.world, self.rank, self.chunk_bytes = list(handles), world, rank, chunk_bytes
        self.message_elements = None if message_bytes is None else per * max(1, message_bytes // chunk_bytes)
        self._plan: ChunkPlan | None = None
        self._messages: list[tuple[int, int, int]] = []

    def plan(self, n_elements: int) -> ChunkPlan:
        """The (cached) chunk plan for a gradient of ``n_elements`` values."""
        if self._plan is None or self._plan.n_elements != n_elements:
            self._plan = ChunkPlan.build(n_elements, len(self.handles), self.chunk_bytes)
            self._messages = []
            for a, (lo, hi) in enumerate(self._plan.bounds):
                step = self.message_elements or max(hi - lo, 1)
                self._messages += [(a, m, min(m + step, hi)) for m in range(lo, hi, step)]
        return self._plan

    def messages(self, n_elements: int) -> list[tuple[int, int, int]]:
        """``(aggregator, lo, hi)`` of every push of a step, for a gradient of ``n_elements``."""
        self.plan(n_elements)
        return list(self._messages)

    def reduce(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """Sum ``flat`` over all ranks: the rank-ordered sum, bit-identical on every rank."""
        import ray

        _check_flat(flat)
        host = flat.detach().to("cpu").contiguous().numpy()
        self.plan(host.shape[0])
        refs = [self.handles[a].push.remote(step, self.rank, host[lo:hi], lo) for a, lo, hi in self._messages]
        out = np.empty(host.shape[0], dtype=np.float32)
        for (_, lo, hi), part in zip(self._messages, ray.get(refs)):
            out[lo:hi] = part
        result = torch.from_numpy(out)
        return result if flat.device.type == "cpu" else result.to(flat.device)


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
    "AllReduceDense",
    "ChunkAggregatorActor",
    "ChunkPlan",
    "ChunkedAggregator",
    "DenseReducer",
    "assign_chunks",
    "chunk_elements",
    "n_chunks",
    "start_aggregators",
]
