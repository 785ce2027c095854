"""``hpsray bench NAME``: run a benchmark and print its report (JSON with ``--json``)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import platform
import sys
import time

from hpsray.bench import BENCHMARKS

HELP = "run a benchmark side by side with its baseline; prints a report (JSON with --json)"


def help_of(module_name: str) -> str:
    """A benchmark module's ``HELP`` string, read from its source without importing it (the
    modules import torch, numba or Ray: seconds for ``hpsray bench --help``)."""
    spec = importlib.util.find_spec(module_name)
    if spec is not None and spec.origin:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "HELP" for t in node.targets):
                try:
                    return str(ast.literal_eval(node.value))
                except ValueError:
                    break
    return str(importlib.import_module(module_name).HELP)


def add_arguments(parser: argparse.ArgumentParser, only: str | None = None) -> None:
    """Every benchmark's subcommand; with ``only`` (a benchmark's name), only that one's module
    is imported and given its options; the others are listed with their one-line help, read
    without importing them."""
    sub = parser.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    for name, module_name in BENCHMARKS.items():
        if name != only:
            sub.add_parser(name, help=help_of(module_name))
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
        p.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
        module.add_arguments(p)
        p.set_defaults(_bench=module.run)


def _machine() -> dict:
    import os

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def _print_table(report: dict, prefix: str = "") -> None:
    for key, value in report.items():
        if isinstance(value, dict):
            _print_table(value, prefix + key + ".")
        elif isinstance(value, float):
            print(f"{prefix + key:48s} {value:,.4g}")
        else:
            print(f"{prefix + key:48s} {value}")


def run(args: argparse.Namespace) -> int:
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report = args._bench(args)
    report = {"benchmark": args.benchmark, "started": started, "machine": _machine(), **report}
    text = json.dumps(report, indent=2, sort_keys=False)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        _print_table(report)
    sys.stdout.flush()
    return 0
