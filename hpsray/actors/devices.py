"""The device processes of a node's trainer (docs/architecture.md: Devices): where device 0
starts the other ``D - 1``, and how it tells that one died. What each gives back of a batch is a
:class:`~hpsray.training.devices.DevicePart`."""

from __future__ import annotations

from typing import Any

from hpsray.actors.ahead import trainer_actor


def start_device_workers(trainer: type, args: tuple, placement: Any, name: str | None) -> list:
    """The node's ``trainer`` processes for devices ``1 .. D-1`` (``args``: the trainer's own
    arguments), on this node: in bundle ``d`` of ``placement`` (a placement group of one GPU
    per bundle, on CUDA) or pinned to this node (on CPU). They are this actor's: they die with
    it, and a recovery that restarts it starts them again."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    workers: list[Any] = []  # actor handles
    for d in range(1, args[6]):
        opts = device_options(d, placement, here)
        if name:
            opts["name"] = f"{name[:-1]}, device {d}]" if name.endswith("]") else f"{name}[device {d}]"
        workers.append(trainer_actor(trainer).options(**opts).remote(*args, device_index=d))
    return workers


def device_options(d: int, placement: Any, node_id: str) -> dict[str, Any]:
    """Ray options of device ``d``'s trainer process: one GPU in bundle ``d`` of the node's
    placement group, or (on CPU, ``placement`` None) pinned to the node ``node_id``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1}
    if placement is not None:
        opts["num_gpus"] = 1
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=d)
    else:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return opts


def a_worker_died(parts: list, timeout: float = 10.0) -> bool:
    """Whether one of the device processes behind ``parts`` (their train_part calls) is dead."""
    import ray

    ready, _ = ray.wait(parts, num_returns=len(parts), timeout=timeout) if parts else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            return True
        except Exception:  # noqa: BLE001,S112 - a failure of its own, not a death
            continue
    return False
