"""The JSON-lines format: read exactly as the same table in Parquet, bad lines named by file and
line, split among readers, counted, and trained end to end through the pipeline."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpsray.data import STRICT, BadInputPolicy, BadInputReport, Batch, DataReader, Schema, list_files
from hpsray.data.readers import count_rows, read_split
from hpsray.errors import DataError

LENIENT = BadInputPolicy(mode="lenient", max_bad_fraction=0.5)
SCHEMA = Schema(format="jsonl", label="y", dense=("price",), categorical=("user", "site", "tags"))
PQ_SCHEMA = Schema(format="parquet", label="y", dense=("price",), categorical=("user", "site", "tags"))


def _table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "y": rng.integers(0, 2, n),
            "price": np.round(rng.random(n), 3),
            "user": rng.integers(0, 500, n),
            "site": [None if i % 7 == 0 else f"s{i % 13}" for i in range(n)],
            "tags": [[int(t) for t in rng.integers(0, 40, i % 3)] for i in range(n)],
        }
    )


def _write(path, rows: list[dict], extra: dict[int, str] | None = None) -> None:
    lines = [json.dumps({k: v for k, v in r.items() if v is not None}) for r in rows]
    for at, text in sorted((extra or {}).items()):
        lines.insert(at, text)
    path.write_text("\n".join(lines) + "\n")


def _read(path, schema=SCHEMA, policy=STRICT, **kw) -> tuple[Batch, BadInputReport]:
    reader = DataReader(str(path), schema, batch_size=100_000, policy=policy, **kw)
    return Batch.concat(list(reader)), reader.report


def _same(a: Batch, b: Batch) -> None:
    for field in ("labels", "dense", "keys", "offsets", "slots"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_reads_exactly_what_parquet_reads(tmp_path):
    table = _table(3000)
    pq.write_table(table, tmp_path / "t.parquet")
    _write(tmp_path / "t.jsonl", table.to_pylist())
    want, _ = _read(tmp_path / "t.parquet", PQ_SCHEMA)
    got, report = _read(tmp_path / "t.jsonl", block_size=4096)  # many blocks
    _same(got, want)
    assert (report.rows_ok, report.rows_bad, report.files_ok) == (3000, 0, 1)


def test_a_bad_line_is_named_by_file_and_line(tmp_path):
    rows = _table(50).to_pylist()
    path = tmp_path / "clicks.jsonl"
    _write(path, rows, {9: '{"y": 1, "price": 0.5, "user": 3', 20: "[1, 2]"})  # lines 10 and 21
    with pytest.raises(DataError, match=r"clicks\.jsonl.*line 10.*invalid_json"):
        _read(path)
    got, report = _read(path, policy=LENIENT)
    assert (report.rows_ok, report.rows_bad, report.counts) == (50, 2, {"invalid_json": 2})
    assert "line 10" in report.examples[0] and "line 21" in report.examples[1]
    _write(tmp_path / "good.jsonl", rows)
    want, _ = _read(tmp_path / "good.jsonl")
    _same(got, want)


def test_a_value_of_another_type_and_a_bad_label_are_bad_rows(tmp_path):
    rows = [{"y": i % 2, "price": 1.0, "user": i, "site": "a", "tags": [1]} for i in range(10)]
    rows[4]["user"] = "not-an-int"  # line 5: the column's values are numbers
    rows[7]["y"] = 3  # line 8: a label outside [0, 1]
    path = tmp_path / "mixed.jsonl"
    _write(path, rows)
    got, report = _read(path, policy=LENIENT)
    assert (report.rows_ok, report.rows_bad) == (8, 2)
    assert report.counts == {"invalid_categorical": 1, "invalid_label": 1}
    assert "line 5" in report.examples[0] and "'user'" in report.examples[0]
    assert "line 8" in report.examples[1]
    assert len(got) == 8 and got.labels.tolist() == [r["y"] for i, r in enumerate(rows) if i not in (4, 7)]


def test_categorical_integers_keep_all_64_bits_and_a_float_is_refused(tmp_path):
    """pyarrow's JSON reader would read 2**64 - 5 as a double (a wrong key, silently)."""
    from hpsray.data import hash_keys

    big = [2**64 - 5, 2**63 + 11, 7]
    rows = [{"y": 1, "price": 0.0, "user": u, "site": "a", "tags": []} for u in big]
    _write(tmp_path / "big.jsonl", rows + [dict(rows[0], user=1.5)])  # line 4
    got, report = _read(tmp_path / "big.jsonl", policy=LENIENT)
    want = hash_keys(np.zeros(3, np.int32), np.array(big, np.uint64))
    np.testing.assert_array_equal(got.keys[got.slots == 0], want)
    assert report.counts == {"invalid_categorical": 1} and "line 4" in report.examples[0]


