"""The servable model without Ray: layout, point reads, cache, lookups, request parsing, predictions."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import numpy as np
import pytest
from conftest import N_DENSE, N_SLOTS, close, raw_examples

from hpsray.errors import BadRequest, ServingError
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.serving import Limits, LoadOptions, ServableModel, resolve_export
from hpsray.serving.cache import HotCache
from hpsray.serving.layout import BLOCK_BYTES, SEGMENT_BYTES, build_point_store, read_meta, row_stride
from hpsray.serving.lookup import MemoryLookup, TieredLookup, mem_rows_for
from hpsray.serving.pointstore import PointStore


@pytest.mark.parametrize("dim", [1, 2, 3, 4, 8, 12, 16, 24, 32, 33, 48, 64, 100, 128, 1000])
def test_row_stride_keeps_rows_inside_aligned_segments_and_blocks(dim):
    s = row_stride(dim)
    assert s >= 4 * dim and s % 16 == 0
    if s <= SEGMENT_BYTES:
        assert s & (s - 1) == 0 and SEGMENT_BYTES % s == 0  # whole rows per 128-byte segment
    else:
        assert s % SEGMENT_BYTES == 0  # a row spans whole segments
    starts = np.arange(0, 4 * BLOCK_BYTES, s)
    ends = starts + 4 * dim - 1
    assert np.all(starts // BLOCK_BYTES == ends // BLOCK_BYTES) or s > BLOCK_BYTES


def test_export_records_the_schema(exports):
    with open(os.path.join(exports["criteo"], "manifest.json")) as f:
        m = json.load(f)
    assert m["schema"]["format"] == "criteo"
    assert m["input"]["categorical"] == [f"c{i}" for i in range(1 + N_DENSE, 1 + N_DENSE + N_SLOTS)]
    assert m["input"]["encoding"] == "hex" and m["input"]["multi_hot_separator"] == ","
    with open(os.path.join(exports["parquet"], "manifest.json")) as f:
        m = json.load(f)
    assert m["input"]["dense"] == ["I1", "I2", "I3"] and m["input"]["categorical"][0] == "C1"


def test_point_store_reads_what_the_export_holds(exports, tmp_path):
    from hpsray.export import load_export

    d = str(tmp_path / "exp")
    shutil.copytree(exports["parquet"], d)
    keys, rows, dense = load_export(d)
    _ = dense
    path = build_point_store(d)
    assert build_point_store(d) == path  # kept, not rebuilt
    meta = read_meta(path)
    assert meta["rows"] == keys.size and os.path.getsize(os.path.join(path, "rows.f32")) % BLOCK_BYTES == 0
    store = PointStore(path)
    rng = np.random.default_rng(0)
    want = rng.choice(keys.size, 500)
    q = np.concatenate([keys[want], np.array([1, 2**63 + 5], np.uint64)])
    pos = store.find(q)
    assert np.array_equal(pos[:-2], want) and np.all(pos[-2:] == -1)
    out = np.full((500, 8), np.nan, np.float32)
    dst = rng.permutation(500)
    store.read_into(pos[:-2], out, dst)
    assert np.array_equal(out[dst], rows[want, :8])
    out2 = np.full((500, 8), np.nan, np.float32)
    store.pread_rows(pos[:-2], out2, dst)  # the same rows by one pread each
    assert np.array_equal(out2, out)
    with pytest.raises(ValueError, match="out of range"):
        store.read_into(np.array([keys.size]), out, np.array([0]))
    assert np.array_equal(store.read_all(), rows[:, :8])
    store.close()
    # a new export into the same directory replaces the store of the old one
    from hpsray.export import export, read_manifest

    m = read_manifest(d)
    trained_rows = rows.copy()
    trained_rows[:, :8] += 1.0
    export((keys, trained_rows, _), d, _config_of(m), n_slots=N_SLOTS, n_dense=N_DENSE)
    assert not os.path.exists(path)
    assert np.array_equal(PointStore(build_point_store(d)).read_all(), trained_rows[:, :8])


def _config_of(manifest: dict):
    from hpsray.config import TrainConfig

    o = manifest["optimizer"]
    return TrainConfig(
        dim=manifest["dim"],
        hidden=tuple(manifest["model"]["hidden"]),
        sparse_optimizer=o["sparse"],
        sparse_lr=o["sparse_lr"],
        seed=manifest["seed"],
        init_scale=manifest["init_scale"],
    )


def test_hot_cache_keeps_hot_rows_and_admits_by_frequency():
    c = HotCache(8, 2)
    keys = np.arange(100, 108, dtype=np.uint64)
    assert np.all(c.probe(keys) == -1)
    rows = np.arange(16, dtype=np.float32).reshape(8, 2)
    c.admit(keys, rows)
    slots = c.probe(keys)
    hit = slots >= 0
    out = np.zeros((8, 2), np.float32)
    c.gather(slots, out)
    assert np.array_equal(out[hit], rows[hit]) and hit.sum() >= 2
    for _ in range(5):
        c.probe(keys[hit])  # hot
    cold = np.arange(1000, 1008, dtype=np.uint64)
    assert c.admit(cold, np.ones((8, 2), np.float32)) == 0  # misses age the hot rows, do not evict them
    assert np.all(c.probe(keys[hit]) >= 0)
    taken = sum(c.admit(cold, np.ones((8, 2), np.float32)) for _ in range(8))  # a key that keeps coming gets in
    assert taken > 0
    assert HotCache(0, 2).probe(keys).tolist() == [-1] * 8


def test_tiered_lookup_equals_memory_lookup_with_initial_rows_for_unseen(exports):
    path = build_point_store(exports["parquet"])
    store = PointStore(path)
    init = RowInit(dim=8, scale=0.02, seed=3)
    mem = MemoryLookup(np.array(store.keys), store.read_all(), init)
    tiered = TieredLookup(PointStore(path), mem_rows_for(len(store), None, 0.05), init)
    rng = np.random.default_rng(1)
    unseen = np.array([7, 8, 9], np.uint64)
    for _ in range(6):
        q = np.unique(np.concatenate([rng.choice(np.asarray(store.keys), 800), unseen]))
        a, b = mem.rows(q), tiered.rows(q)
        assert np.array_equal(a, b)
    assert np.array_equal(mem.rows(unseen), initial_rows(unseen, 8, init))
    s = tiered.stats()
    assert s["hits"] > 0 and s["ssd_reads"] > 0 and s["unseen"] >= 3


@pytest.mark.parametrize("fmt,mem", [("parquet", None), ("parquet", 0.05), ("criteo", None), ("criteo", 0.05)])
def test_predictions_equal_the_reference_trainer(planted, trained, exports, fmt, mem):
    batch, examples = raw_examples(planted, 300, fmt=fmt)
    model = ServableModel.load(exports[fmt], LoadOptions(mem_fraction=mem))
    parsed = model.parser.parse_body(json.dumps({"examples": examples}).encode())
    assert np.array_equal(parsed.keys, batch.keys) and np.array_equal(parsed.offsets, batch.offsets)
    want = trained.predict(batch)
    for _ in range(2):  # cold, then warm cache
        assert close(model.predict(parsed), want)


def _parser(exports, **limits):
    return ServableModel.load(exports["criteo"], LoadOptions(limits=Limits(**limits))).parser


@pytest.mark.parametrize(
    "body,reason",
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"examples": [], "x": 1}', "unknown top-level"),
        (b'{"examples": {}}', "must be a list"),
        (b'{"examples": [3]}', "examples[0] must be an object"),
        (b'{"examples": [{"c1": NaN}]}', "not JSON"),
    ],
)
def test_bad_bodies_are_refused_with_their_reason(exports, body, reason):
    with pytest.raises(BadRequest, match=re.escape(reason)):
        _parser(exports).parse_body(body)


def test_bad_examples_are_refused_with_their_reason(planted, exports):
    _, examples = raw_examples(planted, 3, fmt="criteo")
    p = _parser(exports, max_examples=2, max_body_bytes=10_000)

    def refuse(exs, reason):
        with pytest.raises(BadRequest, match=reason):
            p.parse_examples(exs)

    refuse(examples, "3 examples exceed the limit of 2")
    with pytest.raises(BadRequest, match="exceeds the limit of 10000"):
        p.parse_body(b" " * 10_001)
    ex = dict(examples[0])
    refuse([{k: v for k, v in ex.items() if k != "c5"}], r"examples\[0\]: missing column\(s\) \['c5'\]")
    refuse([{**ex, "zz": 1}], r"unknown column\(s\) \['zz'\]")
    refuse([ex, {**ex, "c1": "abc"}], r"dense column 'c1' takes numbers.*examples\[1\] has 'abc'")
    refuse([{**ex, "c1": True}], "dense column 'c1' takes numbers")
    refuse([{**ex, "c4": 1.5}], "categorical column 'c4' takes a string, an integer or a list")
    refuse([{**ex, "c4": {"a": 1}}], "categorical column 'c4'")
    refuse([{**ex, "c4": "xyz"}], "categorical column 'c4' value 'xyz' is not a valid hex value")
    assert len(p.parse_examples([{**ex, "c1": None, "c5": None, "c6": ["1a", "7"], "c7": []}])) == 1
    refuse([{**ex, "c6": ["1a", 7]}], "mixed value types")


def test_nulls_lists_and_unseen_values_are_served(planted, trained, exports):
    """A null dense value is 0, a null/empty categorical has no key, any value never trained
    gets the trainer's initial row: the same as the reference trainer on the same keys."""
    model = ServableModel.load(exports["parquet"], LoadOptions(mem_rows=10))
    _, examples = raw_examples(planted, 2)
    ex = {**examples[0], "I2": None, "C1": None, "C3": [], "C5": [10**9, 2**62, 4], "C6": 2**64 - 1}
    batch = model.parser.parse_examples([ex, examples[1]])
    assert close(model.predict(batch), trained.predict(batch))
    assert batch.dense[0, 1] == 0.0 and not np.any(batch.slots[: batch.offsets[1]] == 0)


