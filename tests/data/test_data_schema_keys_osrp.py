"""Schema declaration, categorical value → key encoding, and the OP+OSRP transform."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import tomllib

from hpsray.data import OPOSRP, Batch, PlantedCTR, Schema, hash_keys, hash_strings
from hpsray.data.categorical import encode_column, encode_single_columns
from hpsray.data.generate import to_toml
from hpsray.kernels.hashing import mix64_array

# -- schema -------------------------------------------------------------------------------------


def test_schema_from_toml_and_back():
    doc = tomllib.loads(
        """
        [data.schema]
        format = "csv"
        header = true
        delimiter = ";"
        quote_char = ""
        label = "click"
        dense = ["price", "age"]
        categorical = ["user", "tags"]
        multi_hot_separator = "|"
        encoding = "string"
        dense_transform = "log1p"
        """
    )
    s = Schema.from_dict(doc["data"]["schema"], where="data.schema")
    assert (s.label, s.dense, s.categorical, s.n_slots, s.n_dense) == (
        "click",
        ("price", "age"),
        ("user", "tags"),
        2,
        2,
    )
    assert Schema.from_dict(tomllib.loads(to_toml({"s": s.to_dict()}))["s"]) == s
    c = Schema.from_dict({"format": "criteo", "n_categorical": 30, "dense_transform": "none"})
    assert c == Schema.criteo(13, 30, dense_transform="none") and c.expected_columns() == 44
    assert Schema.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    "d,message",
    [
        ({"format": "json"}, "data.schema.format: must be one of criteo, csv, parquet"),
        ({"labl": 0}, "data.schema.labl: unknown key"),
        ({"dense": "a"}, "data.schema.dense: must be a list"),
        ({"label": 0, "dense": [1, 0]}, r"data.schema.dense\[1\]: column 0 is already used as label"),
        ({"label": "y"}, "data.schema.label: column 'y' is not named in schema.columns"),
        (
            {"label": 0, "categorical": [5], "n_columns": 3},
            r"categorical\[0\]: column index 5 is outside the 3 columns",
        ),
        ({"delimiter": "ab"}, "data.schema.delimiter: must be a single one-byte character"),
        ({"encoding": "md5"}, "data.schema.encoding: must be one of string, hex, int"),
        ({"format": "criteo", "label": 1}, "data.schema.label: not allowed with format = 'criteo'"),
        ({"format": "criteo", "n_dense": -1}, "data.schema.n_dense: must be a non-negative integer"),
        ({"multi_hot_separator": ","}, "data.schema.multi_hot_separator: must differ from the delimiter"),
        ({"label": True}, "data.schema.label: must be a column name or 0-based index"),
    ],
)
def test_schema_errors_name_the_key(d, message):
    with pytest.raises(ValueError, match=message):
        Schema.from_dict(d, where="data.schema")


# -- keys ---------------------------------------------------------------------------------------


def test_encodings_match_hash_keys():
    vals = np.array([0, 1, 0x68FD1E64, 2**64 - 1], dtype=np.uint64)
    hexes = pa.array([format(int(v), "x") for v in vals] + ["0X1F", " 7 ", None, ""])
    keys, counts, bad = encode_column(hexes, 4, "hex")
    want = hash_keys(4, np.concatenate([vals, np.array([0x1F, 7], np.uint64)]))
    assert keys.tolist() == want.tolist() and counts.tolist() == [1] * 6 + [0, 0] and not bad.any()
    ints = pa.array(["-1", "18446744073709551615", "18446744073709551616", "12a", "+5"])
    keys, counts, bad = encode_column(ints, 2, "int")
    assert bad.tolist() == [False, False, True, True, False]
    assert keys.tolist() == hash_keys(2, np.array([2**64 - 1, 2**64 - 1, 5], np.uint64)).tolist()
    # an int64 Parquet column and its text give the same key
    k_int, _, _ = encode_column(pa.array([-1, 5], pa.int64()), 2)
    assert k_int.tolist() == hash_keys(2, np.array([2**64 - 1, 5], np.uint64)).tolist()


def test_string_hash_and_fast_path_agree_with_general_path():
    rng = np.random.default_rng(1)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(1, 30))) for _ in range(500)]
    cols = [pa.array([w if (i + s) % 7 else None for i, w in enumerate(words)]) for s in range(3)]
    keys, offsets, slots, bad = encode_single_columns(cols, "string")
    per_col = [encode_column(c, s) for s, c in enumerate(cols)]
    ex = np.repeat(np.arange(500), np.diff(offsets))
    for s, (k, counts, _) in enumerate(per_col):
        assert keys[slots == s].tolist() == k.tolist()
        assert np.bincount(ex[slots == s], minlength=500).tolist() == counts.tolist()
    h = hash_strings(words)
    assert len(set(h.tolist())) == len(set(words))
    assert per_col[0][0][:3].tolist() == hash_keys(0, h[1:4]).tolist()  # row 0 of slot 0 is null
    # sliced arrays (non-zero Arrow offset) read the right values
    k_sliced, _, _ = encode_column(cols[1].slice(10, 20), 1)
    assert k_sliced.tolist() == encode_column(pa.array(cols[1].to_pylist()[10:30]), 1)[0].tolist()


def test_hex_raw_values_give_planted_keys():
    gen = PlantedCTR(n_slots=3, keys_per_slot=70000, seed=4)
    batch, ranks = gen.raw_block(0)
    text = pa.array([format(int(r), "x") for r in ranks[batch.slots == 1]])
    keys, _, _ = encode_column(text, 1, "hex")
    assert keys.tolist() == batch.keys[batch.slots == 1].tolist()


# -- OP+OSRP ------------------------------------------------------------------------------------


def test_op_osrp_shape_sparsity_and_definition():
    gen = PlantedCTR(n_slots=20, keys_per_slot=5000, nnz_per_slot=tuple([1] * 10 + [15] * 10), n_dense=3, seed=2)
    batch = gen.generate(2000)
    k = 128
    t = OPOSRP(k=k, seed=9)
    out = t(batch)
    assert isinstance(out, Batch) and len(out) == len(batch) and out.n_slots == 1
    assert out.labels is batch.labels and out.dense is batch.dense
    per_example = np.diff(out.offsets)
    assert per_example.max() <= k and per_example.min() >= 1
    feature_of = {int(key): f for f, key in enumerate(t.feature_keys())}
    assert set(out.keys.tolist()) <= set(feature_of) and len(set(out.keys.tolist())) <= 2 * k
    # an independent numpy evaluation of the definition for a few examples
    seed = np.array([9], np.uint64)
    from hpsray.data import osrp

    bin_seed = mix64_array(seed ^ osrp._BIN_SALT)[0]
    sign_seed = mix64_array(seed ^ osrp._SIGN_SALT)[0]
    for i in (0, 1, 777, 1999):
        keys = batch.keys[batch.offsets[i] : batch.offsets[i + 1]]
        bins = (mix64_array(keys ^ bin_seed) % np.uint64(k)).astype(np.int64)
        signs = np.where(mix64_array(keys ^ sign_seed) >> np.uint64(63) == 0, 1, -1)
        sums = np.bincount(bins, weights=signs, minlength=k)
        nonempty = np.flatnonzero(np.bincount(bins, minlength=k))
        want = sorted(2 * b + int(sums[b] > 0) for b in nonempty)
        got = sorted(feature_of[int(x)] for x in out.keys[out.offsets[i] : out.offsets[i + 1]])
        assert got == want
    # more bins -> more non-zeros; same seed -> same output; grouped slots
    assert np.diff(OPOSRP(k=1024)(batch).offsets).mean() > per_example.mean()
    np.testing.assert_array_equal(t(batch).keys, out.keys)
    grouped = OPOSRP(k=k, out_slots=8, seed=9)(batch)
    assert grouped.n_slots == 8 and set(np.unique(grouped.slots).tolist()) == set(range(8))
    with pytest.raises(ValueError, match="osrp.k: must be a positive integer"):
        OPOSRP.from_dict({"k": 0})
    with pytest.raises(ValueError, match="data.transform.bins: unknown key"):
        OPOSRP.from_dict({"bins": 3}, where="data.transform")
