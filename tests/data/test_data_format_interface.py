"""The Format interface: the registry, row counts (counted or estimated, and said so), and that
no code outside ``hpsray/data`` asks which format it has."""

import dataclasses
import pathlib
import re

import pytest

from hpsray.data import Schema
from hpsray.data.formats import Format, RowCount, format_names, format_of, get_format
from hpsray.data.readers import count_rows
from hpsray.pipelines.progress import format_line

ROOT = pathlib.Path(__file__).resolve().parents[2] / "hpsray"


def test_every_schema_format_has_one_format():
    assert {"criteo", "csv", "parquet"} <= set(format_names())
    for name in format_names():
        fmt = get_format(name)
        assert isinstance(fmt, Format) and fmt.name == name
    assert format_of(Schema.criteo()) is get_format("criteo")
    with pytest.raises(ValueError, match=r"schema\.format: must be one of criteo, csv, parquet"):
        Schema(format="xml")


def test_only_data_asks_which_format():
    """Outside ``hpsray/data``, code asks the schema's :class:`Format`, never compares its name."""
    asks = re.compile(r"\bformat\s*(==|!=)\s*[\"']|\bformat\s+(not\s+)?in\s*[(\[{]|\bis_text\b")
    found = []
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "data" and path.parent.parent == ROOT:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if asks.search(line):
                found.append(f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def _csv(path, rows, header=True):
    lines = (["click,price,user"] if header else []) + [f"{i % 2},{i}.5,u{i}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def test_text_count_is_exact_for_one_file_and_leaves_out_the_header(tmp_path):
    schema = Schema(format="csv", header=True, label="click", dense=("price",), categorical=("user",))
    _csv(tmp_path / "a.csv", 250)
    n = count_rows(str(tmp_path / "a.csv"), schema)
    assert (n.rows, n.exact, n.files) == (250, True, 1)


def test_text_count_of_several_files_is_an_estimate_from_bytes(tmp_path):
    schema = Schema(format="csv", header=True, label="click", dense=("price",), categorical=("user",))
    for k in range(4):
        _csv(tmp_path / f"{k}.csv", 1000)
    n = count_rows(str(tmp_path), schema)
    assert not n.exact and n.files == 4 and "bytes" in n.how
    assert abs(n.rows - 4000) <= 40, n


def test_parquet_count_is_exact_from_metadata(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(3):
        pq.write_table(pa.table({"click": [0, 1] * 50, "user": list(range(100))}), tmp_path / f"{k}.parquet")
    schema = Schema(format="parquet", label="click", categorical=("user",))
    n = count_rows(str(tmp_path), schema)
    assert n == RowCount(300, True, 3, n.bytes, "Parquet metadata") and n.bytes > 0


def test_progress_line_says_when_the_total_is_an_estimate():
    exact = format_line(2, 500, 1000, 100.0, 5.0, None, None)
    estimate = format_line(2, 500, 1000, 100.0, 5.0, None, None, exact=False)
    assert "examples 500/1,000 (50%)" in exact
    assert "examples 500/~1,000 (50%)" in estimate and "ETA 0:00:05" in estimate


def test_file_columns_are_the_header_or_the_parquet_schema(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hpsray.data import list_files

    _csv(tmp_path / "a.csv", 3)
    csv = Schema(format="csv", header=True, label="click", dense=("price",), categorical=("user",))
    (split,) = list_files(str(tmp_path / "a.csv"))
    assert format_of(csv).file_columns(split, csv) == ["click", "price", "user"]
    headerless = Schema(format="csv", label=0, dense=(1,), categorical=(2,))
    assert format_of(headerless).file_columns(split, headerless) is None
    pq.write_table(pa.table({"click": [0], "user": [7]}), tmp_path / "b.parquet")
    (split,) = list_files(str(tmp_path / "b.parquet"))
    schema = Schema(format="parquet", label="click", categorical=("user",))
    assert format_of(schema).file_columns(split, schema) == ["click", "user"]


def test_a_format_registered_from_outside_reads_through_every_reader(tmp_path, monkeypatch):
    """The extension point: a Format subclass and register() are all a new layout needs."""
    from hpsray.data import Batch, DataReader, register
    from hpsray.data import formats as F
    from hpsray.data.text import CSV

    class Semicolons(F.Format):  # CSV with ';' whatever the schema says
        name = "semicolons"

        def read(self, r):
            return CSV.read(
                F.SplitRead(r.split, dataclasses.replace(r.schema, format="csv", delimiter=";"), r.policy, r.report)
            )

        def splits(self, path, compression):
            return CSV.splits(path, compression)

        def count_rows(self, files, schema):
            return CSV.count_rows(files, schema)

    monkeypatch.setattr(F, "_registered", dict(F._registered))
    register(Semicolons())
    (tmp_path / "a.txt").write_text("click;user\n1;u1\n0;u2\n")
    schema = Schema(format="semicolons", header=True, label="click", categorical=("user",))
    batch = Batch.concat(list(DataReader(str(tmp_path / "a.txt"), schema)))
    assert batch.labels.tolist() == [1, 0] and count_rows(str(tmp_path / "a.txt"), schema).rows == 2
