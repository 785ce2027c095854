"""``[[tables]]`` in a job file: each entry checked and named, column names resolved through the
schema, a three-table job trained by ``hpsray train --reference`` and by the pipeline."""

import json

import numpy as np
import pytest

from hpsray.__main__ import main
from hpsray.data import PlantedCTR, write_synthetic
from hpsray.errors import ConfigError
from hpsray.export.read import load_export
from hpsray.job import JobConfig

SYNTHETIC = {"rows": 600, "eval_rows": 200, "slots": 4, "nnz": 7, "keys": 100, "dense": 3}
THREE = [
    {"name": "small", "slots": [0, 2], "dim": 4},
    {"name": "lists", "slots": [1], "dim": 16, "pooling": "mean"},
    {"name": "ids", "slots": [3], "dim": 8, "optimizer": "adam", "lr": 0.002},
]


def job_dict(tables=THREE, **extra):
    return {
        "data": {"synthetic": SYNTHETIC},
        "model": {"dim": 4, "hidden": [8]},
        "pipeline": {"batch_size": 200, "minibatch_size": 50},
        "cluster": {"nodes": 1},
        "tables": tables,
        **extra,
    }


def error_of(d):
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(d, where="job.toml")
    return str(e.value)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dim": 0}, "job.toml: tables[1].dim: must be a positive integer, got 0"),
        ({"pooling": "max"}, "job.toml: tables[1].pooling: must be one of sum, mean, got 'max'"),
        ({"optimizer": "rmsprop"}, "job.toml: tables[1].optimizer: must be one of"),
        ({"lr": 0}, "job.toml: tables[1].lr: must be"),
        ({"pooling_mode": "mean"}, "job.toml: tables[1].pooling_mode: unknown key (did you mean 'pooling'?"),
        ({"slots": [1, 1]}, "job.toml: tables[1].slots: table 'lists': names a slot twice"),
        ({"slots": [1, 2]}, "job.toml: tables[1].slots: table 'lists': slot 2 is in table 'small' already"),
        ({"slots": [1, 9]}, "job.toml: tables[1].slots: table 'lists': slot 9 is out of range [0, 4)"),
        ({"columns": ["C2"]}, "job.toml: tables[1].slots: give slots = [...] or columns = [...], one of them"),
        ({"sparse_params": {"beta9": 0.9}}, "job.toml: tables[1].sparse_params.beta9: not a parameter of the adagrad"),
        ({"admit_after": -2}, "job.toml: tables[1].admit_after: must be a non-negative integer"),
        ({"expire_after_batches": 0}, "job.toml: tables[1].expire_after_batches: must be a positive integer"),
    ],
)
def test_a_bad_entry_is_named_with_its_key(entry, message):
    tables = [THREE[0], {**THREE[1], **entry}, THREE[2]]
    assert error_of(job_dict(tables)).startswith(message)


def test_the_set_and_the_model_are_checked_too():
    assert error_of(job_dict(THREE[:2])).startswith("job.toml: tables: every slot must be in one table; slots [3]")
    assert error_of(job_dict([THREE[0], {**THREE[1], "name": "small"}, THREE[2]])).startswith(
        "job.toml: tables[1].name: 'small' names tables[0] already"
    )
    got = error_of(job_dict(model={"dim": 4, "kind": "dlrm"}))
    assert got.startswith("job.toml: model.kind: 'dlrm' needs one dim for every slot") and "lists (dim 16" in got
    assert error_of(job_dict([{**THREE[0], "slots": None, "columns": ["C1"]}] + THREE[1:])).startswith(
        "job.toml: tables[0].slots: must be"
    )
    assert error_of(job_dict(tables={"name": "x"})).startswith("job.toml: tables: must be [[tables]] entries")


def test_a_job_without_tables_keeps_its_one_default_table():
    d = job_dict()
    del d["tables"]
    job = JobConfig.from_dict(d, where="job.toml")
    assert job.tables == () and job.train_config().tables == ()
    assert job.train_config().tables_for(4).names() == ("default",)