def test_a_misspelled_column_is_a_missing_column(tmp_path):
    path = tmp_path / "a.jsonl"
    _write(path, [{"y": 1, "price": 1.0, "usr": 3, "site": "a", "tags": []}])
    with pytest.raises(DataError, match=r"missing_column.*'user'"):
        _read(path)


def test_positions_are_refused():
    with pytest.raises(ValueError, match=r"schema\.label: a JSON-lines column is named"):
        Schema(format="jsonl", label=0, categorical=("user",))


@pytest.mark.parametrize("readers", [2, 5])
def test_readers_share_the_lines_once_each_with_true_line_numbers(tmp_path, readers):
    rows = _table(2000, seed=3).to_pylist()
    path = tmp_path / "big.jsonl"
    _write(path, rows, {1500: "not json"})  # line 1501
    whole, _ = _read(path, policy=LENIENT)
    splits = []
    for i in range(readers):
        splits += DataReader(str(path), SCHEMA, reader_index=i, num_readers=readers, split_bytes=20_000).splits
    assert len(splits) > readers
    report = BadInputReport()
    parts = [b for sp in sorted(splits, key=lambda sp: sp.start) for b in read_split(sp, SCHEMA, LENIENT, report)]
    _same(Batch.concat(parts), whole)
    bad = report.examples
    assert len(bad) == 1 and "line 1501" in bad[0], bad


def test_gzip_and_counting(tmp_path):
    import gzip

    rows = _table(400).to_pylist()
    _write(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress((tmp_path / "a.jsonl").read_bytes()))
    plain, _ = _read(tmp_path / "a.jsonl")
    packed, _ = _read(tmp_path / "b.jsonl.gz")
    _same(packed, plain)
    (split,) = list_files(str(tmp_path / "b.jsonl.gz"))
    assert not DataReader(str(tmp_path / "b.jsonl.gz"), SCHEMA, split_bytes=64).splits[0].start
    n = count_rows(str(tmp_path / "a.jsonl"), SCHEMA)
    assert (n.rows, n.exact) == (400, True)
    both = count_rows(str(tmp_path), SCHEMA)
    assert not both.exact and both.files == 2


@pytest.mark.slow
def test_trains_end_to_end_as_the_reference(ray_local, tmp_path):
    from hpsray.pipelines import FileSource
    from hpsray.reference import ReferenceTrainer

    from small_pipeline import small_config, small_pipeline  # tests/small_pipeline.py

    _write(tmp_path / "train.jsonl", _table(1000, seed=5).to_pylist())
    cfg = small_config(minibatch_size=250)
    source = FileSource(str(tmp_path / "train.jsonl"), SCHEMA, policy=STRICT)
    with small_pipeline(source, cfg, mem_rows=2000, batch_size=500) as p:
        p.fit(progress=False)
        keys, rows = p.export_rows()
    ref = ReferenceTrainer(3, 1, cfg)
    ref.fit(list(FileSource(str(tmp_path / "train.jsonl"), SCHEMA).open(500)))
    ref_keys, ref_rows, _ = ref.export()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
