"""The first hour of a new user (issue 48): fast help, a plan without Ray, job-file mistakes named
before anything starts, and the help's own notations accepted. Real subprocesses where the
user's command is the thing under test."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hpsray.errors import ConfigError
from hpsray.job import JobConfig

HEAVY = ("torch", "numba", "ray")


def python(code, timeout=120, **env):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("words", [[], ["bench"]])
def test_help_imports_no_command_dependencies(words):
    """``hpsray --help`` and ``hpsray bench --help`` list the commands and benchmarks without
    importing torch, numba or Ray (seconds on a busy machine: the issue measured 1.6-12 s)."""
    code = f"""
        import sys
        from hpsray.__main__ import build_parser
        text = build_parser({words!r}).format_help() if not {words!r} else None
        if {words!r}:
            p = build_parser({words!r})
            sub = next(a for a in p._actions if isinstance(a, __import__('argparse')._SubParsersAction))
            text = sub.choices['bench'].format_help()
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        print(text)
    """
    out = python(code)
    heavy, text = out.split("\n", 1)
    assert heavy == "[]"
    if words:  # every benchmark with its one-line help, read from its module's source
        from hpsray.bench import BENCHMARKS

        assert all(name in text for name in BENCHMARKS) and "hash-table kernels" in text
    else:
        assert "train" in text and "plan" in text


def test_bench_help_strings_are_the_modules_own():
    import importlib

    from hpsray.bench import BENCHMARKS
    from hpsray.cli.bench import help_of

    for module_name in BENCHMARKS.values():
        assert help_of(module_name) == importlib.import_module(module_name).HELP


def test_bench_kernels_sizes_take_the_helps_notation():
    from hpsray.__main__ import build_parser
    from hpsray.bench.kernels import key_count

    assert [key_count(s) for s in ("1M", "10M", "500k", "2.5M", "1_000_000", "1000")] == [
        10**6,
        10**7,
        500_000,
        2_500_000,
        10**6,
        1000,
    ]
    args = build_parser(["bench", "kernels"]).parse_args(["bench", "kernels", "--sizes", "1M,20k"])
    assert args.sizes == [10**6, 20_000]
    assert build_parser(["bench", "kernels"]).parse_args(["bench", "kernels"]).sizes == [10**6, 10**7]
    for bad in ("1X", "0", "1.5", "-2k"):
        with pytest.raises(argparse.ArgumentTypeError):
            key_count(bad)


def write_csv(path, rows=400, header="click,price,user,ad"):
    with open(path, "w") as f:
        f.write(header + "\n")
        for i in range(rows):
            f.write(f"{i % 2},{i % 7}.5,u{i % 31},a{i % 11}\n")
    return path


def csv_job(tmp_path, mode="lenient", label="click", paths='["clicks.csv"]', extra=""):
    write_csv(tmp_path / "clicks.csv")
    job = tmp_path / f"job-{mode}.toml"
    job.write_text(
        textwrap.dedent(f"""
        [data]
        paths = {paths}
        [data.bad_input]
        mode = "{mode}"
        [data.schema]
        format = "csv"
        header = true
        label = "{label}"
        dense = ["price"]
        categorical = ["user", "ad"]
        [model]
        dim = 4
        hidden = [8]
        [pipeline]
        batch_size = 100
        minibatch_size = 50
        """)
        + extra
    )
    return job


def test_a_misspelled_key_gets_a_suggestion():
    for table, expect in (
        ({"data": {"synthetic": {"rows": 10}}, "pipeline": {"batch_sise": 5}}, "did you mean 'batch_size'?"),
        ({"data": {"synthetic": {"rows": 10}}, "modle": {}}, "did you mean 'model'?"),
        ({"data": {"paths": ["x.csv"], "schema": {"format": "csv", "lable": "y"}}}, "did you mean 'label'?"),
    ):
        with pytest.raises(ConfigError, match="unknown key") as e:
            JobConfig.from_dict(table, where="job.toml")
        assert expect in str(e.value)
    with pytest.raises(ConfigError) as e:  # nothing close: no guess
        JobConfig.from_dict({"data": {"synthetic": {"rows": 10}}, "pipeline": {"zzz": 5}}, where="job.toml")
    assert "did you mean" not in str(e.value)


def test_train_reports_a_job_file_mistake_before_importing_ray(tmp_path):
    job = csv_job(tmp_path, extra="bogus_key = 1\n")
    code = f"""
        import sys
        from hpsray.__main__ import main
        code = main(["train", {str(job)!r}])
        print(code, "ray" in sys.modules)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert "pipeline.bogus_key: unknown key" in out.stderr


