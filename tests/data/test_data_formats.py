"""Formats: Criteo TSV, CSV/TSV with a declared schema, Parquet; keys; the gen-data round trip."""

from __future__ import annotations

import argparse
import importlib
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpsray.__main__ import SUBCOMMANDS
from hpsray.bench import BENCHMARKS
from hpsray.data import (
    STRICT,
    Batch,
    DataReader,
    PlantedCTR,
    Schema,
    hash_keys,
    hash_strings,
    list_files,
    load_dataset,
    read_batches,
    write_synthetic,
)


def run_cli(module_name: str, argv: list[str]):
    """Parse ``argv`` with one command module and run it (without importing unrelated commands)."""
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


def main(argv: list[str]) -> int:
    assert SUBCOMMANDS["gen-data"] == "hpsray.cli.gen_data"
    return run_cli(SUBCOMMANDS[argv[0]], argv[1:])


def read_all(path, schema, batch_size=1000, **kw) -> Batch:
    batches = list(DataReader(str(path), schema, batch_size=batch_size, policy=STRICT, **kw))
    return Batch.concat(batches)


def keys_of(b: Batch, i: int) -> list[tuple[int, int]]:
    lo, hi = b.offsets[i], b.offsets[i + 1]
    return list(zip(b.slots[lo:hi].tolist(), b.keys[lo:hi].tolist()))


def test_criteo_values_missing_and_log1p(tmp_path):
    f = tmp_path / "day_0"
    n_dense, n_cat = 3, 4
    lines = [
        "1\t5\t\t-2\t68fd1e64\t\t05db9164\tff",  # missing I2 -> 0, missing C2 -> no key, I3 < 0
        "0\t0\t1\t2\t\t\t\t",  # no categorical keys at all
    ]
    f.write_text("\n".join(lines) + "\n")
    raw = read_all(f, Schema.criteo(n_dense, n_cat, dense_transform="none"))
    assert raw.labels.tolist() == [1.0, 0.0]
    assert raw.dense.tolist() == [[5, 0, -2], [0, 1, 2]]
    assert keys_of(raw, 0) == [
        (0, int(hash_keys(0, np.array([0x68FD1E64]))[0])),
        (2, int(hash_keys(2, np.array([0x05DB9164]))[0])),
        (3, int(hash_keys(3, np.array([0xFF]))[0])),
    ]
    assert keys_of(raw, 1) == []
    logged = read_all(f, Schema.criteo(n_dense, n_cat))  # log1p is the Criteo default
    np.testing.assert_allclose(logged.dense, [[math.log1p(5), 0, 0], [0, math.log1p(1), math.log1p(2)]], rtol=1e-6)


def test_keys_differ_across_slots(tmp_path):
    f = tmp_path / "same.tsv"
    f.write_text("1\t" + "\t".join(["abc"] * 5) + "\n")
    b = read_all(f, Schema.criteo(0, 5))
    assert b.nnz == 5 and len(set(b.keys.tolist())) == 5
    assert b.slots.tolist() == [0, 1, 2, 3, 4]


def test_csv_with_schema_header_quotes_multi_hot(tmp_path):
    f = tmp_path / "clicks.csv"
    f.write_text('id,click,price,user,tags,age\n7,1,2.5,alice,"sports|news",31\n8,0,,bob,,\n9,1,1e3,"a,b",news,-4\n')
    schema = Schema.from_dict(
        {
            "format": "csv",
            "header": True,
            "label": "click",
            "dense": ["price", "age"],
            "categorical": ["user", "tags"],
            "multi_hot_separator": "|",
        }
    )
    b = read_all(f, schema)
    assert b.labels.tolist() == [1, 0, 1]
    assert b.dense.tolist() == [[2.5, 31], [0, 0], [1000, -4]]
    user = hash_strings(["alice", "bob", "a,b"])
    tags = hash_strings(["sports", "news"])
    assert keys_of(b, 0) == [
        (0, int(hash_keys(0, user[:1])[0])),
        (1, int(hash_keys(1, tags[:1])[0])),
        (1, int(hash_keys(1, tags[1:])[0])),
    ]
    assert keys_of(b, 1) == [(0, int(hash_keys(0, user[1:2])[0]))]
    assert keys_of(b, 2) == [(0, int(hash_keys(0, user[2:])[0])), (1, int(hash_keys(1, tags[1:])[0]))]


def test_tsv_headerless_by_index_and_int_encoding(tmp_path):
    f = tmp_path / "x.tsv"
    f.write_text("a\t1\t0.5\t42\nb\t0\t-1\t-7\n")
    schema = Schema(format="csv", delimiter="\t", label=1, dense=(2,), categorical=(3, 0), encoding="int", n_columns=4)
    with pytest.raises(Exception, match="invalid_categorical"):
        read_all(f, schema)  # column 0 holds letters, not integers
    schema = Schema(format="csv", delimiter="\t", label=1, dense=(2,), categorical=(3,), encoding="int", n_columns=4)
    b = read_all(f, schema)
    assert b.keys.tolist() == hash_keys(0, np.array([42, -7], dtype=np.int64).astype(np.uint64)).tolist()


