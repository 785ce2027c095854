"""Who aggregates what: the nodes of the ranks, and the chunk -> (worker, node) assignment.

Ranks on one Ray node form a *node*; nodes are numbered by their lowest rank, and that rank is
the node's *leader*. A flat gradient is cut into fixed chunks (:func:`chunk_elements`); the
chunks are spread over ``workers x nodes`` *slots* by :func:`assign_chunks` (contiguous runs,
counts differ by at most one), slot ``s = w * n_nodes + k`` being worker ``w`` of node ``k``.
So worker ``w``'s slots over all nodes form one contiguous *stripe* of the gradient, and each
node owns a contiguous *block* of every stripe.

The summation order every rank gets (bit for bit): within a node the ranks' values in rank
order, then the node sums in node order — ``((g0 + g2) + g1)`` for ranks 0 and 2 on node 0 and
rank 1 on node 1; with one rank per node, the rank-ordered sum ``((g0 + g1) + g2)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_CHUNK_BYTES = 32 * 1024
"""PHub's chunk: 32 KiB, 8192 ``float32`` values."""

ELEMENT_BYTES = 4  # float32


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
    """Owner slot of every chunk: ``int64[n_chunks]``, non-decreasing.

    Slot ``a`` gets the contiguous run of chunks ``[start_a, start_a + count_a)`` where the last
    ``n_chunks % n_aggregators`` slots take one chunk more than the others. So every chunk has
    exactly one owner and chunk counts differ by at most one; the short last chunk (if any)
    lands on the last slot, which holds as many chunks as any other, so byte loads differ by at
    most one chunk's bytes.
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
    """How a flat gradient of ``n_elements`` ``float32`` values is spread over the slots.

    ``owner[c]`` is chunk ``c``'s slot; slot ``a`` reduces the element range ``bounds[a] =
    (lo, hi)`` (empty when ``lo == hi``: more slots than chunks).
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

    @property
    def chunk(self) -> int:
        """Values per chunk."""
        return self.chunk_bytes // ELEMENT_BYTES

    def chunk_counts(self) -> list[int]:
        """Chunks per slot."""
        return np.bincount(self.owner, minlength=self.n_aggregators).tolist()

    def byte_loads(self) -> list[int]:
        """Gradient bytes per slot (per trainer and step)."""
        return [(hi - lo) * ELEMENT_BYTES for lo, hi in self.bounds]

    def chunk_floor(self, x: int, hi: int) -> int:
        """``x`` rounded down to a chunk boundary, or ``hi`` (a range's end) once reached."""
        return hi if x >= hi else (x // self.chunk) * self.chunk


@dataclass(frozen=True)
class Topology:
    """The ranks' nodes: ``node_of[r]`` is rank ``r``'s node, nodes numbered by lowest rank."""

    node_of: tuple[int, ...]

    @classmethod
    def from_keys(cls, keys: Sequence[object]) -> Topology:
        """From any per-rank node identity (Ray node ids): equal keys share a node."""
        index: dict[object, int] = {}
        return cls(tuple(index.setdefault(k, len(index)) for k in keys))

    @property
    def world(self) -> int:
        return len(self.node_of)

    @property
    def n_nodes(self) -> int:
        return max(self.node_of) + 1 if self.node_of else 0

    def members(self, node: int) -> list[int]:
        """The ranks of ``node`` in rank order (its leader first)."""
        return [r for r, k in enumerate(self.node_of) if k == node]

    def leader(self, node: int) -> int:
        return self.node_of.index(node)

    def plan(self, n_elements: int, workers: int, chunk_bytes: int) -> ChunkPlan:
        """The chunk plan over ``workers x n_nodes`` slots (slot ``w * n_nodes + k``)."""
        return ChunkPlan.build(n_elements, workers * self.n_nodes, chunk_bytes)

    def stripe(self, plan: ChunkPlan, worker: int) -> list[tuple[int, int]]:
        """Worker ``worker``'s block of every node, in node order (together: one contiguous stripe)."""
        n = self.n_nodes
        return list(plan.bounds[worker * n : (worker + 1) * n])


def hierarchical_sum(parts: Sequence[np.ndarray], node_of: Sequence[int]) -> np.ndarray:
    """The documented order, for checks: per node the ranks' parts in rank order, then the node
    sums in order of node index (nodes numbered by their lowest rank)."""
    topo = Topology.from_keys(list(node_of))
    sums = []
    for k in range(topo.n_nodes):
        ranks = topo.members(k)
        s = np.array(parts[ranks[0]], dtype=np.float32, copy=True)
        for r in ranks[1:]:
            s += parts[r]
        sums.append(s)
    total = sums[0]
    for s in sums[1:]:
        total += s
    return total
