"""``hpsray bench cache``: MEM-PS replacement policies on synthetic key traces.

The real :class:`~hpsray.tiers.mem.MemPS` at one capacity under each policy (``lru_lfu``,
``lru``, ``lfu``, ``lfu_aged``) beside Belady's optimum, on a Zipf and a drifting trace; hit
rates count a batch's distinct keys. The policies and traces: docs/benchmarks.md, section
"What each bench measures" (`bench cache`).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hpsray.kernels.hashing import mix64_array
from hpsray.tiers.cache_policy import (
    DEFAULT_AGING,
    DEFAULT_HISTORY,
    DEFAULT_LRU_FRACTION,
    belady_hit_rate,
)
from hpsray.tiers.mem import MemPS

HELP = "hit rates of LRU->LFU, LRU, LFU and Belady's optimum on Zipf and drifting traces"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=float, default=1.0, help="scale universe, batch and capacity (default 1)")
    parser.add_argument("--universe", type=int, default=1_000_000, help="distinct keys at size 1")
    parser.add_argument("--batch", type=int, default=16_384, help="key draws per batch at size 1")
    parser.add_argument("--batches", type=int, default=300, help="batches per trace")
    parser.add_argument("--capacity", type=int, default=50_000, help="cache rows at size 1")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent")
    parser.add_argument(
        "--drift", type=float, default=0.003, help="drift trace: ranks moved per batch, as a fraction of the capacity"
    )
    parser.add_argument("--lru-fraction", type=float, default=DEFAULT_LRU_FRACTION)
    parser.add_argument(
        "--aging", type=float, default=DEFAULT_AGING, help="halve frequencies every AGING x capacity visits (0: never)"
    )
    parser.add_argument(
        "--history",
        type=float,
        default=DEFAULT_HISTORY,
        help="frequency sketch counters per depth, x capacity (0: counts restart on re-admission)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also sweep lru_fraction and aging for LRU->LFU (how the defaults were chosen)",
    )
    parser.add_argument("--seed", type=int, default=0)


class _NullStore:
    """A backing store that holds nothing: every key is new, dumps are dropped."""

    width = 0

    def load(self, keys):
        return np.zeros((keys.size, 0), np.float32), np.zeros(keys.size, bool)

    def dump(self, keys, rows):
        pass


def zipf_ranks(rng: np.random.Generator, n: int, universe: int, a: float) -> np.ndarray:
    """``n`` ranks in ``[0, universe)`` with P(r) ∝ (r + 1) ** -a."""
    cdf = np.cumsum(np.arange(1, universe + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), universe - 1)


def make_trace(
    kind: str, *, universe: int, batch: int, batches: int, a: float, drift: float, seed: int
) -> list[np.ndarray]:
    """A list of ``batches`` key arrays (``uint64``) of the given trace kind."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, universe + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    out = []
    for t in range(batches):
        ranks = np.minimum(np.searchsorted(cdf, rng.random(batch)), universe - 1)
        if kind == "drift":
            ids = (ranks - int(t * drift)) % universe  # a key's rank grows over time: it cools
        elif kind == "zipf":
            ids = ranks
        else:
            raise ValueError(f"unknown trace kind {kind!r}")
        out.append(mix64_array(ids.astype(np.uint64)))
    return out


def simulate(
    trace: list[np.ndarray],
    capacity: int,
    lru_fraction: float,
    aging: float | None,
    history: float | None = DEFAULT_HISTORY,
) -> dict:
    """Hit rate of MEM-PS with the given split, aging and history on ``trace``."""
    mem = MemPS(capacity, 0, _NullStore(), lru_fraction=lru_fraction, aging=aging, history=history)
    t0 = time.perf_counter()
    for t, keys in enumerate(trace):
        keys = np.unique(keys)
        rows, _ = mem.pull(t, keys)
        mem.write_back(t, keys, rows)  # the rows come back: none stays reserved for a load
        mem.unpin(t)
    s = mem.stats
    return {
        "hit_rate": s["hit_rate"],
        "hits": s["hits"],
        "accesses": s["hits"] + s["misses"],
        "seconds": time.perf_counter() - t0,
    }


def run(args: argparse.Namespace) -> dict:
    universe = max(1000, int(args.universe * args.size))
    batch = max(100, int(args.batch * args.size))
    capacity = max(200, int(args.capacity * args.size))
    aging = args.aging or None
    history = args.history or None
    report: dict = {
        "config": {
            "universe": universe,
            "batch": batch,
            "batches": args.batches,
            "capacity": capacity,
            "zipf": args.zipf,
            "drift_ranks_per_batch": args.drift * capacity,
            "lru_fraction": args.lru_fraction,
            "aging": aging,
            "history": history,
        },
    }
    policies = {  # name: (lru_fraction, aging, history)
        "lru_lfu": (args.lru_fraction, aging, history),
        "lru": (1.0, None, None),
        "lfu": (0.0, None, None),  # textbook LFU: counts of resident rows, no aging
        "lfu_aged": (0.0, aging, history),  # ablation: our LFU region alone, same estimator
    }
    for kind in ("zipf", "drift"):
        trace = make_trace(
            kind,
            universe=universe,
            batch=batch,
            batches=args.batches,
            a=args.zipf,
            drift=args.drift * capacity,
            seed=args.seed,
        )
        res = {name: simulate(trace, capacity, *p) for name, p in policies.items()}
        t0 = time.perf_counter()
        res["belady"] = belady_hit_rate(trace, capacity)
        res["belady"]["seconds"] = time.perf_counter() - t0
        if args.sweep:
            res["sweep"] = {
                f"lru_fraction={f:g},aging={ag or 0:g},history={h or 0:g}": simulate(
                    trace, capacity, f, ag or None, h or None
                )["hit_rate"]
                for h in (0, 4.0)
                for f in (0.0, 0.15, 0.25, 0.5)
                for ag in (0, 8.0, 16.0, 32.0)
            }
        best_single = max(res["lru"]["hit_rate"], res["lfu"]["hit_rate"])
        res["checks"] = {
            "lru_lfu_minus_best_single": res["lru_lfu"]["hit_rate"] - best_single,
            "lru_lfu_minus_lfu_aged": res["lru_lfu"]["hit_rate"] - res["lfu_aged"]["hit_rate"],
            "belady_minus_lru_lfu": res["belady"]["hit_rate"] - res["lru_lfu"]["hit_rate"],
            "ok": bool(
                res["lru_lfu"]["hit_rate"] >= best_single
                and res["belady"]["hit_rate"] - res["lru_lfu"]["hit_rate"] <= 0.10
            ),
        }
        report[kind] = res
    return report
