"""Drivers the host tests run inside a namespace host: ``python drivers.py NAME [ARGS]``.

Each connects to the Ray cluster at ``RAY_ADDRESS``, runs one scenario, asserts what it must
(an AssertionError exits non-zero with the reason) and prints one JSON line of findings last.
The lossless check is tests/cluster/test_multinode.py's ``check_lossless``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/small_pipeline.py, which test_multinode imports


def _placement(pipeline) -> list[dict]:
    """Per node of the pipeline: the trainer's Ray node address and its collective binding."""

    def where(trainer):
        import ray as r

        b = trainer.group.binding
        return {
            "ip": r.util.get_node_ip_address(),
            "interface": b.interface,
            "source": b.source,
            "variable": b.variable,
        }

    return ray.get([n.trainer.__ray_call__.remote(where) for n in pipeline._nodes])


def bsp(nodes: str) -> dict:
    """BSP over ``nodes`` hosts with rows spilling through SSD-PS, equal to the reference."""
    from hpsray.pipelines import MemPSSettings, Pipeline, SyncSettings, SyntheticSource, TrainerSettings

    from test_multinode import CFG, GEN, check_lossless

    n = int(nodes)
    source = SyntheticSource(GEN, rows=1700 if n == 2 else 1500)
    batch, capacity = (200, 450) if n == 2 else (100, 250)
    with Pipeline(
        source,
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=capacity),
        batch_size=batch,
        nodes=n,
        sync=SyncSettings(dense="allreduce"),
    ) as p:
        report = p.fit(progress=False)
        assert report["nodes"] == n and report["mode"] == "bsp", report
        assert report["ssd"]["bytes_read"] > 0 and report["ssd"]["bytes_written"] > 0  # rows went to SSD and back
        placement = _placement(p)
        fitted = time.perf_counter()
        check_lossless(p, source, n, batch=batch)
        print(f"check_lossless: {time.perf_counter() - fitted:.1f} s", file=sys.stderr)
    return {
        "examples": report["examples"],
        "placement": placement,
        "exchanged_bytes_per_minibatch": report["sync"]["exchanged_bytes_per_minibatch"],
    }


def ssp() -> dict:
    """SSP with a straggler on 2 hosts: the bound holds, and it learns."""
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSSettings, Pipeline, SyncSettings, SyntheticSource, TrainerSettings

    from hooks import straggler  # tests/cluster/hooks.py (on sys.path above)

    gen = PlantedCTR(n_slots=4, keys_per_slot=200, n_dense=2, seed=5)
    cfg = TrainConfig(dim=4, hidden=(16, 8), minibatch_size=128, seed=5, sparse_lr=0.1)
    with Pipeline(
        SyntheticSource(gen, rows=6_000),
        TrainerSettings(cfg),
        MemPSSettings(capacity_rows=2000),
        batch_size=1500,
        nodes=2,
        sync=SyncSettings("ssp", staleness=2, before_minibatch=straggler(1, 0.02)),
    ) as p:
        report = p.fit(progress=False)
        auc = p.evaluate(SyntheticSource(gen, rows=5_000, start_row=500_000))["auc"]
        placement = _placement(p)
    observed = report["sync"]["max_staleness_observed"]
    assert report["mode"] == "ssp" and report["sync"]["staleness_bound"] == 2
    assert 0 < observed <= 2, observed  # the straggler let the other trainer run ahead, never past the bound
    assert auc > 0.6, auc
    return {"auc": auc, "max_staleness_observed": observed, "placement": placement}


@ray.remote(num_cpus=0)
class _Member:
    """A bare gloo group member, to show what binding changes."""

    def ip(self) -> str:
        return ray.util.get_node_ip_address()

    def join(self, world: int, rank: int, name: str, bind: bool) -> float:
        import ray.util.collective as col
        import torch

        from hpsray.cluster.netaddr import bind_collectives

        if bind:
            bind_collectives("gloo")
        col.init_collective_group(world, rank, backend="gloo", group_name=name, gloo_timeout=5000)
        t = torch.ones(4) * (rank + 1)
        col.allreduce(t, group_name=name)
        return float(t[0])


def _group(bind: bool) -> dict:
    from hpsray.cluster.runtime import alive_nodes, on_node

    # fresh processes: torch.distributed's default group is made once per process
    members = [_Member.options(scheduling_strategy=on_node(n["NodeID"])).remote() for n in alive_nodes()[:2]]
    ips = ray.get([m.ip.remote() for m in members])
    assert len(set(ips)) == 2, ips
    name = "bound" if bind else "unbound"
    try:
        sums = ray.get([m.join.remote(2, r, name, bind) for r, m in enumerate(members)], timeout=90)
        return {"ok": True, "sums": sums, "ips": ips}
    except Exception as exc:  # the failure is the finding
        return {"ok": False, "error": str(exc)[-400:], "ips": ips}
    finally:
        for m in members:
            ray.kill(m)


def gloo_group() -> dict:
    """A 2-rank gloo group across 2 hosts as ray.util.collective makes it, first without
    :func:`bind_collectives` (issue 20's failure), then with it."""
    return {"unbound": _group(False), "bound": _group(True)}


def exchange_probe(rows_bytes: str) -> dict:
    """The scale bench's exchange probe between two hosts (:mod:`hpsray.bench.scale_probe`)."""
    from hpsray.bench.scale_probe import probe_exchange

    return probe_exchange(400_000, 200_000, float(rows_bytes), 16, host_cpus=None, count=3)


if __name__ == "__main__":
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert variable not in os.environ, f"{variable} is set by hand: the hosts must work without it"
    started = time.perf_counter()
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    connected = time.perf_counter()
    named = {"bsp": bsp, "ssp": ssp, "gloo_group": gloo_group, "exchange_probe": exchange_probe}
    result = named[sys.argv[1]](*sys.argv[2:])
    result["seconds"] = {"connect": round(connected - started, 1), "run": round(time.perf_counter() - connected, 1)}
    print(json.dumps(result))
