"""``hpsray bench scale --hosts netns``: the scaling model checked against shaped links.

The nodes are network-namespace hosts (:mod:`hpsray.cluster.netns`): every byte between two
nodes crosses a veth link, which ``tc`` limits to a rate (``tbf``; ``netem`` for delay where the
kernel has it). Per link shape the bench measures the link itself (TCP throughput and round trip
between host 0 and host 1), then examples/s and bytes per mini-batch of an ``n``-node run, and
sets beside it the projection of the model in :mod:`hpsray.bench.scale_model` for that link
(``BW`` = the shaped rate, or the measured throughput when unshaped; ``alpha`` = half the
measured round trip), from stage costs measured by a 1-node run on host 0, at ``g = 1``; with
``--cpus-per-host`` also from that run's host and trainer CPU and the exchange probe's costs on
the link (:mod:`hpsray.bench.scale_probe`; the model's ``path`` and ``cpu``, reported per node
count as ``model_terms``). Without ``--cpus-per-host`` the hosts share this machine's cores,
which the model does not know: on a 2-core machine two nodes compute slower than one node alone,
and the report says so beside the ratio. With ``--cpus-per-host N`` each host runs on N cores of
its own (a cpuset, :mod:`hpsray.cluster.netns`), so the 1-node baseline and each node of an
``n``-node run get the same cores. JSON: ``projection_vs_measured`` (link → projected ÷ measured
examples/s of the largest node count), ``measured_vs_one_host`` (link → node count → examples/s
÷ the 1-node run's) and the load average before and after (figures taken on a busy machine say
so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from hpsray.bench.scale_model import fit_nodes, project, stage_costs, summarize, terms_on_cores

if TYPE_CHECKING:
    from hpsray.cluster.netns import NetnsHosts

_FIT_KEYS = ("rows", "batch", "minibatch", "slots", "keys", "dim", "hidden", "seed")

_SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 47124)); s.listen(); print("listening", flush=True)
for _ in range(2):
    c, _ = s.accept()
    if c.recv(1) == b"p":          # ping-pong: echo 1 byte until closed
        c.sendall(b"p")
        while (b := c.recv(1)):
            c.sendall(b)
    else:                            # bulk: read until closed, then acknowledge
        while c.recv(1 << 20):
            pass
    c.close()
"""

_DIAL = """
import json, socket, sys, time
address, total = sys.argv[1], int(sys.argv[2])
c = socket.create_connection((address, 47124)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
t = time.perf_counter()
for _ in range(200):
    c.sendall(b"p"); c.recv(1)
rtt = (time.perf_counter() - t) / 200
c.close()
c = socket.create_connection((address, 47124)); chunk = b"b" * (1 << 20)
t = time.perf_counter()
for _ in range(total >> 20):
    c.sendall(chunk)
c.shutdown(socket.SHUT_WR); c.recv(1); elapsed = time.perf_counter() - t
print(json.dumps({"rtt_s": rtt, "bytes_per_s": total / elapsed}))
"""


def _parse_link(link: str) -> tuple[str | None, float | None]:
    """``"1gbit"`` → ``("1gbit", None)``; ``"1gbit/0.5ms"`` → ``("1gbit", 0.5)``; ``"none"`` → both None."""
    rate, _, delay = link.partition("/")
    rate_bit = None if rate in ("", "none") else rate
    return rate_bit, (float(delay.removesuffix("ms")) if delay else None)


def _rate_bytes_per_s(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale / 8
    raise ValueError(f"link rate {rate!r}: expected a number with kbit, mbit or gbit")


def _probe(hosts: NetnsHosts, total_bytes: int) -> dict:
    """TCP round trip and bulk throughput from host 0 to host 1."""
    server = hosts.popen(1, [sys.executable, "-c", _SERVE], "probe.log")
    try:
        deadline = time.time() + 30
        while "listening" not in (hosts.temp / "probe.log").read_text():
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"link probe server did not start: {(hosts.temp / 'probe.log').read_text()}")
            time.sleep(0.1)
        out = hosts.run(0, [sys.executable, "-c", _DIAL, hosts.hosts[1].address, str(total_bytes)], timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"link probe failed: {out.stderr[-1500:]}")
        return json.loads(out.stdout)
    finally:
        server.kill()
        server.wait()