def test_columns_name_slots_through_the_schema(tmp_path):
    gen = PlantedCTR(n_slots=4, keys_per_slot=50, nnz_per_slot=PlantedCTR.spread_nnz(4, 7), n_dense=2, seed=1)
    write_synthetic(str(tmp_path / "data"), gen, 100, "parquet")
    tables = [
        {"name": "small", "columns": ["C1", "C3"], "dim": 4},
        {"name": "lists", "columns": ["C2"], "dim": 16, "pooling": "mean"},
        {"name": "ids", "columns": ["C4"], "dim": 8, "optimizer": "adam", "lr": 0.002},
    ]
    d = {**job_dict(tables), "data": {"paths": [str(tmp_path / "data")]}}
    job = JobConfig.from_dict(d, where="job.toml")
    assert [s.slots for s in job.tables] == [(0, 2), (1,), (3,)]
    assert job.to_dict()["tables"][1]["pooling"] == "mean"
    d["tables"] = [{**tables[0], "columns": ["C1", "user"]}, *tables[1:]]
    assert error_of(d).startswith("job.toml: tables[0].columns: ['user'] are not categorical columns")


def test_hpsray_train_reference_runs_a_three_table_job(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(
        """
[data.synthetic]
rows = 600
eval_rows = 200
slots = 4
nnz = 7
keys = 100
dense = 3

[model]
dim = 4
hidden = [8]

[pipeline]
batch_size = 200
minibatch_size = 50

[cluster]
nodes = 1

[[tables]]
name = "small"
slots = [0, 2]
dim = 4

[[tables]]
name = "lists"
slots = [1]
dim = 16
pooling = "mean"

[[tables]]
name = "ids"
slots = [3]
dim = 8
optimizer = "adam"
lr = 0.002
"""
    )
    assert main(["train", "--reference", str(path), "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["examples"] == 600 and report["batches"] == 3 and report["rows"] > 0
    assert report["eval_examples"] == 200 and report["config"]["tables"][1]["pooling"] == "mean"
    assert main(["train", "--reference", str(path), "--quiet", "--export", str(tmp_path / "out")]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["dim"], manifest["state_width"]) == (16, 16)  # the widest table's weights and state
    assert [t["dim"] for t in manifest["tables"]] == [4, 16, 8]


def equal_to_reference(job, export, capsys) -> tuple[dict, object]:
    """``hpsray train --reference JOB --export EXPORT``, then ``hpsray train JOB --compare
    EXPORT --tolerance 0``: the run report (equal, asserted) and the second command's output."""
    assert main(["train", "--reference", str(job), "--quiet", "--export", str(export)]) == 0
    capsys.readouterr()
    report = export.parent / f"{export.name}.json"
    code = main(["train", str(job), "--compare", str(export), "--tolerance", "0", "--report", str(report), "--no-plan"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:] + out.out[-3000:]
    data = json.loads(report.read_text())
    assert data["compare"]["equal"] and data["compare"]["max_abs_row_diff"] == 0.0
    return data, out


def test_hpsray_train_runs_tables_of_their_own_width_and_equals_the_reference_to_the_bit(tmp_path, capsys, ray_local):
    """The issue's three tables (dim-4 sum, dim-16 mean, dim-8 Adam) through ``hpsray train``:
    rows spilled to SSD-PS at each table's width, equal to ``--reference``'s export at tolerance 0;
    the export starts a job of the same tables (``init_from``), and that equals the reference too."""
    path = tmp_path / "job.toml"
    body = (
        "[data.synthetic]\nrows = 1200\neval_rows = 200\nslots = 4\nnnz = 7\nkeys = 400\ndense = 3\n\n"
        "[model]\ndim = 4\nhidden = [8]\n\n[tiers]\nmem_rows = 1100\n\n[tiers.ssd]\nrows_per_file = 128\n\n"
        "[pipeline]\nbatch_size = 200\nminibatch_size = 50\n\n[cluster]\nnodes = 1\n\n"
    )
    tables = "".join(
        f'[[tables]]\nname = "{t["name"]}"\nslots = {t["slots"]}\ndim = {t["dim"]}\n'
        + (f'pooling = "{t["pooling"]}"\n' if "pooling" in t else "")
        + (f'optimizer = "{t["optimizer"]}"\nlr = {t["lr"]}\n' if "optimizer" in t else "")
        + "\n"
        for t in THREE
    )
    path.write_text(body + tables)
    ref = tmp_path / "reference"
    data, out = equal_to_reference(path, ref, capsys)
    assert data["ssd"]["bytes_written"] > 0
    assert [t["row_bytes"] for t in data["tables"].values()] == [32, 128, 96]  # 4+4, 16+16, 8+16 floats
    again = tmp_path / "again.toml"
    again.write_text(path.read_text().replace("[tiers]\n", f'[tiers]\ninit_from = "{ref}"\n'))
    ref2 = tmp_path / "reference2"
    equal_to_reference(again, ref2, capsys)
    # the same job without the import is the first run: started from its rows, the rows differ
    (k1, r1, _), (k2, r2, _) = load_export(ref), load_export(ref2)
    o1, o2 = np.argsort(k1), np.argsort(k2)
    np.testing.assert_array_equal(k1[o1], k2[o2])
    assert not np.array_equal(r1[o1], r2[o2])


def test_hpsray_train_runs_tables_of_one_width_and_equals_the_reference_to_the_bit(tmp_path, capsys, ray_local):
    """A job of three tables at [model] dim (one averaged, one with its own lr) through
    ``hpsray train``: rows spilled to SSD-PS, equal to ``--reference``'s export at tolerance 0,
    and the report's per-table figures printed."""
    path = tmp_path / "job.toml"
    path.write_text(
        "[data.synthetic]\nrows = 1200\neval_rows = 200\nslots = 4\nnnz = 7\nkeys = 400\ndense = 3\n\n"
        "[model]\ndim = 4\nhidden = [8]\n\n[tiers]\nmem_rows = 1100\n\n[tiers.ssd]\nrows_per_file = 128\n\n"
        "[pipeline]\nbatch_size = 200\nminibatch_size = 50\n\n[cluster]\nnodes = 1\n\n"
        '[[tables]]\nname = "small"\nslots = [0, 2]\ndim = 4\n\n'
        '[[tables]]\nname = "lists"\nslots = [1]\ndim = 4\npooling = "mean"\n\n'
        '[[tables]]\nname = "ids"\nslots = [3]\ndim = 4\nlr = 0.2\n'
    )
    ref = tmp_path / "reference"
    data, out = equal_to_reference(path, ref, capsys)
    assert data["ssd"]["bytes_written"] > 0 and list(data["tables"]) == ["small", "lists", "ids"]
    assert "table ids: " in out.out
    # the export starts a job of the same tables (init_from): the pipeline equals the reference from it
    again = tmp_path / "again.toml"
    again.write_text(path.read_text().replace("[tiers]\n", f'[tiers]\ninit_from = "{ref}"\n'))
    ref2 = tmp_path / "reference2"
    equal_to_reference(again, ref2, capsys)
    # tables in another order tag the keys otherwise: refused before Ray, naming both lists
    swapped = tmp_path / "swapped.toml"
    text = again.read_text()
    swapped.write_text(
        text.replace('name = "lists"\nslots = [1]', 'name = "lists"\nslots = [3]').replace(
            'name = "ids"\nslots = [3]', 'name = "ids"\nslots = [1]'
        )
    )
    assert main(["train", str(swapped), "--no-plan", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "tiers.init_from" in err and "the keys' tags differ" in err and "['lists', [3], 4]" in err, err
