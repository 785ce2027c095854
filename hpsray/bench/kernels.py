"""``hpsray bench kernels``: hash-table throughput against a Python dict and the gather bound.

For each table size (default 1M and 10M keys, dim 16) it measures, in keys per second:
``find_or_insert`` into an empty table, ``find`` of random present keys, ``find`` followed by
``gather`` of the found rows, ``scatter_add``, and ``insert_or_assign``
of distinct present keys; and in the same run two baselines: lookups in
a Python ``dict`` holding the same keys, and the *gather bound*, numpy ``take`` of random rows
from an array as large as the table's arena (one random memory access per key: the memory
latency limit of this machine). Top-level keys carry the largest size's figures.

With ``--device cuda`` the timed keys and values are on the device already (as a trainer's are),
so the figures are the kernels' and not the PCIe copies'; the table is sized for its keys, so it
ends at bucket load 0.5 (HierarchicalKV's published "load 0.5" point).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numba
import numpy as np

from hpsray.kernels import make_table

HELP = "hash-table kernels (find, find_or_insert, scatter_add) vs a Python dict and the random-gather bound"


_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def key_count(text: str) -> int:
    """A key count as the help writes it: ``1000000``, ``1_000_000``, ``1M``, ``2.5M``, ``500k``."""
    t = text.strip().replace("_", "").lower()
    number, suffix = (t[:-1], t[-1]) if t and t[-1] in _SUFFIX else (t, "")
    try:
        value = float(number) * _SUFFIX[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a key count: {text!r} (write 1000000, 1M or 500k)") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"need a positive whole key count, got {text!r}")
    return int(value)


def key_counts(text: str) -> list[int]:
    """``--sizes``: comma-separated :func:`key_count` values."""
    counts = [key_count(s) for s in str(text).split(",") if s.strip()]
    if not counts:
        raise argparse.ArgumentTypeError(f"need at least one key count, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=key_counts,
        default="1M,10M",
        help="comma-separated key counts such as 1M,10M or 500k (default 1M,10M)",
    )
    parser.add_argument("--dim", type=int, default=16, help="row width in floats (default 16)")
    parser.add_argument("--queries", type=int, default=4_000_000, help="keys per timed call (default 4M)")
    parser.add_argument("--dict-queries", type=int, default=1_000_000, help="keys looked up in the dict baseline")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions; the best is reported")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="table backend")
    parser.add_argument("--seed", type=int, default=0)


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        from numba import cuda

        cuda.synchronize()


def _then_sync(device: str, _result: object) -> None:
    """``_sync`` after the call whose result is passed (a lambda's two steps, in order)."""
    _sync(device)


def measure(n: int, dim: int, queries: int, dict_queries: int, repeat: int, device: str, seed: int) -> dict:
    """All figures for one table size."""
    rng = np.random.default_rng(seed)
    keys = rng.choice(np.iinfo(np.int64).max, size=n, replace=False).astype(np.uint64)
    q = keys[rng.integers(0, n, queries)]
    values = rng.standard_normal((queries, dim)).astype(np.float32)

    # warm-up compiles the kernels outside the timings
    warm = make_table(64, dim, device=device)
    warm.find_or_insert(keys[:8])
    warm.gather(warm.find(keys[:8]))
    warm.scatter_add(keys[:8], values[:8])
    warm.insert_or_assign(keys[:8], values[:8])

    table = make_table(n, dim, device=device)
    t0 = time.perf_counter()
    table.find_or_insert(keys)
    _sync(device)
    insert_s = time.perf_counter() - t0

    distinct = keys[rng.permutation(n)[: min(queries, n)]]
    assign_values = values[: distinct.size]
    tq, tvalues, tdistinct, tassign = q, values, distinct, assign_values
    if device == "cuda":  # keys already on the device, as the trainer's are
        from numba import cuda

        tq, tvalues, tdistinct, tassign = (cuda.to_device(a) for a in (q, values, distinct, assign_values))
    find_s = _best(lambda: _then_sync(device, table.find(tq)), repeat)
    find_gather_s = _best(lambda: _then_sync(device, table.gather(table.find(tq))), repeat)
    scatter_s = _best(lambda: _then_sync(device, table.scatter_add(tq, tvalues)), repeat)
    assign_s = _best(lambda: _then_sync(device, table.insert_or_assign(tdistinct, tassign)), repeat)

    # baselines, same run
    # A written array: an untouched np.zeros arena maps every page to the kernel's shared zero
    # page, which stays in cache and would overstate the bound by ~2.5x.
    arena = np.full((n, dim), 1.0, dtype=np.float32)
    rows = rng.integers(0, n, queries)
    gather_s = _best(lambda: np.take(arena, rows, axis=0), repeat)
    arena = np.empty((0, dim), np.float32)  # free it (the lambda above is done with it)
    d = dict(zip(keys.tolist(), range(n)))
    dq = q[:dict_queries].tolist()
    dict_s = _best(lambda: [d[k] for k in dq], repeat)
    d = {}  # free it

    out = {
        "keys": n,
        "dim": dim,
        "queries": queries,
        "insert_keys_per_s": n / insert_s,
        "find_keys_per_s": queries / find_s,
        "find_gather_keys_per_s": queries / find_gather_s,
        "scatter_add_keys_per_s": queries / scatter_s,
        "insert_or_assign_keys_per_s": distinct.size / assign_s,
        "dict_find_keys_per_s": len(dq) / dict_s,
        "gather_bound_keys_per_s": queries / gather_s,
    }
    out["find_vs_dict"] = out["find_keys_per_s"] / out["dict_find_keys_per_s"]
    out["find_gather_vs_gather_bound"] = out["find_gather_keys_per_s"] / out["gather_bound_keys_per_s"]
    return out


def run(args: argparse.Namespace) -> dict:
    sizes = args.sizes if isinstance(args.sizes, list) else key_counts(str(args.sizes))
    by_size = {}
    for n in sizes:
        print(f"[bench kernels] {n:,} keys, dim {args.dim}, device {args.device} ...", file=sys.stderr, flush=True)
        by_size[str(n)] = measure(n, args.dim, args.queries, args.dict_queries, args.repeat, args.device, args.seed)
    largest = by_size[str(max(sizes))]
    return {
        "device": args.device,
        "threads": numba.get_num_threads(),
        **{k: v for k, v in largest.items() if k.endswith("per_s") or k.startswith(("find_vs", "find_gather_vs"))},
        "by_size": by_size,
    }