def _drive(hosts: NetnsHosts, args: argparse.Namespace, n: int, probe: dict | None = None) -> dict:
    """One measurement of ``n`` nodes, its driver run inside host 0: the run's summary; with
    ``probe`` (the byte counts of :func:`~hpsray.bench.scale_probe.probe_exchange`) the exchange
    probe's costs instead."""
    fields = {k: getattr(args, k) for k in _FIT_KEYS}
    spec = json.dumps({"n": n, **fields, "host_cpus": hosts.cpus, "cpus_per_host": args.cpus_per_host, "probe": probe})
    out = hosts.run(
        0,
        [sys.executable, "-m", "hpsray.bench.scale_hosts", spec],
        timeout=1800,
        env=hosts.env(RAY_ADDRESS=hosts.address),
    )
    if out.returncode != 0:
        what = "exchange probe" if probe else f"{n}-node run"
        raise RuntimeError(f"the {what} on the namespace hosts failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_counts(cpus_per_host: int | None) -> str:
    """``--nodes`` unset: 1 to 3 hosts, fewer where pinned hosts would have to share cores (never below 1,2)."""
    if cpus_per_host is None:
        return "1,2,3"
    fits = len(os.sched_getaffinity(0)) // max(cpus_per_host, 1)
    return ",".join(str(n) for n in range(1, max(2, min(3, fits)) + 1))


def run_on_hosts(args: argparse.Namespace) -> dict:
    """Measured vs projected examples/s per link shape on namespace hosts (see the module doc)."""
    from hpsray.cluster.netns import NetnsHosts
    from hpsray.errors import NetnsUnavailable

    counts = sorted({int(x) for x in (args.nodes or default_counts(args.cpus_per_host)).split(",")} | {1})
    multi = [n for n in counts if n > 1]
    if not multi:
        raise ValueError("--hosts netns needs a node count above 1 in --nodes, e.g. --nodes 1,2")
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    results: dict = {}
    load_before = os.getloadavg()
    pinned = args.cpus_per_host is not None
    with NetnsHosts(max(counts), cpus_per_host=args.cpus_per_host or 1, pin=pinned) as hosts:
        print("[bench scale] 1 node on host 0 ...", file=sys.stderr, flush=True)
        base = _drive(hosts, args, 1)
        for link in links:
            rate, delay = _parse_link(link)
            try:
                hosts.shape(rate, delay)
            except NetnsUnavailable as exc:
                results[link] = {"error": str(exc)}
                print(f"[bench scale] link {link}: {exc}", file=sys.stderr, flush=True)
                continue
            probe = _probe(hosts, 64 << 20 if rate is None or _rate_bytes_per_s(rate) > 5e7 else 8 << 20)
            bw = _rate_bytes_per_s(rate) if rate else probe["bytes_per_s"]
            per_n = {}
            exchange = None
            for n in multi:
                print(f"[bench scale] {n} nodes, link {link} ...", file=sys.stderr, flush=True)
                measured = _drive(hosts, args, n)
                costs = stage_costs(args, {1: base, n: measured})
                if exchange is None and pinned:  # what the batch's traffic costs on this link, measured apart
                    print(f"[bench scale] exchange probe, link {link} ...", file=sys.stderr, flush=True)
                    rows = costs["distinct_keys"] * costs["row_bytes"] / 2  # one remote owner's of two
                    sizes = {k: costs[k] for k in ("dense_bytes", "sparse_bytes")}
                    exchange = _drive(hosts, args, 2, {**sizes, "rows_bytes": rows, "dim": args.dim})
                costs["probe"] = exchange
                projected = project(costs, n, bw, probe["rtt_s"] / 2, 1.0)
                train_s = measured["stage_busy_s"].get("train", 0.0) / measured["batches"]
                per_n[str(n)] = {
                    "measured_examples_per_s": measured["examples_per_s"],
                    "projected_examples_per_s": projected,
                    "projected_over_measured": projected / measured["examples_per_s"],
                    "exchanged_bytes_per_minibatch": measured["exchanged_bytes_per_minibatch"],
                    "stage_busy_s": measured["stage_busy_s"],
                    "batches": measured["batches"],
                    "costs_per_batch": costs,
                    # the model's compute is the 1-node run's; on shared cores it is not (sync included)
                    "train_s_per_batch": train_s,
                    "train_slowdown_vs_1_node": train_s / costs["train_s"] if costs["train_s"] else None,
                    "pulls": measured.get("pulls"),  # HierPS Fig. 4b: local vs remote lookups of a batch's keys
                    "seconds_per_batch": measured.get("seconds_per_batch"),
                    "host_cpu_s_per_batch": (measured["host_cpu_s"] / measured["batches"])
                    if measured.get("host_cpu_s") is not None
                    else None,
                    "model_terms": terms_on_cores(costs, n, bw, probe["rtt_s"] / 2, 1.0) if exchange else None,
                }
            results[link] = {
                "rate": rate,
                "delay_ms": delay,
                "model_bandwidth_bytes_per_s": bw,
                "probe": probe,
                "exchange_probe": exchange,
                "nodes": per_n,
            }
        hosts.shape(None, None)
        cpus, pinning, shared = hosts.cpus, hosts.pinning, hosts.shared_cores
    top = str(max(multi))
    return {
        "hosts": "netns",
        "one_node": base,
        "links": results,
        "projection_vs_measured": {
            link: r["nodes"][top]["projected_over_measured"] for link, r in results.items() if "nodes" in r
        },
        "measured_vs_one_host": {
            link: {n: m["measured_examples_per_s"] / base["examples_per_s"] for n, m in r["nodes"].items()}
            for link, r in results.items()
            if "nodes" in r
        },
        "target": "projection within +-25 % of the measurement",
        "cores": os.cpu_count(),
        "cpus_per_host": args.cpus_per_host,
        "host_cpus": cpus,
        "pinning": pinning,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "note": (
            "each host on cores of its own" + (" (more hosts than cores: some share)" if shared else "")
            if pinned
            else "the namespace hosts share this machine's cores"
        )
        + "; the projection (g = 1) assumes each node computes as fast as the 1-node run did alone; "
        "figures are only meaningful when load_avg_before is below the core count minus the hosts' cores",
    }


def _main(spec: str) -> None:
    """Driver side (inside host 0): fit ``n`` nodes on the cluster at ``RAY_ADDRESS`` and print
    the summary, or (``probe`` in the spec) run the exchange probe and print its costs."""
    import ray

    fields = json.loads(spec)
    probe = fields.pop("probe", None)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    if probe:
        from hpsray.bench.scale_probe import probe_exchange

        print(json.dumps(probe_exchange(**probe, host_cpus=fields["host_cpus"])))
        return
    summary = summarize(fit_nodes(argparse.Namespace(**fields), fields["n"]))
    print(json.dumps(summary))


if __name__ == "__main__":
    _main(sys.argv[1])
