"""Bad input (docs/architecture.md: invariant 8): every kind, strict (error naming file, line,
reason) and lenient (counted)."""

from __future__ import annotations

import gzip
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpsray.data import LENIENT, STRICT, BadInputPolicy, BadInputReport, Schema, list_files, open_source, read_batches
from hpsray.data import bad_input as E
from hpsray.errors import DataError, TooMuchBadInput

SCHEMA = Schema.criteo(2, 2, dense_transform="none")
LOOSE = BadInputPolicy(mode="lenient", max_bad_fraction=1.0, max_examples=10_000)


def good(i: int) -> str:
    return f"{i % 2}\t{i}\t0.5\t{i:x}\tab"


BAD_LINES = {
    E.WRONG_COLUMN_COUNT: ["1\t2\t3\t4", "1\t2\t3\t4\t5\t6"],
    E.NON_NUMERIC_DENSE: ["1\tabc\t0\t1\t2", "0\t1\tnan\t1\t2", "0\t1\t1e999\t1\t2"],
    E.INVALID_LABEL: ["x\t1\t0\t1\t2", "2\t1\t0\t1\t2", "\t1\t0\t1\t2", "-1\t1\t0\t1\t2"],
    E.INVALID_CATEGORICAL: ["1\t1\t0\tzz\t2", "1\t1\t0\t1\t12345678901234567"],
    E.EMPTY_LINE: [""],
}


def read(paths, schema=SCHEMA, policy=LENIENT, batch_size=100, **kw):
    report = BadInputReport()
    splits = list_files(paths) if not isinstance(paths, list) or isinstance(paths[0], str) else paths
    batches = list(read_batches(splits, schema, batch_size, policy, report, **kw))
    ids = [int(x) for b in batches for x in b.dense[:, 0]]
    return ids, report


def lines_in(report: BadInputReport) -> list[int]:
    return [int(m.group(1)) for m in (re.search(r" line (\d+):", e) for e in report.examples) if m]


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_each_bad_row_kind_strict_and_lenient(tmp_path, reason):
    for k, bad in enumerate(BAD_LINES[reason]):
        f = tmp_path / f"{reason}-{k}.tsv"
        f.write_text("\n".join([good(0), good(1), bad, good(3)]) + "\n")
        with pytest.raises(DataError) as err:
            read(str(f), policy=STRICT)
        assert err.value.reason == reason and err.value.line == 3 and err.value.file == str(f)
        assert str(err.value).startswith(f"{f} line 3: {reason}")
        ids, report = read(str(f), policy=LOOSE)
        assert ids == [0, 1, 3]
        assert report.counts == {reason: 1} and report.rows_bad == 1 and report.rows_ok == 3
        assert lines_in(report) == [3]


def test_line_numbers_across_blocks_header_and_splits(tmp_path):
    """Many blocks, malformed rows of every kind at random lines: each is named by its true line."""
    rng = np.random.default_rng(0)
    kinds = [(r, line) for r, ls in BAD_LINES.items() for line in ls]
    text, bad_at, good_ids = ["I1\tI2\tC1\tC2\tlabel_is_first"], {}, []
    for lineno in range(2, 2000):
        if rng.random() < 0.05:
            reason, line = kinds[rng.integers(len(kinds))]
            text.append(line)
            bad_at[lineno] = reason
        else:
            text.append(good(lineno))
            good_ids.append(lineno)
    f = tmp_path / "x.tsv"
    f.write_text("\n".join(text) + "\n")
    schema = Schema(
        format="csv",
        delimiter="\t",
        quote_char="",
        label=0,
        dense=(1, 2),
        categorical=(3, 4),
        encoding="hex",
        n_columns=5,
    )
    # with a header line the file-level line numbers are unchanged; skip it by treating it as bad
    for num_readers in (1, 3):
        ids, reports = [], []
        for i in range(num_readers):
            r_ids, rep = read(open_source(str(f), i, num_readers, split_bytes=6000), schema, LOOSE, block_size=700)
            ids += r_ids
            reports.append(rep)
        total = reports[0]
        for rep in reports[1:]:
            total = total.merge(rep, max_examples=10_000)
        assert sorted(ids) == good_ids
        found = {}
        for e in total.examples:
            m = re.search(r" line (\d+): (\w+)", e)
            found[int(m.group(1))] = m.group(2)
        assert found == {1: E.INVALID_LABEL, **bad_at}
        assert total.rows_bad == len(bad_at) + 1 and total.rows_ok == len(good_ids)
    # a real header: line numbers still count it
    hdr = tmp_path / "h.csv"
    hdr.write_text("y,a,b\n1,2,c\n1,x,d\n")
    with pytest.raises(DataError, match=r"h\.csv line 3: non_numeric_dense: dense column 'a' value 'x'"):
        read(str(hdr), Schema(header=True, label="y", dense=("a",), categorical=("b",)), STRICT)


