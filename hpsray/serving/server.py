"""Starting a model on Ray Serve from Python (what ``hpsray serve`` runs).

    from hpsray.serving import ServeOptions, start
    handle = start("models/ctr", ServeOptions(port=8000, replicas=2, mem_fraction=0.05))
    probs = handle.predict.remote(batch).result()        # a Batch, from Python
    # or: curl -d '{"examples": [...]}' http://127.0.0.1:8000/predict

The HTTP proxy listens on ``host`` (``127.0.0.1`` unless told otherwise). Ray is started locally
when this process is not connected to a cluster yet.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from hpsray.serving.request import Limits

if TYPE_CHECKING:
    from ray.serve import Application
    from ray.serve.handle import DeploymentHandle

    from hpsray.serving.model import LoadOptions

__all__ = ["ServeOptions", "build_app", "connect_ray", "start", "stop"]


@dataclass(frozen=True)
class ServeOptions:
    """Where and how to serve: address, replicas, rows in memory, device, batching, limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    mem_rows: int | None = None
    mem_fraction: float | None = None
    device: str = "cpu"
    device_rows: int | None = None  # see LoadOptions.device_rows
    driver: str = "cpu"  # see LoadOptions.driver
    limits: Limits = field(default_factory=Limits)
    max_batch_size: int = 16
    batch_wait_s: float = 0.002
    watch_s: float = 2.0
    replica_cpus: float = 1.0
    replica_gpus: float = 1.0  # with device "cuda": the share of a GPU each replica asks Ray for
    torch_threads: int = 1
    name: str = "hpsray"
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must lie in 1..65535, got {self.port}")
        if self.max_batch_size < 1 or self.batch_wait_s < 0 or self.watch_s < 0:
            raise ValueError("max_batch_size must be >= 1, batch_wait_s and watch_s >= 0")
        if self.replica_gpus <= 0 or (self.replica_gpus > 1 and self.replica_gpus != int(self.replica_gpus)):
            raise ValueError(f"replica_gpus must be a fraction in (0, 1] or a whole number, got {self.replica_gpus}")


def load_options(options: ServeOptions) -> LoadOptions:
    """The :class:`~hpsray.serving.model.LoadOptions` each replica of ``options`` loads with."""
    from hpsray.serving.model import LoadOptions

    return LoadOptions(
        options.mem_rows,
        options.mem_fraction,
        options.device,
        options.limits,
        device_rows=options.device_rows,
        driver=options.driver,
    )


def build_app(
    model_dir: str | os.PathLike, options: ServeOptions = ServeOptions(), *, load: LoadOptions | None = None
) -> Application:
    """The Ray Serve application of a model directory (not yet running); ``load`` (a
    :class:`~hpsray.serving.model.LoadOptions`) overrides what ``options`` says about the rows."""
    from hpsray.serving.deployment import Predictor
    from hpsray.serving.model import resolve_export

    if load is None:
        load = load_options(options)
    resolve_export(model_dir)  # a missing export fails here, not in the replicas
    actor = {"num_cpus": options.replica_cpus}
    if options.device == "cuda":
        actor["num_gpus"] = options.replica_gpus
    # ray's serve.deployment is annotated as returning the class; it returns a Deployment
    dep = Predictor.options(  # type: ignore[attr-defined]
        num_replicas=options.replicas, ray_actor_options=actor
    )
    load_d = asdict(load)
    return dep.bind(
        os.path.abspath(os.fspath(model_dir)),
        load_d,
        options.max_batch_size,
        options.batch_wait_s,
        options.watch_s,
        options.torch_threads,
    )


def connect_ray(address: str | None = None) -> bool:
    """Join Ray at ``address``, or start a local one, unless this process is connected already;
    whether this call started or joined it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False)
    return True


def start(
    model_dir: str | os.PathLike, options: ServeOptions = ServeOptions(), *, address: str | None = None
) -> DeploymentHandle:
    """Deploy ``model_dir`` and return its deployment handle (Ray and Serve started if needed)."""
    from ray import serve

    connect_ray(address)
    serve.start(http_options={"host": options.host, "port": options.port})  # says so if Serve ran already
    serve_log = logging.getLogger("ray.serve")
    quiet = _NotAppliedNotice()  # serve.run connects to the Serve just started: its notice is not for the user
    serve_log.addFilter(quiet)
    try:
        return serve.run(build_app(model_dir, options), name=options.name, route_prefix=options.route_prefix)
    finally:
        serve_log.removeFilter(quiet)


class _NotAppliedNotice(logging.Filter):
    """Drops Serve's "New http_options/controller_options will not be applied" notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will not be applied" not in str(record.msg)


def stop(name: str | None = None) -> None:
    """Remove one application (``name``) or shut Serve down (``None``)."""
    from ray import serve

    if name is None:
        serve.shutdown()
    else:
        serve.delete(name)
