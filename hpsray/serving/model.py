"""A servable model: an export's dense network, its row lookup and its request parser.

:meth:`ServableModel.load` opens an export directory (or the newest export under a directory of
exports, :func:`resolve_export`) with its incremental deltas applied (dense weights from the newest
one), builds the point store of that state if needed (:mod:`hpsray.serving.layout`), and holds
``mem_rows`` rows in memory: all of them by default (:class:`MemoryLookup`), otherwise a hot-row
cache in front of SSD point reads (:class:`TieredLookup`). :meth:`predict` computes what
:meth:`hpsray.reference.ReferenceTrainer.predict` computes for the same rows: sum-pooled embeddings
of the batch's distinct keys through the dense model, then a sigmoid.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.errors import ExportError, ServingError
from hpsray.kernels.init import RowInit
from hpsray.models.kinds import ModelSpec
from hpsray.models.pooling import BagLayout, bag_divisor, pool_sum, slot_columns
from hpsray.serving.layout import build_point_store
from hpsray.serving.lookup import SSD_READS, MemoryLookup, TieredLookup, mem_rows_for
from hpsray.serving.pointstore import PointStore
from hpsray.serving.request import InputSpec, Limits, RequestParser
from hpsray.serving.tables import SlotTables

if TYPE_CHECKING:
    from hpsray.serving.baselines import EmbeddingBagLookup, RocksDBLookup
    from hpsray.serving.cuda_lookup import CudaTieredLookup
    from hpsray.serving.device_driven import DeviceDrivenLookup

    # what ServableModel.load builds, by backend, driver and device
    ServingLookup = (
        MemoryLookup | TieredLookup | CudaTieredLookup | DeviceDrivenLookup | RocksDBLookup | EmbeddingBagLookup
    )

__all__ = ["DRIVERS", "LoadOptions", "ServableModel", "export_version", "resolve_export"]

DRIVERS = ("cpu", "device")


def export_version(directory: str) -> tuple[str, int, tuple[int, ...]]:
    """``(path, mtime_ns of manifest.json, (mtime_ns of each delta's manifest.json, ...))``:
    changes whenever an export or a delta lands there.

    The deltas are ``delta-000001``, ``delta-000002`` ... up to the first without a
    ``manifest.json`` (one being written): a stat each, quiet, cheap enough to poll. Whether a
    delta applies (its base, its sequence) is checked when the model is loaded
    (:func:`~hpsray.export.export_chain`); a version names the directory's state, so a
    delta that does not apply is not loaded again and again.
    """
    stamps: list[int] = []
    while True:
        try:
            stamps.append(os.stat(os.path.join(directory, f"delta-{len(stamps) + 1:06d}", "manifest.json")).st_mtime_ns)
        except OSError:
            break
    return directory, os.stat(os.path.join(directory, "manifest.json")).st_mtime_ns, tuple(stamps)


def _newest_ns(version: tuple[str, int, tuple[int, ...]]) -> int:
    return max(version[1], *version[2]) if version[2] else version[1]


def resolve_export(path: str | os.PathLike) -> str:
    """``path`` itself when it is an export; else its newest sub-directory that is one.

    "Newest" is the latest ``manifest.json`` (written last by an export, and by each of its
    deltas), so a directory of versioned exports (``models/v1``, ``models/v2`` ...) serves the
    latest complete one, and an export that a delta just landed in counts as new. A URI
    (``s3://bucket/model``) is downloaded into a local cache first, again only when it changed
    (:func:`~hpsray.export.remote.fetch_export`).
    """
    from hpsray.export.remote import fetch_export, is_uri

    path = os.fspath(path)
    if is_uri(path):
        try:
            return fetch_export(path)
        except (ExportError, OSError) as e:
            raise ServingError(f"{path.split('?')[0]}: {e}") from None
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    best, best_t = None, -1
    try:
        entries = list(os.scandir(path))
    except OSError as e:
        raise ServingError(f"{path}: cannot list: {e}") from None
    for entry in entries:
        if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "manifest.json")):
            try:
                t = _newest_ns(export_version(entry.path))
            except OSError:  # replaced meanwhile
                continue
            if t > best_t:
                best, best_t = entry.path, t
    if best is None:
        raise ServingError(f"{path}: no export here (no manifest.json in it or in a sub-directory)")
    return best


@dataclass(frozen=True)
class LoadOptions:
    """How a replica holds a model: rows in memory (``mem_rows`` or ``mem_fraction``; all when
    neither), device, request limits; ``backend`` other than ``hpsray`` picks a benchmark baseline
    (:mod:`hpsray.serving.baselines`). ``device_rows`` (``device="cuda"`` only): the hottest rows
    held in device memory in front of the ``mem_rows`` of mapped host memory; ``None``: the
    smaller of the memory rows and a quarter of the device's free memory
    (:func:`hpsray.serving.device_cache.device_rows_for`), 0: none.

    ``driver``: ``cpu`` (the host dedupes the batch and probes the tiers; on ``cuda`` it sends the
    device index arrays), or ``device`` (:mod:`hpsray.serving.device_driven`: one upload of the
    keys, dedupe, layout, probes and gathers on the device; with ``device="cpu"`` the same lines
    run on NumPy). ``ssd_read``: how the CPU-driven tiered lookup reads misses
    (:data:`hpsray.serving.lookup.SSD_READS`: ``auto``, ``blocks`` or ``mmap``; the GPU paths
    always read merged ranges)."""

    mem_rows: int | None = None
    mem_fraction: float | None = None
    device: str = "cpu"
    limits: Limits = Limits()
    backend: str = "hpsray"
    device_rows: int | None = None
    driver: str = "cpu"
    ssd_read: str = "auto"

    def __post_init__(self) -> None:
        from hpsray.serving.baselines import BACKENDS

        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        mem_rows_for(0, self.mem_rows, self.mem_fraction)  # checks the pair
        if self.driver not in DRIVERS:
            raise ValueError(f"driver must be one of {', '.join(DRIVERS)}, got {self.driver!r}")
        if self.ssd_read not in SSD_READS:
            raise ValueError(f"ssd_read must be one of {', '.join(SSD_READS)}, got {self.ssd_read!r}")
        if self.driver == "device" and self.backend != "hpsray":
            raise ValueError(f"driver 'device' is hpsray's own lookup, not the {self.backend!r} baseline")
        if self.device_rows is not None:
            if self.device != "cuda" and self.driver != "device":
                raise ValueError("device_rows (--device-rows) needs device 'cuda' (or driver 'device')")
            if self.device_rows < 0:
                raise ValueError(f"device_rows must be >= 0, got {self.device_rows}")


class ServableModel:
    """One loaded export (its deltas applied); :meth:`predict` is safe to call from one thread at a time.

    ``manifest`` is the base export's; ``chain`` the directories applied (the base, then each
    delta, :func:`~hpsray.export.export_chain`); ``version`` the
    :func:`export_version` of the directory when it was loaded; ``rows`` the rows of the state
    served.
    """

    def __init__(
        self,
        directory: str,
        manifest: dict,
        dense: torch.nn.Module,
        lookup: ServingLookup,
        parser: RequestParser,
        device: str = "cpu",
        *,
        chain: list[str] | None = None,
        version: tuple | None = None,
        rows: int | None = None,
        tables: SlotTables | None = None,
    ) -> None:
        self.tables = tables  # several tables or mean pooling: keys tagged, mean slots divided, as trained
        means = tables.mean_slots if tables is not None else None
        # the mean slots, on the model's device once (not uploaded per request); None: every slot sums
        self._mean = torch.from_numpy(means).to(device) if means is not None and means.any() else None
        slot_dims = tables.slot_dims if tables is not None else None
        self._slot_cols = (
            torch.from_numpy(slot_columns(slot_dims, int(manifest["dim"]))).to(device)
            if slot_dims is not None
            else None
        )
        self.directory, self.manifest = directory, manifest
        self.dense, self.lookup, self.parser, self.device = dense, lookup, parser, device
        self.chain = chain or [directory]
        self.version = version if version is not None else export_version(directory)
        self.rows = int(manifest["rows"]) if rows is None else rows

    @property
    def delta(self) -> int:
        """The sequence number of the newest delta applied (0: the base export alone)."""
        return len(self.chain) - 1

    @classmethod
    def load(
        cls, path: str | os.PathLike, options: LoadOptions = LoadOptions(), previous: ServableModel | None = None
    ) -> ServableModel:
        """Load the export at ``path`` (or the newest under it) with its deltas applied.

        ``previous``: the model served until now; its hot rows are carried over into the new
        model's cache (re-read from the new state, so a row a delta changed is served new).
        """
        from hpsray.export import export_chain, read_manifest

        directory = resolve_export(path)
        version = export_version(directory)  # before reading: a delta landing meanwhile is seen at the next look
        m = read_manifest(directory)
        chain = export_chain(directory)
        last = m if len(chain) == 1 else _read_json(os.path.join(chain[-1], "manifest.json"))
        where = os.path.join(directory, "manifest.json")
        spec = InputSpec.from_manifest(m, where)
        shape = m.get("model") or {}
        n_slots, n_dense = shape.get("n_slots"), shape.get("n_dense")
        if n_slots != len(spec.categorical) or n_dense != len(spec.dense):
            raise ServingError(
                f"{where}: model shape ({n_slots} slots, {n_dense} dense) disagrees with the input "
                f"schema ({len(spec.categorical)} categorical, {len(spec.dense)} dense columns)"
            )
        try:
            tables = SlotTables.from_manifest(m.get("tables"), n_slots, where)
        except ValueError as e:
            raise ServingError(str(e)) from None
        dim = int(m["dim"])
        state = torch.load(os.path.join(chain[-1], last["dense"]), map_location="cpu", weights_only=True)
        recorded = {k: v for k, v in shape.items() if k not in ("n_slots", "n_dense")}  # an older export: mlp
        slot_dims = tables.slot_dims if tables is not None else None
        copies = int(tables.copy_of.size) if tables is not None else 0  # first-order slots after the data's
        dense = ModelSpec.from_dict(recorded).build(
            n_slots + copies, dim, n_dense, seed=0, slot_dims=slot_dims, first_order=copies
        )  # weights: below
        dense.load_state_dict(state)
        dense.eval()
        # an unseen key's weights: its table's dim of them, zeros to the export's dim
        by_table = tuple((d, d, 0.0) for d in tables.dims) if slot_dims is not None and tables is not None else ()
        init = RowInit(dim=dim, scale=float(m["init_scale"]), seed=int(m["seed"]), tables=by_table)
        store = PointStore(build_point_store(directory, chain=chain))
        mem = mem_rows_for(len(store), options.mem_rows, options.mem_fraction)
        lookup: ServingLookup
        if options.backend != "hpsray":
            from hpsray.serving.baselines import EmbeddingBagLookup, RocksDBLookup

            lookup = RocksDBLookup(store, mem, init) if options.backend == "rocksdb" else EmbeddingBagLookup(store)
        elif options.driver == "device":
            lookup = _device_driven(store, mem, init, options, previous)
            dense = dense.to(options.device)
        elif options.device == "cuda":
            from hpsray.serving.cuda_lookup import CudaTieredLookup

            was = previous.lookup if previous is not None else None
            warm_gpu = was if isinstance(was, CudaTieredLookup) else None
            lookup = CudaTieredLookup(store, mem, init, device_rows=options.device_rows, warm_from=warm_gpu)
            dense = dense.to("cuda")
        elif mem >= len(store):
            lookup = MemoryLookup(np.array(store.keys), store.read_all(), init)
            store.close()
        else:
            warm = previous.lookup if previous is not None and isinstance(previous.lookup, TieredLookup) else None
            lookup = TieredLookup(store, mem, init, warm_from=warm, ssd_read=options.ssd_read)
        parser = RequestParser(spec, options.limits)
        return cls(
            directory,
            m,
            dense,
            lookup,
            parser,
            options.device,
            chain=chain,
            version=version,
            rows=len(store),
            tables=tables,
        )

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """``float32[B]`` click probabilities of ``batch``'s examples."""
        n_slots = int(self.dense.n_slots) - (self.tables.copy_of.size if self.tables is not None else 0)  # type: ignore[arg-type]
        if batch.n_slots != n_slots or batch.n_dense != self.dense.n_dense:
            raise ServingError(
                f"batch has {batch.n_slots} slots and {batch.n_dense} dense features; the model "
                f"takes {n_slots} and {self.dense.n_dense}"
            )
        if not len(batch):
            return np.empty(0, np.float32)
        if self.tables is not None:
            batch = self.tables.tag(batch)
        if hasattr(self.lookup, "layout"):  # device-driven: the layout, probes and gathers on the device
            return self._predict_device_driven(batch)
        if hasattr(self.lookup, "pooled"):  # the embedding-bag bound pools by itself
            pooled = self._as_trained(self.lookup.pooled(batch), batch)
            return torch.sigmoid(self.dense(pooled, torch.from_numpy(batch.dense))).numpy()
        layout = BagLayout.of(batch)
        rows = self.lookup.rows(layout.unique_keys)
        emb = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(rows)
        dense = torch.from_numpy(batch.dense).to(emb.device)
        if emb.is_cuda:
            pooled = torch.nn.functional.embedding_bag(
                torch.from_numpy(layout.inverse).to(emb.device),
                emb,
                torch.from_numpy(layout.bag_offsets).to(emb.device),
                mode="sum",
            ).view(layout.n_examples, layout.n_slots, emb.shape[1])
        else:
            pooled = pool_sum(emb, layout)
        return torch.sigmoid(self.dense(self._as_trained(pooled, batch, layout), dense)).cpu().numpy()

    def _as_trained(self, pooled: torch.Tensor, batch: Batch, layout: BagLayout | None = None) -> torch.Tensor:
        """The summed bags ``pooled`` as training pooled them: a mean slot's bag over its key
        count, from ``layout``'s offsets where it lives (the device's, for the device-driven
        lookup: nothing more crosses the bus), else from ``batch``."""
        if self._mean is not None:
            if layout is not None:
                offsets, n_keys = (
                    torch.as_tensor(layout.bag_offsets, device=pooled.device),
                    int(layout.inverse.shape[0]),
                )
            else:
                offsets, n_keys = torch.from_numpy(batch.bag_offsets()).to(pooled.device), batch.nnz
            pooled = pooled / bag_divisor(offsets, n_keys, len(batch), self._mean.to(pooled.device))
        if self._slot_cols is None:
            return pooled
        # tables of several dims: each slot's first dim columns, as the trainer's model took them
        return pooled.reshape(pooled.shape[0], -1).index_select(1, self._slot_cols.to(pooled.device))

    def _predict_device_driven(self, batch: Batch) -> np.ndarray:
        """One upload of the keys (the layout computed on the device), the rows gathered there, one
        upload of the dense features, one download of the probabilities."""
        from hpsray.serving.device_driven import DeviceDrivenLookup

        lookup = self.lookup
        assert isinstance(lookup, DeviceDrivenLookup)  # the only lookup with a device layout
        device = torch.device(self.device)
        layout = lookup.layout(batch)
        emb = torch.as_tensor(lookup.rows(layout.unique_keys), device=device)
        pooled = torch.nn.functional.embedding_bag(
            torch.as_tensor(layout.inverse, device=device),
            emb,
            torch.as_tensor(layout.bag_offsets, device=device),
            mode="sum",
        ).view(layout.n_examples, layout.n_slots, emb.shape[1])
        pooled = self._as_trained(pooled, batch, layout)
        lookup.transfers.h2d["dense"] += 1
        dense = torch.from_numpy(batch.dense).to(device)
        return lookup.transfers.to_host(torch.sigmoid(self.dense(pooled, dense)), "probabilities")

    def stats(self) -> dict:
        return {"directory": self.directory, "rows": self.rows, "delta": self.delta, **self.lookup.stats()}


def _device_driven(
    store: PointStore, mem: int, init: RowInit, options: LoadOptions, previous: ServableModel | None
) -> DeviceDrivenLookup:
    """The device-driven lookup of a load (its device tier sized as the CPU-driven GPU path's)."""
    from hpsray.kernels.arrays import array_module
    from hpsray.serving.device_cache import device_rows_for
    from hpsray.serving.device_driven import DeviceDrivenLookup

    xp = array_module(options.device)
    free = float("inf") if options.device == "cpu" else None
    n_dev = device_rows_for(len(store), min(mem, len(store)), options.device_rows, store.dim, free_bytes=free)
    was = previous.lookup if previous is not None else None
    warm = was if isinstance(was, DeviceDrivenLookup) and was.xp is xp else None
    return DeviceDrivenLookup(store, mem, init, n_dev, xp, warm_from=warm)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ServingError(f"{path}: cannot read: {e}") from None
