"""Sources: local paths, globs, directories, gzip/zstd, fsspec-wrapped and S3 filesystems, sharding."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from hpsray.data import STRICT, Batch, DataReader, Schema, list_files, open_source, read_batches, resolve_filesystem
from hpsray.errors import DataError

SCHEMA = Schema.criteo(1, 2, dense_transform="none")


def criteo_lines(start: int, n: int) -> str:
    """Rows whose dense value is the row id and whose line lengths vary."""
    return "".join(f"{i % 2}\t{i}\t{i * 7919 % 100003:x}\t{'ab' * (i % 8)}\n" for i in range(start, start + n))


def ids(batches) -> list[int]:
    return [int(x) for b in batches for x in b.dense[:, 0]]


def zstd_bytes(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as z:
        z.write(data)
    return sink.getvalue().to_pybytes()


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "part-0.tsv").write_text(criteo_lines(0, 100))
    (tmp_path / "part-1.tsv.gz").write_bytes(gzip.compress(criteo_lines(100, 100).encode()))
    (tmp_path / "sub" / "part-2.tsv.zst").write_bytes(zstd_bytes(criteo_lines(200, 100).encode()))
    (tmp_path / "_schema.toml").write_text("[schema]\n")
    (tmp_path / ".hidden").write_text("junk\n")
    (tmp_path / "_tmp").mkdir()
    (tmp_path / "_tmp" / "x.tsv").write_text("junk\n")
    return tmp_path


def test_directory_glob_and_compression(tree):
    names = [os.path.relpath(s.uri, tree) for s in list_files(str(tree))]
    assert names == ["part-0.tsv", "part-1.tsv.gz", "sub/part-2.tsv.zst"]
    assert [os.path.basename(s.uri) for s in list_files(str(tree / "*.tsv*"))] == ["part-0.tsv", "part-1.tsv.gz"]
    assert [os.path.basename(s.uri) for s in list_files(str(tree / "**" / "*.zst"))] == ["part-2.tsv.zst"]
    assert [os.path.basename(s.uri) for s in list_files([str(tree / "sub"), str(tree / "part-0.tsv")])] == [
        "part-0.tsv",
        "part-2.tsv.zst",
    ]
    # gzip and zstd files decompress to the same rows as the plain text would be.
    assert ids(DataReader(str(tree), SCHEMA, batch_size=64, policy=STRICT)) == list(range(300))
    with pytest.raises(DataError, match="no files match"):
        list_files(str(tree / "*.parquet"))


def test_fsspec_memory_filesystem_wrapped_for_pyarrow():
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    root = "/hpsray-test-src"
    mem.pipe(f"{root}/a.tsv", criteo_lines(0, 50).encode())
    mem.pipe(f"{root}/b.tsv.gz", gzip.compress(criteo_lines(50, 50).encode()))
    try:
        # by URI (any fsspec protocol), by fsspec object, and by an explicitly wrapped one
        by_uri = DataReader(f"memory://{root}/*.tsv*", SCHEMA, policy=STRICT)
        assert isinstance(by_uri.splits[0].filesystem, pafs.PyFileSystem)
        assert by_uri.splits[0].uri.startswith("memory://")
        assert ids(by_uri) == list(range(100))
        assert ids(DataReader(root, SCHEMA, filesystem=mem, policy=STRICT)) == list(range(100))
        wrapped = pafs.PyFileSystem(pafs.FSSpecHandler(mem))
        assert ids(DataReader(f"{root}/a.tsv", SCHEMA, filesystem=wrapped, policy=STRICT)) == list(range(50))
        # byte-range splits work through the wrapper too
        parts = [
            ids(DataReader(f"memory://{root}/a.tsv", SCHEMA, reader_index=i, num_readers=3, split_bytes=300))
            for i in range(3)
        ]
        assert sorted(sum(parts, [])) == list(range(50))
    finally:
        mem.rm(root, recursive=True)


def test_webhdfs_and_hdfs_resolution():
    pytest.importorskip("fsspec")
    fs, path, prefix = resolve_filesystem("webhdfs://namenode:9870/logs/day=1/part-0.tsv")
    assert isinstance(fs, pafs.PyFileSystem) and path == "/logs/day=1/part-0.tsv"
    assert prefix + path == "webhdfs://namenode:9870/logs/day=1/part-0.tsv"
    try:
        pafs.HadoopFileSystem("default")
    except Exception:
        with pytest.raises(DataError, match="libhdfs"):
            resolve_filesystem("hdfs://namenode:8020/logs")


@pytest.mark.parametrize("num_readers", [1, 2, 3, 7])
def test_text_sharding_covers_every_line_once(tmp_path, num_readers):
    (tmp_path / "a.tsv").write_text(criteo_lines(0, 700))
    (tmp_path / "b.tsv").write_text(criteo_lines(700, 300))
    (tmp_path / "c.tsv.gz").write_bytes(gzip.compress(criteo_lines(1000, 200).encode()))
    shares = [open_source(str(tmp_path), i, num_readers, split_bytes=997) for i in range(num_readers)]
    assert shares == [open_source(str(tmp_path), i, num_readers, split_bytes=997) for i in range(num_readers)]
    assert sum(s.uri.endswith(".gz") for share in shares for s in share) == 1  # never split
    got = [ids(read_batches(share, SCHEMA, 100, STRICT)) for share in shares]
    union = sorted(sum(got, []))
    assert union == list(range(1200))  # union = the files, no overlap
    if num_readers > 1:
        assert all(g for g in got)  # every reader gets a share
        sizes = [sum(s.nbytes for s in share) for share in shares]
        assert max(sizes) - min(sizes) <= 997 + os.path.getsize(tmp_path / "c.tsv.gz")


def test_split_boundaries_on_line_edges(tmp_path):
    """Cut points that land exactly on, just before and just after a newline."""
    f = tmp_path / "x.tsv"
    text = criteo_lines(0, 40)
    f.write_text(text)
    size = len(text.encode())
    for split_bytes in range(5, 60, 3):
        splits = open_source(str(f), 0, 1, split_bytes=split_bytes)
        assert splits[0].start == 0 and splits[-1].end == size
        assert ids(read_batches(splits, SCHEMA, 7, STRICT)) == list(range(40))


def test_parquet_sharding_by_row_group(tmp_path):
    for k in range(2):
        rows = np.arange(k * 1000, (k + 1) * 1000)
        t = pa.table({"y": pa.array(rows % 2, pa.int8()), "i": pa.array(rows, pa.int64()), "c": pa.array(rows)})
        pq.write_table(t, tmp_path / f"p{k}.parquet", row_group_size=97)
    schema = Schema(format="parquet", label="y", dense=("i",), categorical=("c",))
    shares = [open_source(str(tmp_path), i, 4, format="parquet", split_bytes=2000) for i in range(4)]
    assert sum(len(s) for s in shares) > 2
    got = [ids(read_batches(share, schema, 128, STRICT)) for share in shares]
    assert all(got) and sorted(sum(got, [])) == list(range(2000))


def test_s3_against_local_server(tmp_path, monkeypatch):
    server_mod = pytest.importorskip("moto.server", reason="moto[server] not installed: no local S3 to test against")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        s3 = pafs.S3FileSystem(
            endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1", allow_bucket_creation=True
        )
        s3.create_dir("clicks")
        with s3.open_output_stream("clicks/day1/a.tsv", compression=None) as f:
            f.write(criteo_lines(0, 60).encode())
        with s3.open_output_stream("clicks/day1/b.tsv.gz", compression=None) as f:
            f.write(gzip.compress(criteo_lines(60, 40).encode()))
        uri = f"s3://clicks/day1/?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
        reader = DataReader(uri, SCHEMA, policy=STRICT)
        assert [s.uri for s in reader.splits] == ["s3://clicks/day1/a.tsv", "s3://clicks/day1/b.tsv.gz"]
        assert ids(reader) == list(range(100))
        halves = [
            ids(DataReader("clicks/day1/a.tsv", SCHEMA, filesystem=s3, reader_index=i, num_readers=2, split_bytes=500))
            for i in range(2)
        ]
        assert sorted(halves[0] + halves[1]) == list(range(60)) and halves[0] and halves[1]
    finally:
        server.stop()


def test_batches_span_files_and_are_exact(tmp_path):
    for k in range(3):
        (tmp_path / f"{k}.tsv").write_text(criteo_lines(k * 333, 333))
    batches = list(read_batches(list_files(str(tmp_path)), SCHEMA, 250, STRICT))
    assert [len(b) for b in batches] == [250, 250, 250, 249]
    assert ids(batches) == list(range(999))
    merged = Batch.concat(batches)
    merged.validate()


def test_header_csv_split_among_readers(tmp_path):
    f = tmp_path / "h.csv"
    rows = [f"{i % 2},{i},k{i}" if i != 1500 else "1,oops,k" for i in range(2000)]
    f.write_text("label,id,user\n" + "\n".join(rows) + "\n")
    schema = Schema(header=True, label="label", dense=("id",), categorical=("user",))
    report_lines, got = [], []
    for i in range(4):
        share = open_source(str(f), i, 4, split_bytes=4000)
        from hpsray.data import BadInputPolicy, BadInputReport

        rep = BadInputReport()
        got += ids(read_batches(share, schema, 300, BadInputPolicy(max_bad_fraction=0.01), rep))
        report_lines += rep.examples
    assert sorted(got) == [i for i in range(2000) if i != 1500]
    assert len(report_lines) == 1 and f"{f} line 1502: non_numeric_dense" in report_lines[0]
