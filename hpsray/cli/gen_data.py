"""``hpsray gen-data``: write a synthetic click log drawn from a planted model.

Keys are Zipf-distributed per slot, labels come from a planted logistic model over the keys and
dense features (:class:`hpsray.data.PlantedCTR`), so a good trainer reaches a known AUC. The
files read back (with ``DIR/_schema.toml``) into exactly the batches ``PlantedCTR`` generates.
"""

from __future__ import annotations

import argparse
import sys
import time

HELP = "write a synthetic click log (Criteo TSV or Parquet) with Zipf keys and labels from a planted model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="output directory (local path or any pyarrow/fsspec URI)"
    )
    parser.add_argument("--rows", required=True, type=int, metavar="N", help="examples to write")
    parser.add_argument(
        "--format", default="criteo", choices=["criteo", "parquet"], help="file format (default criteo)"
    )
    parser.add_argument(
        "--keys", type=int, default=100_000, metavar="K", help="distinct keys per slot (default 100000)"
    )
    parser.add_argument("--slots", type=int, default=26, metavar="S", help="categorical slots (default 26)")
    parser.add_argument(
        "--nnz",
        type=int,
        default=None,
        metavar="M",
        help="keys (non-zeros) per example, spread over the slots; > S makes multi-hot slots (default S)",
    )
    parser.add_argument("--dense", type=int, default=13, metavar="D", help="dense features (default 13)")
    parser.add_argument(
        "--zipf", type=float, default=1.05, metavar="A", help="Zipf exponent of the key ranks (default 1.05)"
    )
    parser.add_argument("--seed", type=int, default=0, metavar="X", help="random seed (default 0)")
    parser.add_argument(
        "--shard-rows", type=int, default=1_000_000, metavar="R", help="rows per file (default 1000000)"
    )
    parser.add_argument(
        "--compression",
        default="none",
        choices=["none", "gzip", "zstd"],
        help="criteo: compress each file (.gz/.zst); parquet: the column codec (none = snappy)",
    )
    parser.add_argument("--row-group-rows", type=int, default=65536, help="Parquet rows per row group")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from hpsray.data import PlantedCTR, write_synthetic
    from hpsray.errors import DataError

    def fail(msg: str) -> int:
        print(f"hpsray gen-data: error: {msg}", file=sys.stderr)
        return 2

    if args.rows < 0:
        return fail(f"--rows must be >= 0, got {args.rows}")
    if args.slots < 1 or args.keys < 1 or args.dense < 0 or args.shard_rows < 1:
        return fail("--slots, --keys and --shard-rows must be >= 1 and --dense >= 0")
    nnz = args.slots if args.nnz is None else args.nnz
    try:
        gen = PlantedCTR(
            n_slots=args.slots,
            keys_per_slot=args.keys,
            nnz_per_slot=PlantedCTR.spread_nnz(args.slots, nnz),
            n_dense=args.dense,
            zipf_a=args.zipf,
            seed=args.seed,
        )
    except ValueError as e:
        return fail(str(e).replace("nnz=", "--nnz ").replace("slots=", "--slots "))

    started = time.perf_counter()
    last = [0.0]
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, path: str) -> None:
        now = time.perf_counter()
        if args.quiet or (now - last[0] < 1.0 and done < total):
            return
        last[0] = now
        rate = done / max(now - started, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        line = f"gen-data: {done:,}/{total:,} rows ({pct:.0f}%)  {rate:,.0f} rows/s  {path}"
        print(("\r" + line) if tty else line, end="" if tty and done < total else "\n", file=sys.stderr, flush=True)

    try:
        files = write_synthetic(
            args.out,
            gen,
            args.rows,
            args.format,
            shard_rows=args.shard_rows,
            compression=args.compression,
            row_group_rows=args.row_group_rows,
            progress=progress,
        )
    except (OSError, DataError, ValueError) as e:
        return fail(str(e))
    if not args.quiet:
        secs = time.perf_counter() - started
        print(
            f"wrote {args.rows:,} rows in {len(files)} file(s) to {args.out} in {secs:.1f}s "
            f"({gen.nnz_per_example} keys/example over {gen.n_slots} slots, {gen.n_dense} dense); "
            f"schema in {args.out.rstrip('/')}/_schema.toml",
            file=sys.stderr,
        )
    return 0