@pytest.mark.parametrize("mode", ["lenient", "strict"])
def test_a_missing_column_or_path_is_a_configuration_error_naming_it(tmp_path, mode):
    """Not ``too_much_bad_input: 1 of 1 files bad``: the job's mistake, with file and column."""
    from hpsray.job.inputs import check_inputs

    job = JobConfig.load(csv_job(tmp_path, mode, label="clik"))
    with pytest.raises(ConfigError) as e:
        check_inputs(job)
    message = str(e.value)
    assert "data.schema.label" in message and "'clik'" in message and "clicks.csv" in message
    assert "did you mean 'click'?" in message
    job = JobConfig.load(csv_job(tmp_path, mode, paths='["clicks.csv", "nope.csv"]'))
    with pytest.raises(ConfigError, match=r"data.paths: .*nope.csv: no such file or directory"):
        check_inputs(job)
    check_inputs(JobConfig.load(csv_job(tmp_path, mode)))  # the right job passes


def test_a_column_missing_from_one_file_of_a_directory_names_that_file(tmp_path):
    from hpsray.job.inputs import check_inputs

    (tmp_path / "d").mkdir()
    write_csv(tmp_path / "d" / "a.csv")
    write_csv(tmp_path / "d" / "b.csv", header="click,price,user,advert")
    job = JobConfig.load(csv_job(tmp_path, paths='["d"]'))
    with pytest.raises(ConfigError, match=r"data.schema.categorical: column 'ad' is not in .*b.csv"):
        check_inputs(job)


def test_plan_reports_a_missing_column_and_starts_no_ray(tmp_path):
    bad = csv_job(tmp_path, label="clik")
    out = subprocess.run(
        [sys.executable, "-m", "hpsray", "plan", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "column 'clik' is not in" in out.stderr
    assert "too_much_bad_input" not in out.stderr
    good = csv_job(tmp_path)
    code = f"""
        import sys
        from hpsray.__main__ import main
        code = main(["plan", {str(good)!r}, "--json", "--sample-rows", "200"])
        print("RAY", "ray" in sys.modules and __import__("ray").is_initialized())
    """
    out = python(code, timeout=300, HPSRAY_CACHE_DIR=str(tmp_path / "cache"))
    plan_json, ray_line = out.rsplit("RAY", 1)
    assert ray_line.strip() == "False"  # no Ray without --calibrate
    plan = json.loads(plan_json)
    assert any("engines alone" in n and "--calibrate" in n for n in plan["notes"])  # no cached costs: said so
    assert not (tmp_path / "cache").exists()


def test_a_calibration_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch, capsys):
    from hpsray.job import probe as plan_probe
    from hpsray.plan.calibrate import node_cores
    from hpsray.plan.pipeline_cost import StageCosts, cache_file, machine_key

    monkeypatch.setenv("HPSRAY_CACHE_DIR", str(tmp_path))
    idle = StageCosts(
        dict.fromkeys(("read", "pull", "load", "train"), 0.01),
        dict.fromkeys(("read", "pull", "load", "train"), 1.2),
        0.001,
        machine_key(node_cores()),
        load=0.1,
    )
    for busy in (dataclasses.replace(idle, load=node_cores() + 0.5), dataclasses.replace(idle, stretch={"read": 7.0})):
        monkeypatch.setattr(plan_probe, "measure", lambda busy=busy: busy)
        assert plan_probe.stage_costs(recalibrate=True) == busy  # serves this plan
        assert not os.path.exists(cache_file()) and plan_probe.cached_costs() is None
        assert "NOT cached: the machine was busy" in capsys.readouterr().err
    monkeypatch.setattr(plan_probe, "measure", lambda: idle)
    assert plan_probe.stage_costs(recalibrate=True) == idle
    assert plan_probe.cached_costs() == idle  # an idle machine's costs are kept


def test_a_headerless_file_narrower_than_the_schema_is_a_configuration_error(tmp_path):
    """Every row would be ``wrong_column_count`` and the input ``too_much_bad_input``: the
    schema's mistake, named with the file and the column."""
    from hpsray.job.inputs import check_inputs

    (tmp_path / "log.tsv").write_text("".join(f"{i % 2}\t0.5\tq{i}\td{i % 3}\n" for i in range(20)))
    table = {
        "data": {
            "paths": ["log.tsv"],
            "schema": {"format": "csv", "delimiter": "\t", "label": 0, "dense": [1], "categorical": [2, 5]},
        }
    }
    job = JobConfig.from_dict(table, where="job.toml", base_dir=str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"data.schema.categorical: column index 5, but the lines of .*log.tsv have 4"
    ):
        check_inputs(job)
    table["data"]["schema"]["categorical"] = [2, 3]
    check_inputs(JobConfig.from_dict(table, where="job.toml", base_dir=str(tmp_path)))
    (tmp_path / "short.tsv").write_text("0\t1\t2\n")
    criteo = JobConfig.from_dict({"data": {"paths": ["short.tsv"], "format": "criteo"}}, "job.toml", str(tmp_path))
    with pytest.raises(ConfigError, match=r"short.tsv: its lines have 3 fields, the schema reads 40 columns"):
        check_inputs(criteo)
