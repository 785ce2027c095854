"""Serving trained models on Ray Serve (docs/serving.md).

One concept per module: :mod:`~hpsray.serving.layout` (the point-read layout on SSD and its
alignment rule), :mod:`~hpsray.serving.pointstore` (the key index and the mapped rows),
:mod:`~hpsray.serving.blockread` (a batch's misses in merged ranges by parallel ``preadv``),
:mod:`~hpsray.serving.cache` (the hot-row cache), :mod:`~hpsray.serving.lookup` (a batch's rows
through the tiers), :mod:`~hpsray.serving.request` (JSON → Batch, with 400 reasons),
:mod:`~hpsray.serving.model` (a loaded export), :mod:`~hpsray.serving.deployment` (the Ray Serve
deployment), :mod:`~hpsray.serving.server` (starting it), :mod:`~hpsray.serving.uva`,
:mod:`~hpsray.serving.gds`, :mod:`~hpsray.serving.device_cache` and
:mod:`~hpsray.serving.cuda_lookup` (the CPU-driven GPU path: the hottest rows in device memory,
zero-copy gathers from a registered host arena, SSD reads to device memory),
:mod:`~hpsray.serving.device_driven` (the device-driven path, in the array module: one upload of
the keys, dedupe, layout, probes and gathers on the device), :mod:`~hpsray.serving.baselines`
(RocksDB and EmbeddingBag backends for ``hpsray bench serve``). Ray is imported only by
``deployment`` and inside ``server``'s functions.
"""

from hpsray.serving.model import LoadOptions, ServableModel, resolve_export
from hpsray.serving.request import InputSpec, Limits, RequestParser
from hpsray.serving.server import ServeOptions, build_app, start, stop

__all__ = [
    "InputSpec",
    "Limits",
    "LoadOptions",
    "RequestParser",
    "ServableModel",
    "ServeOptions",
    "build_app",
    "resolve_export",
    "start",
    "stop",
]