def test_parquet_ints_strings_lists_and_nulls(tmp_path):
    f = tmp_path / "p.parquet"
    table = pa.table(
        {
            "y": pa.array([1, 0, 1], pa.int8()),
            "d0": pa.array([0.5, None, 2.0], pa.float64()),
            "d1": pa.array([1, 2, 3], pa.int32()),
            "ad": pa.array([10, None, 12], pa.int64()),
            "site": pa.array(["x", "y", None]),
            "hist": pa.array([[1, 2, 3], None, []], pa.list_(pa.int64())),
            "words": pa.array([["a", None], ["b"], None], pa.list_(pa.string())),
        }
    )
    pq.write_table(table, f, row_group_size=2)
    schema = Schema(format="parquet", label="y", dense=("d0", "d1"), categorical=("ad", "site", "hist", "words"))
    b = read_all(f, schema)
    assert b.labels.tolist() == [1, 0, 1]
    assert b.dense.tolist() == [[0.5, 1], [0, 2], [2, 3]]
    k = lambda s, v: int(hash_keys(s, np.asarray(v, dtype=np.uint64)))  # noqa: E731
    h = lambda s: int(hash_strings([s])[0])  # noqa: E731
    assert keys_of(b, 0) == [
        (0, k(0, 10)),
        (1, k(1, h("x"))),
        (2, k(2, 1)),
        (2, k(2, 2)),
        (2, k(2, 3)),
        (3, k(3, h("a"))),
    ]
    assert keys_of(b, 1) == [(1, k(1, h("y"))), (3, k(3, h("b")))]
    assert keys_of(b, 2) == [(0, k(0, 12))]


@pytest.mark.parametrize(
    "fmt,nnz,compression",
    [
        ("criteo", 1, "none"),
        ("criteo", (1, 3, 2), "gzip"),
        ("criteo", 2, "zstd"),
        ("parquet", (2, 1, 1), "none"),
        ("parquet", 1, "zstd"),
    ],
)
def test_gen_data_reads_back_exactly(tmp_path, fmt, nnz, compression):
    gen = PlantedCTR(n_slots=3, keys_per_slot=5000, nnz_per_slot=nnz, n_dense=4, seed=11)
    rows = 12_000  # spans two generator blocks and three shards
    files = write_synthetic(
        str(tmp_path), gen, rows, fmt, shard_rows=5000, compression=compression, row_group_rows=3000
    )
    assert len(files) == 3
    schema, gen2 = load_dataset(str(tmp_path))
    assert repr(gen2) == repr(gen)
    got = read_all(tmp_path, schema, batch_size=4096)
    want = gen.generate(rows)
    for name in ("labels", "dense", "keys", "offsets", "slots"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.n_slots == want.n_slots


def test_gen_data_cli_and_batch_sizes(tmp_path, capsys):
    out = tmp_path / "d"
    rc = main(
        [
            "gen-data",
            "--out",
            str(out),
            "--rows",
            "3000",
            "--format",
            "criteo",
            "--keys",
            "100",
            "--slots",
            "4",
            "--nnz",
            "6",
            "--dense",
            "2",
            "--seed",
            "5",
            "--shard-rows",
            "1000",
        ]
    )
    assert rc == 0
    assert "3,000/3,000 rows" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [
        "_schema.toml",
        "part-00000.tsv",
        "part-00001.tsv",
        "part-00002.tsv",
    ]
    schema, gen = load_dataset(str(out))
    assert gen.nnz_per_slot == (2, 2, 1, 1) and schema.multi_hot_separator == ","
    batches = list(read_batches(list_files(str(out)), schema, batch_size=700))
    assert [len(b) for b in batches] == [700] * 4 + [200]
    want = gen.generate(3000)
    np.testing.assert_array_equal(Batch.concat(batches).keys, want.keys)
    assert main(["gen-data", "--out", str(out), "--rows", "10", "--slots", "4", "--nnz", "2"]) == 2
    assert "--nnz" in capsys.readouterr().err


def test_bench_ingest_smoke():
    import json

    report = run_cli(BENCHMARKS["ingest"], ["--rows", "3000", "--repeats", "1", "--keys", "100"])
    json.dumps(report)
    for key in ("rows_per_s", "pyarrow_csv_rows_per_s", "parquet_rows_per_s", "ratio_vs_pyarrow_csv"):
        assert report[key] > 0
