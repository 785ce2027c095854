"""Benchmarks behind ``hpsray bench NAME``.

Each module defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> dict``; the dict is
the JSON report. Every benchmark measures its baseline in the same run and reports ratios.
"""

BENCHMARKS = {
    "kernels": "hpsray.bench.kernels",
    "ssd": "hpsray.bench.ssd",
    "layout": "hpsray.bench.layout",
    "cache": "hpsray.bench.cache",
    "ingest": "hpsray.bench.ingest",
    "e2e": "hpsray.bench.e2e",
    "outofcore": "hpsray.bench.outofcore",
    "peers": "hpsray.bench.peers",
    "exchange": "hpsray.bench.exchange",
    "scale": "hpsray.bench.scale",
    "serve": "hpsray.bench.serve",
    "plan": "hpsray.bench.plan",
    "recovery": "hpsray.bench.recovery",
    "consistency": "hpsray.bench.consistency",
    "bigger-than-memory": "hpsray.bench.bigger_than_memory",
}