def test_resolve_export_picks_the_newest_complete_one(exports, tmp_path):
    root = tmp_path / "models"
    shutil.copytree(exports["parquet"], root / "v1")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ServingError, match="no export here"):
        resolve_export(tmp_path / "empty")
    time.sleep(0.01)
    shutil.copytree(exports["criteo"], root / "v2")
    os.utime(root / "v2" / "manifest.json")
    os.makedirs(root / "v3")  # an interrupted export: no manifest
    assert resolve_export(root) == str(root / "v2")
    assert resolve_export(root / "v1") == str(root / "v1")


def test_an_export_without_input_schema_is_a_clear_error(trained, tmp_path):
    from hpsray.export import export

    d = str(tmp_path / "noschema")
    export(trained.export(), d, trained.config, n_slots=N_SLOTS, n_dense=N_DENSE)
    with pytest.raises(ServingError, match="no 'input' entry"):
        ServableModel.load(d)


@pytest.mark.parametrize("transform", ["none", "log1p"])
def test_integer_fast_path_equals_the_converter(transform):
    """Single integers in every categorical column skip the converter; the batch is bit-equal."""
    from hpsray.serving import InputSpec, RequestParser

    spec = InputSpec(dense=("a", "b"), categorical=("x", "y", "z"), dense_transform=transform)
    rng = np.random.default_rng(5)
    examples = [
        {
            "a": float(rng.standard_normal()),
            "b": int(rng.integers(-5, 50)),
            "x": int(rng.integers(0, 1000)),
            "y": int(rng.integers(-(2**63), 2**63 - 1)),
            "z": 2**64 - 1 - i,
        }
        for i in range(300)
    ]
    fast, slow = RequestParser(spec), RequestParser(spec)
    slow.fast = False
    a, b = fast.parse_examples(examples), slow.parse_examples(examples)
    for f in ("keys", "offsets", "slots", "dense", "labels"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    with_null = [dict(examples[0], x=None), *examples[1:3]]  # not all single integers: the converter
    a, b = fast.parse_examples(with_null), slow.parse_examples(with_null)
    assert np.array_equal(a.keys, b.keys) and a.nnz == 3 * 3 - 1


def _census_cases():
    """``(name, examples, vector path taken)`` over a spec of 2 dense, 3 categorical columns."""
    rng = np.random.default_rng(7)
    base = [
        {
            "a": float(rng.standard_normal()),
            "b": int(rng.integers(-5, 50)),
            "x": int(rng.integers(0, 1000)),
            "y": int(rng.integers(-(2**63), 2**63 - 1)),
            "z": int(rng.integers(0, 2**40)),
        }
        for _ in range(200)
    ]
    return [
        ("numbers and integers", base, True),
        ("dense integers only", [dict(e, a=int(e["b"]) * 3) for e in base], True),
        ("a dense integer past 2**53", [dict(base[0], b=2**60 + 1), *base[1:5]], False),
        ("a categorical integer past int64", [dict(base[0], z=2**64 - 1), *base[1:5]], False),
        ("a string categorical", [dict(base[0], x="17"), *base[1:5]], False),
        ("a null dense", [dict(base[0], a=None), *base[1:5]], False),
        ("an empty list", [dict(base[0], y=[]), *base[1:5]], False),
        ("a bool dense", [dict(base[0], a=True), *base[1:5]], False),
        ("a bool categorical", [dict(base[0], x=False), *base[1:5]], False),
        ("a float categorical", [dict(base[0], x=2.5), *base[1:5]], False),
        ("a dense float past float32", [dict(base[0], a=1e39), *base[1:5]], False),
        ("a column missing", [{k: v for k, v in base[0].items() if k != "z"}, *base[1:5]], False),
        ("a column renamed", [{**{k: v for k, v in base[0].items() if k != "z"}, "w": 1}, *base[1:5]], False),
        ("an example that is a list", [list(base[0].values()), *base[1:5]], False),
    ]


@pytest.mark.parametrize("transform", ["none", "log1p"])
@pytest.mark.parametrize("case", range(len(_census_cases())), ids=[c[0] for c in _census_cases()])
def test_vector_path_equals_the_converter_or_steps_aside(transform, case):
    """Requests of single numbers skip per-column conversion; anything else (nulls, strings, bools,
    lists, integers past int64, wrong columns) takes the checked path: the batch is bit-equal to
    the one the parser made before the vector path existed (per-column pyarrow arrays, then the
    integer path or the converter), or the same 400 reason comes back."""
    from hpsray.serving import InputSpec, RequestParser

    name, examples, vector = _census_cases()[case]
    spec = InputSpec(dense=("a", "b"), categorical=("x", "y", "z"), dense_transform=transform)
    fast, slow = RequestParser(spec), RequestParser(spec)
    slow.vector = False
    assert (fast._vector_batch(examples) is not None) == vector, name
    try:
        want = slow.parse_examples(examples)
    except BadRequest as e:
        with pytest.raises(BadRequest) as got:
            fast.parse_examples(examples)
        assert str(got.value) == str(e)
        return
    got = fast.parse_examples(examples)
    for f in ("keys", "offsets", "slots", "dense", "labels"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    assert got.n_slots == want.n_slots


def test_a_dense_integer_the_converter_cannot_cast_is_a_400():
    """The converter casts int64 to float32 safely and refuses integers past 2**24 (ArrowInvalid);
    on the checked path that is a 400 naming the value, not a failed model."""
    from hpsray.serving import InputSpec, RequestParser

    p = RequestParser(InputSpec(dense=("a",), categorical=("x",)))
    with pytest.raises(BadRequest, match="16777216"):
        p.parse_examples([{"a": 2**30, "x": None}])


def test_vector_path_with_one_column_of_each_kind():
    from hpsray.serving import InputSpec, RequestParser

    for spec in (InputSpec(dense=("a",), categorical=("x",)), InputSpec(dense=(), categorical=("x", "y"))):
        examples = [{c: i + j for j, c in enumerate(spec.columns)} for i in range(20)]
        fast, slow = RequestParser(spec), RequestParser(spec)
        slow.fast = False  # the converter
        assert fast._vector_batch(examples) is not None
        a, b = fast.parse_examples(examples), slow.parse_examples(examples)
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.dense, b.dense)
        assert a.dense.shape == (20, len(spec.dense))
