"""What the sample says about the whole run: distinct keys per batch, in flight and in all.

* **Per batch** and **in flight**: the pipeline pulls batch ``t+1`` while batch ``t`` is still
  pinned (``pull(t+1)`` is submitted before ``write_back(t)``; hpsray/pipelines/pipeline.py), so
  an owner's MEM-PS holds the rows of two consecutive global batches at once. The largest such
  union over the sample, per owner node, is the least ``mem_rows`` that does not raise
  :class:`~hpsray.errors.CapacityError` (the rule of :meth:`hpsray.tiers.mem.MemPS.pull`). These
  are exact counts over the sampled batches (``np.union1d`` of sorted keys).
* **In all**: cumulative distinct keys after each sampled batch, counted by a
  :class:`~hpsray.plan.sketch.DistinctSketch`, and extrapolated to the whole input by Heaps' law
  ``D(n) = K·n^β`` fitted to the last half of the growth curve (the local slope, so a vocabulary
  that saturates is not over-extrapolated much), capped by the key space when it is known.
* **Per table** (a job of several ``[[tables]]``: the sample's keys carry their table's tag):
  the same count and fit over each table's keys alone (``table_distinct``), so a table whose
  vocabulary saturates and one that keeps growing are each extrapolated by their own curve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpsray.plan.sample import Sample
from hpsray.plan.sketch import DistinctSketch
from hpsray.tiers.partition import owner_of
from hpsray.tiers.tagcount import by_tag

__all__ = ["KeyEstimate", "estimate_keys"]


@dataclass(frozen=True)
class KeyEstimate:
    """Distinct-key figures of a job (global unless ``per_node``; ``nodes`` owners)."""

    nodes: int
    batch_distinct_mean: float  # distinct keys of one global batch (all owners)
    batch_distinct_max: int
    pinned_max_per_node: list[int]  # per owner: most rows of two consecutive global batches
    hbm_working_set_max: int  # per trainer: most rows of its two consecutive batches
    sample_examples: int
    sample_distinct: float  # sketch count over the sample
    total_examples: int
    total_distinct: float  # extrapolated to the whole input (capped by key_space)
    growth_exponent: float  # β of D(n) = K·n^β (0 when the sample is the whole input)
    key_space: int | None
    pairs: int  # consecutive global-batch pairs in the sample
    table_distinct: tuple[float, ...] = ()  # per table (several tables only): total_distinct of its keys
    table_batch_distinct_mean: tuple[float, ...] = ()  # per table: distinct keys of one global batch

    @property
    def per_node_distinct(self) -> float:
        """Rows each owner's shard ends with (hash partitioning spreads keys evenly)."""
        return self.total_distinct / self.nodes

    @property
    def pinned_max(self) -> int:
        return max(self.pinned_max_per_node)


def _global_batches(sample: Sample, nodes: int) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Global batch ``g`` = the ``g``-th batch of every node's reader: sample batches ``gN..gN+N-1``
    (reader ``i`` of ``N`` takes every ``N``-th batch, starting with batch ``i``)."""
    shares = [sample.batch_keys[g * nodes : (g + 1) * nodes] for g in range(len(sample.batch_keys) // nodes)]
    if not shares:  # fewer batches than nodes: one partial global batch
        shares = [sample.batch_keys]
    merged = [parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts)) for parts in shares]
    return merged, shares


def _growth(batch_keys: list[np.ndarray], batch_examples: list[int]) -> tuple[np.ndarray, np.ndarray, float]:
    """Examples read and the sketch's distinct count after each sampled batch, and the final count."""
    sketch = DistinctSketch()
    seen, distinct = [], []
    n = 0
    for keys, ex in zip(batch_keys, batch_examples):
        sketch.add(keys)
        n += ex
        seen.append(n)
        distinct.append(sketch.count())
    return np.asarray(seen, float), np.asarray(distinct, float), float(distinct[-1])


