"""HBM-PS: the trainer's working set, partitioned over the node's ``D`` device hash tables.

Paper §4 / Algorithm 2. A key lives on device ``(h(key) // N) % D`` of its node
(docs/architecture.md: Keys and partitioning).
Per batch the trainer *inserts* the working set pulled from MEM-PS, then, per mini-batch,
*gets* rows and *accumulates* gradients through the sparse optimizer inside the tables. At batch
end it *gets* the batch's rows for write-back.

Rows already resident from the previous batch are fresher than any copy pulled while that batch
trained (the pull of batch ``t+1`` overlaps the training of ``t``), so :meth:`insert` keeps
them and only fills keys that are new; :meth:`retain` then drops what the new batch no longer
needs. This is how the pipeline stays BSP-exact across batch boundaries (docs/architecture.md: invariant 2).

Per mini-batch, :meth:`get` and :meth:`apply_gradients` also take device arrays (CuPy, numba,
torch CUDA) and then answer with device arrays, so a trainer on a GPU reads and updates its rows
without leaving the device. Batch-level calls (insert, retain, insert_or_assign) take numpy.

With one table, :meth:`get` answers a mini-batch step's probe with the table's fused sparse path
(:mod:`hpsray.kernels.fused`: lookup and pooling in one pass, the pooled gradient summed per
distinct row), and :meth:`apply_gradients` applies the gradients that path returned at the slots
it found, without looking the keys up again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any, TypeGuard

import numpy as np
import numpy.typing as npt

from hpsray.errors import WorkingSetError
from hpsray.kernels import make_table
from hpsray.kernels.arrays import DeviceArray, array_module, is_device_array, to_host
from hpsray.kernels.fused import LookupProbe, TableLookup, fused_offer
from hpsray.kernels.init import RowInit
from hpsray.kernels.optim import SparseOptimizer
from hpsray.kernels.table import HashTable, Keys, Rows, Values, as_keys
from hpsray.tiers.partition import device_of, group_by


class HbmPS:
    """``D`` hash tables, a key on table ``(h(key) // N) % D``. A trainer process holds one (its
    device's share: docs/architecture.md, Devices); the planner's calibration keeps ``D`` in one.

    Args:
        capacity: rows the node's working set may hold in all (two consecutive batches).
        width: floats per row.
        init: initialiser of rows (only used for rows never pulled, which should not happen).
        n_devices: ``D``.
        n_nodes: ``N``, for the device hash.
        device: ``"cpu"`` or ``"cuda"`` kernels.
    """

    def __init__(
        self, capacity: int, width: int, init: RowInit, n_devices: int = 1, n_nodes: int = 1, device: str = "cpu"
    ) -> None:
        if n_devices < 1:
            raise ValueError(f"n_devices must be >= 1, got {n_devices}")
        self.n_devices, self.n_nodes, self.width = n_devices, n_nodes, width
        # hashing is not perfectly even: give each device some slack over its fair share
        per_device = int(np.ceil(capacity / n_devices * 1.1)) + 64
        self.init, self.device = init, device
        self.tables = [make_table(per_device, width, init, device=device) for _ in range(n_devices)]
        self.grown = 0
        self._fused: tuple | None = None  # (table, keys, grads, slots) of the last fused backward pass

    def _grow(self, d: int, need: int) -> None:
        """Replace device ``d``'s table by one that fits ``need`` more rows (the working set
        outgrew the estimate it was sized by); rows move over unchanged."""
        old = self.tables[d]
        keys, rows = old.export()
        new = make_table(max(2 * old.capacity, old.size + need), self.width, self.init, device=self.device)
        new.insert_or_assign(keys, rows)
        self.tables[d] = new
        self.grown += 1

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tables)

    def _parts(self, keys: npt.NDArray[np.uint64]) -> Iterator[tuple[int, HashTable, npt.NDArray[np.int64] | None]]:
        """``(device, table, positions of its keys)``; positions ``None``: all of them (one
        device, so no gathers and scatters of whole batches of rows)."""
        if self.n_devices == 1:
            yield 0, self.tables[0], None
            return
        order, offsets = group_by(device_of(keys, self.n_nodes, self.n_devices), self.n_devices)
        for d, table in enumerate(self.tables):
            yield d, table, order[offsets[d] : offsets[d + 1]]

    def insert(self, keys: npt.ArrayLike, rows: npt.NDArray[np.float32]) -> int:
        """Insert the working set; keys already resident keep their (fresher) rows.

        Returns how many keys were new.
        """
        keys = as_keys(keys)
        new_total = 0
        for d, table, pos in self._parts(keys):
            k = keys if pos is None else keys[pos]
            new = np.flatnonzero(table.find(k) < 0)
            if new.size:
                if table.size + new.size > table.capacity:
                    self._grow(d, new.size)
                self.tables[d].insert_or_assign(k[new], rows[new if pos is None else pos[new]])
                new_total += new.size
        return new_total

    def erase(self, keys: npt.ArrayLike) -> int:
        """Erase the rows of ``keys`` (absent ones are skipped); returns how many were erased."""
        keys = as_keys(keys)
        return sum(table.erase(keys if pos is None else keys[pos]) for _, table, pos in self._parts(keys))

    def retain(self, keys: npt.ArrayLike) -> int:
        """Erase every resident key not in ``keys``; returns how many were erased."""
        keys = np.sort(as_keys(keys))
        erased = 0
        for table in self.tables:
            resident = table.keys()
            idx = np.searchsorted(keys, resident)
            if keys.size:
                stale = resident[(idx >= keys.size) | (keys[np.minimum(idx, keys.size - 1)] != resident)]
            else:
                stale = resident
            if stale.size:
                erased += table.erase(stale)
        return erased

    @property
    def xp(self) -> ModuleType:
        """The array module of device keys (CuPy; imported only once device keys arrive)."""
        return array_module(self.device)

    def _on_device(self, keys: Keys) -> TypeGuard[DeviceArray]:
        """Whether ``keys`` are device arrays this node's tables take as they are (one table;
        with several, device keys are grouped on the host)."""
        return is_device_array(keys) and self.n_devices == 1

    def get(self, keys: Keys, columns: int | None = None) -> Rows:
        """Rows of resident ``keys`` (``float32[n, width]``; only the first ``columns`` floats
        when given, e.g. the weights for a forward pass). Device keys give device rows."""
        if isinstance(keys, LookupProbe):  # a step asks for the fused path
            lookup = self._fused_lookup(columns)
            if lookup is not None:
                return fused_offer(lookup, columns or self.width)
            keys = np.empty(0, dtype=np.uint64)
        if self._on_device(keys):
            if keys.shape[0] == 0:
                return self.xp.zeros((0, self.width if columns is None else columns), dtype=self.xp.float32)
        else:
            keys = as_keys(to_host(keys))
        if self.n_devices == 1:
            return self.tables[0].get(keys, columns)
        out = np.empty((keys.size, self.width if columns is None else columns), dtype=np.float32)
        for _, table, pos in self._parts(keys):
            out[pos] = table.get(keys[pos], columns)
        return out

    def _fused_lookup(self, columns: int | None) -> Any:
        """The fused path of the one table (``None`` with several, or a table without one)."""
        if self.n_devices != 1:
            return None
        table = self.tables[0]
        if self.device == "cuda":
            from hpsray.kernels.cuda.fused import CudaTableLookup

            return CudaTableLookup(table, columns or self.width, self._remember)
        return TableLookup(table, columns or self.width, self._remember)

    def _remember(self, keys: Any, grads: Any, slots: Any) -> None:
        self._fused = (self.tables[0], keys, grads, slots)

    def _apply_fused(self, keys: Keys, grads: Values, optimizer: SparseOptimizer, step: int) -> bool:
        """Apply the gradients of the last fused backward pass at the slots it found, when
        ``keys`` and ``grads`` are what it returned and every slot still holds its key; returns
        whether it did."""
        if self._fused is None:
            return False
        owner, fkeys, fgrads, slots = self._fused
        self._fused = None
        if keys is not fkeys or grads is not fgrads or owner is not self.tables[0]:
            return False
        table: Any = owner  # a table with the fused path (CpuHashTable, CudaHashTable)
        if not table.holds_at(slots, keys):  # the table changed in between: look the keys up
            return False
        table.apply_at_slots(slots, grads, optimizer, step)
        return True

    def apply_gradients(
        self, keys: Keys, grads: Values, optimizer: SparseOptimizer, step: int, resident_only: bool = False
    ) -> None:
        """Accumulate ``grads`` into the rows of ``keys`` through ``optimizer`` (duplicates summed).

        With ``resident_only``, keys this node does not hold are skipped: across nodes every
        trainer receives every node's updates and applies those to the rows it has. Device
        keys and gradients are applied on the device.
        """
        if self._apply_fused(keys, grads, optimizer, step):  # every key found: resident_only holds too
            return
        on_device = self._on_device(keys)  # then one table, and _parts leaves the keys as they are
        ks: DeviceArray = keys if on_device else as_keys(to_host(keys))  # numpy or device arrays
        gs: DeviceArray = grads if on_device else to_host(grads)
        for _, table, pos in self._parts(ks):
            k, g = (ks, gs) if pos is None else (ks[pos], gs[pos])
            if resident_only and k.shape[0]:
                found = table.find(k)
                held = (self.xp.asarray(found) if on_device else found) >= 0
                if not bool(held.all()):
                    k, g = k[held], g[held]
            if k.shape[0]:
                table.apply_gradients(k, g, optimizer, step)

    def insert_or_assign(self, keys: npt.ArrayLike, rows: npt.NDArray[np.float32]) -> None:
        """Overwrite (or insert) the rows of ``keys``: fresher copies re-read after a write-back."""
        keys = as_keys(keys)
        for d, table, pos in self._parts(keys):
            n = keys.size if pos is None else pos.size
            if n:
                if table.size + n > table.capacity:
                    self._grow(d, n)
                self.tables[d].insert_or_assign(*((keys, rows) if pos is None else (keys[pos], rows[pos])))

    def borrow(
        self,
        keys: npt.ArrayLike,
        rows: npt.NDArray[np.float32],
        refreshed: Iterable[tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]] = (),
        held: npt.NDArray[np.bool_] | None = None,
        stale: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        """Make the batch's loaned rows the working set: rows resident from the previous batch
        are kept (fresher than the loan, docs/architecture.md: invariant 2), resident rows the
        batch does not need are dropped, and ``refreshed`` ``(keys, rows)`` pairs (re-read after
        another node's write-back) overwrite their keys. ``held`` marks the keys whose rows the
        owner did not ship (``rows`` are then those of the other keys): they must be resident.
        ``stale``: when the caller knows the resident keys, those the batch does not need (they
        are erased instead of scanning the table for them). Returns how many of ``keys`` were
        resident already (the working set's hits).

        Raises :class:`~hpsray.errors.WorkingSetError` when a held key is not resident."""
        keys = as_keys(keys)
        hits = 0
        if held is not None and held.any():
            self._check_held(keys[held])
            hits = int(np.count_nonzero(held))
            new = keys[~held]
        else:
            new = keys
        hits += new.size - self.insert(new, rows)
        if stale is None:
            self.retain(keys)
        elif stale.size:
            self.erase(stale)
        for fresh_keys, fresh_rows in refreshed:
            if len(fresh_keys):
                self.insert_or_assign(fresh_keys, fresh_rows)
        return hits

    def _check_held(self, keys: npt.NDArray[np.uint64]) -> None:
        for _, table, pos in self._parts(keys):
            k = keys if pos is None else keys[pos]
            absent = np.flatnonzero(to_host(table.find(k)) < 0)
            if absent.size:
                raise WorkingSetError(int(absent.size), int(k.size), int(k[absent[0]]))