def truncated(data: bytes, codec: str) -> bytes:
    if codec == "gzip":
        full = gzip.compress(data)
    else:
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as z:
            z.write(data)
        full = sink.getvalue().to_pybytes()
    return full[: len(full) * 2 // 3]


@pytest.mark.parametrize("codec,ext", [("gzip", "gz"), ("zstd", "zst")])
def test_truncated_compressed_file(tmp_path, codec, ext):
    tiny = tmp_path / "tiny" / f"t.tsv.{ext}"
    tiny.parent.mkdir()
    tiny.write_bytes(truncated(b"1\t2\t3\t4\t5\n" * 3, codec))
    with pytest.raises(DataError, match="truncated_file"):
        read(str(tiny), policy=STRICT)
    rows = "\n".join(good(i) for i in range(20000)) + "\n"
    f = tmp_path / f"t.tsv.{ext}"
    f.write_bytes(truncated(rows.encode(), codec))
    (tmp_path / "ok.tsv").write_text(good(7) + "\n")
    with pytest.raises(DataError) as err:
        read(str(f), policy=STRICT, block_size=1 << 14)
    assert err.value.reason == E.TRUNCATED_FILE and err.value.file == str(f)
    both = [str(tmp_path / "ok.tsv"), str(f)]
    ids, report = read(both, policy=BadInputPolicy(max_bad_fraction=0.5), block_size=1 << 14)
    assert report.counts == {E.TRUNCATED_FILE: 1} and report.files_bad == 1 and report.files_ok == 1
    # the rows before the cut are kept (nothing already read is lost), in order
    assert ids[0] == 7 and len(ids) > 1000 and ids[1:] == list(range(len(ids) - 1))
    with pytest.raises(TooMuchBadInput, match="1 of 2 files bad"):
        read(both, policy=LENIENT, block_size=1 << 14)


def test_empty_files(tmp_path):
    (tmp_path / "a.tsv").write_bytes(b"")
    (tmp_path / "b.tsv.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "c.tsv").write_text(good(1) + "\n")
    for name in ("a.tsv", "b.tsv.gz"):
        with pytest.raises(DataError, match=f"{name}: empty_file"):
            read(str(tmp_path / name), policy=STRICT)
    ids, report = read(str(tmp_path), policy=BadInputPolicy(max_bad_fraction=0.9))
    assert ids == [1] and report.counts == {E.EMPTY_FILE: 2} and report.files_bad == 2
    h = tmp_path / "h.csv"
    h.write_text("y,a,b\n")
    with pytest.raises(DataError, match="h.csv: empty_file: no rows"):
        read(str(h), Schema(header=True, label="y", dense=("a",), categorical=("b",)), STRICT)
    p = tmp_path / "e.parquet"
    p.write_bytes(b"")
    with pytest.raises(DataError, match="e.parquet: empty_file"):
        read(str(p), Schema(format="parquet", label="y"), STRICT)


def test_unreadable_path(tmp_path):
    (tmp_path / "ok.tsv").write_text(good(3) + "\n")
    missing = str(tmp_path / "missing.tsv")
    with pytest.raises(DataError) as err:
        read([missing], policy=STRICT)
    assert err.value.reason == E.UNREADABLE_PATH and err.value.file == missing
    ids, report = read([str(tmp_path / "ok.tsv"), missing], policy=BadInputPolicy(max_bad_fraction=0.5))
    assert ids == [3] and report.counts == {E.UNREADABLE_PATH: 1}
    assert any(missing in e for e in report.examples)
    with pytest.raises(DataError, match="unreadable_path: no files match"):
        list_files(str(tmp_path / "nope-*.tsv"))


def test_missing_columns_and_corrupt_parquet(tmp_path):
    c = tmp_path / "c.csv"
    c.write_text("y,a\n1,2\n")
    with pytest.raises(DataError, match="c.csv: missing_column: column 'b' not in the file's columns"):
        read(str(c), Schema(header=True, label="y", dense=("a",), categorical=("b",)), STRICT)
    t = pa.table(
        {"y": pa.array([1.0, 0.0, 3.0, None]), "a": pa.array(["1", "x", "2", "3"]), "b": pa.array([1, 2, 3, 4])}
    )
    p = tmp_path / "p.parquet"
    pq.write_table(t, p, row_group_size=2)
    schema = Schema(format="parquet", label="y", dense=("a",), categorical=("b",))
    with pytest.raises(DataError) as err:
        read(str(p), schema, STRICT)
    assert (err.value.reason, err.value.row) == (E.NON_NUMERIC_DENSE, 2)
    ids, report = read(str(p), schema, LOOSE)
    assert ids == [1] and report.counts == {E.NON_NUMERIC_DENSE: 1, E.INVALID_LABEL: 2}
    assert [re.search(r" row (\d+)", e).group(1) for e in report.examples] == ["2", "3", "4"]
    with pytest.raises(DataError, match="missing_column"):
        read(str(p), Schema(format="parquet", label="y", dense=("zz",)), STRICT)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(p.read_bytes()[:-20])
    with pytest.raises(DataError, match="cut.parquet: corrupt_file"):
        read(str(cut), schema, STRICT)
    _, report = read(str(cut), schema, LOOSE)
    assert report.counts == {E.CORRUPT_FILE: 1}


def test_bad_fraction_limit_and_report(tmp_path):
    rows = [good(i) if i % 10 else "oops" for i in range(1, 3001)]
    f = tmp_path / "x.tsv"
    f.write_text("\n".join(rows) + "\n")
    with pytest.raises(TooMuchBadInput) as err:
        read(str(f), policy=BadInputPolicy(max_bad_fraction=0.05, min_rows=1000))
    assert "wrong_column_count" in str(err.value)
    ids, report = read(str(f), policy=BadInputPolicy(max_bad_fraction=0.2, max_examples=5))
    assert len(ids) == 2700 and report.rows_bad == 300 and report.counts == {E.WRONG_COLUMN_COUNT: 300}
    assert len(report.examples) == 5 and report.bad_fraction == pytest.approx(0.1)
    assert "wrong_column_count=300" in report.summary()
    assert report.to_dict()["counts"] == {E.WRONG_COLUMN_COUNT: 300}


def test_policy_from_dict_errors():
    assert BadInputPolicy.from_dict({"mode": "strict", "max_bad_fraction": 0.1}).strict
    with pytest.raises(ValueError, match=r"data.bad_input.mode: must be 'strict' or 'lenient'"):
        BadInputPolicy.from_dict({"mode": "loose"}, where="data.bad_input")
    with pytest.raises(ValueError, match=r"bad_input.max_bad: unknown key"):
        BadInputPolicy.from_dict({"max_bad": 0.1})
    with pytest.raises(ValueError, match=r"bad_input.max_bad_fraction: must lie in \[0, 1\]"):
        BadInputPolicy.from_dict({"max_bad_fraction": 2})


def test_data_error_pickles():
    import pickle

    e = pickle.loads(pickle.dumps(DataError("f.tsv", "invalid_label", "label 'x'", line=4)))
    assert (e.file, e.reason, e.line, str(e)) == ("f.tsv", "invalid_label", 4, "f.tsv line 4: invalid_label: label 'x'")