def _extrapolate(
    seen: np.ndarray, distinct: np.ndarray, counted: float, sample: Sample, cap: int | None
) -> tuple[float, float]:
    """``(total, beta)``: ``counted`` distinct keys over the sample, extrapolated to the input."""
    total_examples = max(sample.size.rows, sample.examples)
    if sample.complete or total_examples <= sample.examples:
        beta, total = 0.0, counted
    else:
        beta = _heaps_exponent(seen, distinct)
        total = counted * (total_examples / sample.examples) ** beta
    return (min(total, float(cap)) if cap else total), beta


def _per_table(batch_keys: list[np.ndarray], n_tables: int) -> list[list[np.ndarray]]:
    """Each table's share of every batch's sorted tagged keys (a table's keys are contiguous)."""
    out: list[list[np.ndarray]] = [[] for _ in range(n_tables)]
    for keys in batch_keys:
        ends = np.cumsum(by_tag(keys)[:n_tables])
        for t in range(n_tables):
            out[t].append(keys[(ends[t - 1] if t else 0) : ends[t]])
    return out


def _heaps_exponent(seen: np.ndarray, distinct: np.ndarray) -> float:
    """β fitted on the last half of the growth curve (log-log least squares), in [0, 1]."""
    if seen.size < 2:
        return 1.0  # one batch says nothing about growth: assume keys keep coming (conservative)
    start = min(seen.size // 2, seen.size - 2)
    x, y = np.log(seen[start:]), np.log(np.maximum(distinct[start:], 1.0))
    if np.ptp(x) == 0:
        return 1.0
    beta = float(np.polyfit(x, y, 1)[0])
    return min(max(beta, 0.0), 1.0)


def estimate_keys(
    sample: Sample, nodes: int, key_space: int | None = None, table_key_space: list[int] | None = None
) -> KeyEstimate:
    """Key figures of ``sample`` for a job on ``nodes`` nodes, extrapolated to ``sample.size.rows``;
    ``table_key_space``: per table (several tables), the number of keys it can have, if known."""
    merged, shares = _global_batches(sample, nodes)
    owners = [owner_of(k, nodes) if nodes > 1 else None for k in merged]
    pinned = [
        int(np.count_nonzero(o == i)) if o is not None else int(k.size)
        for k, o in zip(merged, owners)
        for i in range(nodes)
    ]
    pinned_per = [max(pinned[i::nodes]) for i in range(nodes)]  # a lone batch pins alone
    hbm = max(k.size for k in sample.batch_keys)
    for g in range(len(merged) - 1):
        both = np.union1d(merged[g], merged[g + 1])
        if nodes == 1:
            pinned_per[0] = max(pinned_per[0], int(both.size))
        else:
            counts = np.bincount(owner_of(both, nodes), minlength=nodes)
            pinned_per = [max(a, int(c)) for a, c in zip(pinned_per, counts)]
        for b in range(min(len(shares[g]), len(shares[g + 1]))):
            hbm = max(hbm, int(np.union1d(shares[g][b], shares[g + 1][b]).size))
    seen, distinct, counted = _growth(sample.batch_keys, sample.batch_examples)
    total, beta = _extrapolate(seen, distinct, counted, sample, key_space)
    table_total: list[float] = []
    table_batch: list[float] = []
    if sample.n_tables > 1:
        for t, keys in enumerate(_per_table(sample.batch_keys, sample.n_tables)):
            grown = _growth(keys, sample.batch_examples)
            table_total.append(_extrapolate(*grown, sample, table_key_space[t] if table_key_space else None)[0])
        table_batch = [float(np.mean(k)) for k in zip(*(by_tag(m)[: sample.n_tables] for m in merged))]
    sizes = [k.size for k in merged]
    return KeyEstimate(
        nodes=nodes,
        batch_distinct_mean=float(np.mean(sizes)),
        batch_distinct_max=int(max(sizes)),
        pinned_max_per_node=pinned_per,
        hbm_working_set_max=int(hbm),
        sample_examples=sample.examples,
        sample_distinct=counted,
        total_examples=int(max(sample.size.rows, sample.examples)),
        total_distinct=float(total),
        growth_exponent=beta,
        key_space=key_space,
        pairs=max(len(merged) - 1, 0),
        table_distinct=tuple(table_total),
        table_batch_distinct_mean=tuple(table_batch),
    )
