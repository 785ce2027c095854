"""``hpsray bench ingest``: parsing speed of the readers against pyarrow's own CSV reader.

Generates a planted Criteo-like data set (TSV and Parquet) in a temporary directory, then on one
core (pyarrow's CPU pool set to 1 thread) measures, on the same files in the same run:

- ``rows_per_s``: ``read_batches`` over the Criteo TSV, including hex parsing, key hashing and
  CSR assembly, into ``Batch`` es;
- ``pyarrow_csv_rows_per_s``: ``pyarrow.csv.read_csv`` of the same file (type inference, no
  hashing), the baseline; ``ratio_vs_pyarrow_csv`` = the two divided (target >= 0.5);
- ``parquet_rows_per_s`` and ``pyarrow_parquet_rows_per_s``: the same for the Parquet copy.

Each figure is the best of ``--repeats`` runs, timed in process CPU time (all threads of the
process; with one pyarrow thread that is one core's work, and unlike wall time it does not
count what other processes on a shared machine take); ``wall`` holds the same figures in wall
time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

HELP = "rows/s parsing Criteo TSV and Parquet into batches (with hashing) vs pyarrow's own CSV reader"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rows", "--size", dest="rows", type=int, default=500_000, help="rows to generate (default 500k)"
    )
    parser.add_argument("--slots", type=int, default=26, help="categorical slots (default 26, as Criteo)")
    parser.add_argument("--dense", type=int, default=13, help="dense features (default 13, as Criteo)")
    parser.add_argument("--keys", type=int, default=1_000_000, help="distinct keys per slot")
    parser.add_argument("--batch", type=int, default=65536, help="rows per batch")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the best counts")
    parser.add_argument("--dir", default=None, help="where to write the data (default: a temporary directory)")


def _best(fn: Callable[[], int], repeats: int) -> tuple[float, float, int]:
    """(best CPU seconds, best wall seconds, rows) over ``repeats`` runs of ``fn``."""
    cpu, wall, rows = float("inf"), float("inf"), 0
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        rows = fn()
        cpu = min(cpu, time.process_time() - c)
        wall = min(wall, time.perf_counter() - t)
    return cpu, wall, rows


def run(args: argparse.Namespace) -> dict:
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from hpsray.data import PlantedCTR, read_batches, write_synthetic
    from hpsray.data.generate import dataset_schema
    from hpsray.data.sources import list_files

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    gen = PlantedCTR(n_slots=args.slots, keys_per_slot=args.keys, n_dense=args.dense, seed=0)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hpsray-ingest-") as tmp:
        tsv_dir, pq_dir = os.path.join(tmp, "criteo"), os.path.join(tmp, "parquet")
        t = time.perf_counter()
        write_synthetic(tsv_dir, gen, args.rows, "criteo", shard_rows=args.rows)
        write_synthetic(pq_dir, gen, args.rows, "parquet", shard_rows=args.rows)
        gen_s = time.perf_counter() - t
        tsv = os.path.join(tsv_dir, "part-00000.tsv")
        pqf = os.path.join(pq_dir, "part-00000.parquet")
        tsv_splits, pq_splits = list_files(tsv), list_files(pqf)
        tsv_schema, pq_schema = dataset_schema(gen, "criteo"), dataset_schema(gen, "parquet")

        def ours(splits, schema):
            return lambda: sum(len(b) for b in read_batches(splits, schema, args.batch))

        def pyarrow_csv():
            return pcsv.read_csv(
                tsv,
                read_options=pcsv.ReadOptions(use_threads=False, autogenerate_column_names=True),
                parse_options=pcsv.ParseOptions(delimiter="\t"),
            ).num_rows

        def pyarrow_parquet():
            return pq.read_table(pqf, use_threads=False).num_rows

        ours(tsv_splits, tsv_schema)()  # compile the numba kernels outside the timing
        base_s, base_w, base_rows = _best(pyarrow_csv, args.repeats)
        tsv_s, tsv_w, tsv_rows = _best(ours(tsv_splits, tsv_schema), args.repeats)
        pqb_s, pqb_w, _ = _best(pyarrow_parquet, args.repeats)
        pq_s, pq_w, pq_rows = _best(ours(pq_splits, pq_schema), args.repeats)
        if tsv_rows != args.rows or pq_rows != args.rows or base_rows != args.rows:
            raise RuntimeError(f"row count mismatch: {tsv_rows}, {pq_rows}, {base_rows} != {args.rows}")
        tsv_bytes = os.path.getsize(tsv)

    rows = args.rows
    return {
        "rows": rows,
        "slots": args.slots,
        "dense": args.dense,
        "tsv_bytes_per_row": tsv_bytes / max(rows, 1),
        "threads": 1,
        "rows_per_s": rows / tsv_s,
        "pyarrow_csv_rows_per_s": rows / base_s,
        "ratio_vs_pyarrow_csv": base_s / tsv_s,
        "tsv_mb_per_s": tsv_bytes / tsv_s / 1e6,
        "parquet_rows_per_s": rows / pq_s,
        "pyarrow_parquet_rows_per_s": rows / pqb_s,
        "parquet_ratio_vs_pyarrow_csv": base_s / pq_s,
        "target_ratio": 0.5,
        "timing": f"process CPU time, best of {args.repeats}",
        "wall": {
            "rows_per_s": rows / tsv_w,
            "pyarrow_csv_rows_per_s": rows / base_w,
            "ratio_vs_pyarrow_csv": base_w / tsv_w,
            "parquet_rows_per_s": rows / pq_w,
            "pyarrow_parquet_rows_per_s": rows / pqb_w,
        },
        "generate_seconds": gen_s,
    }
