"""The ``hpsray`` command (also ``python -m hpsray``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from hpsray.version import __version__

# One module per subcommand; each defines HELP, add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "bench": "hpsray.cli.bench",
    "demo": "hpsray.cli.demo",
    "gen-data": "hpsray.cli.gen_data",
    "plan": "hpsray.cli.plan",
    "reference": "hpsray.cli.reference",
    "serve": "hpsray.cli.serve",
    "train": "hpsray.cli.train",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser, for ``argv`` (the words after ``hpsray``; default ``sys.argv``):
    only the command named there gets its options (and for ``bench NAME`` only that
    benchmark's), so a command does not first import the others' modules (torch, numba: seconds
    before anything starts); with no command named, the commands and their one-line help only
    (``hpsray --help`` imports no command's dependencies: well under a second)."""
    words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
    command = words[0] if words else None
    parser = argparse.ArgumentParser(
        prog="hpsray",
        description="Hierarchical parameter server on Ray for CTR models with huge sparse embedding tables.",
    )
    parser.add_argument("--version", action="version", version=f"hpsray {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if name == command:
            module.add_arguments(p, *([words[1]] if name == "bench" and len(words) > 1 else []))
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from hpsray.cli.start import tidy_ray_logs

    tidy_ray_logs()  # a log without a terminal: no colour codes, no notice the user cannot act on
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
