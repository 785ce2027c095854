"""The ``HashTable`` interface shared by the CPU (numba) and CUDA backends.

A table maps ``uint64`` keys to rows of a fixed-capacity arena ``float32[capacity, width]``.
Lookups return *slots* (row indices into the arena, ``int64``; -1 when absent). A key keeps its
slot until it is erased. The verbs are HierarchicalKV's: ``find``, ``find_or_insert``,
``insert_or_assign`` (absent keys are inserted), ``assign`` (present keys only), ``erase``,
``export``; by slot, ``gather`` and ``put``; and the sums ``scatter_add`` and
``apply_gradients`` (present keys only). Every operation takes arrays of keys and is correct
when a call holds the same key several times:

* ``find_or_insert``: each distinct key is inserted once;
* ``scatter_add`` and ``apply_gradients``: the values of duplicates are summed (in input
  order) before they are applied, so a row sees one update per call;
* ``assign``, ``insert_or_assign`` and ``put``: the last occurrence wins.

The arena is the capacity limit: inserting past it raises :class:`TableFullError` without
changing the table. Probing, bucket load and why: docs/architecture.md, section "Hash table".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from hpsray.errors import TableFullError  # noqa: F401 - re-exported: cpu.py and cuda.py raise it from here
from hpsray.kernels.arrays import DeviceArray
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.init import RowInit
from hpsray.kernels.optim import SparseOptimizer

MAX_BUCKET_LOAD = 0.5

Keys: TypeAlias = "npt.ArrayLike | DeviceArray"
"""Keys as a table method takes them: anything :func:`as_keys` accepts (integers, ``uint64``
wanted), or on the CUDA backend a device array of ``uint64``/``int64``."""
Values: TypeAlias = "npt.ArrayLike | DeviceArray"
"""Rows or gradients as a table method takes them: ``float32[n, width]`` (or ``[n, dim]``), on
the host or, on the CUDA backend, on the device."""
Slots: TypeAlias = "npt.NDArray[np.int64] | DeviceArray"
"""Slots (``int64``, -1 for an absent key) as :meth:`HashTable.find` answers them and
:meth:`HashTable.gather` takes them: numpy for numpy keys; device arrays for device keys."""
Rows: TypeAlias = "npt.NDArray[np.float32] | DeviceArray"
"""Rows (``float32[n, width]``) as :meth:`HashTable.gather` answers them: numpy for numpy slots,
device arrays for device slots."""


def bucket_count(capacity: int, max_load: float = MAX_BUCKET_LOAD) -> int:
    """Power-of-two bucket count keeping the bucket load at most ``max_load`` for a full arena."""
    if not 0 < max_load < 1:
        raise ValueError(f"max bucket load must lie in (0, 1), got {max_load}")
    return 1 << max(4, int(np.ceil(np.log2(capacity / max_load + 1))))


def as_keys(keys: npt.ArrayLike, name: str = "keys") -> npt.NDArray[np.uint64]:
    """Keys as a contiguous ``uint64`` array; refuses other types and the empty marker."""
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.dtype != np.uint64:
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name}: expected integer keys, got dtype {arr.dtype}")
        if arr.size and np.issubdtype(arr.dtype, np.signedinteger) and arr.min() < 0:
            raise ValueError(f"{name}: negative key {arr.min()}")
        arr = arr.astype(np.uint64)
    if arr.size and np.any(arr == EMPTY_KEY):
        raise ValueError(f"{name}: key 0xFFFFFFFFFFFFFFFF is reserved as the empty marker")
    return np.ascontiguousarray(arr)


def readonly(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only view (no copy). numba compiles one machine code per writability of
    an array argument, and arrays from Ray's object store are read-only: kernels take the arrays
    they only read through this, so one compiled version serves both (a start's compile time)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def as_rows(values: npt.ArrayLike, n: int, width: int, name: str) -> npt.NDArray[np.float32]:
    """``values`` as contiguous ``float32[n, width]``, with a clear error on a shape mismatch."""
    arr = np.ascontiguousarray(values, dtype=np.float32)
    if arr.shape != (n, width):
        raise ValueError(f"{name}: expected shape ({n}, {width}), got {arr.shape}")
    return arr


class HashTable(ABC):
    """Fixed-capacity ``uint64`` → ``float32[width]`` hash table (see module docstring).

    Args:
        capacity: number of rows in the arena (the most keys the table holds).
        width: floats per row (embedding ``dim`` plus optimizer state).
        init: how rows of new keys are filled; zeros when ``None``.
    """

    def __init__(self, capacity: int, width: int, init: RowInit | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if width < 0:
            raise ValueError(f"width must be >= 0, got {width}")
        init = init or RowInit(dim=0, scale=0.0)
        if init.dim > width:
            raise ValueError(f"init.dim={init.dim} exceeds row width {width}")
        self._capacity = int(capacity)
        self._width = int(width)
        self.init = init

    @property
    def capacity(self) -> int:
        """Most keys the table can hold."""
        return self._capacity

    @property
    def width(self) -> int:
        """Floats per row."""
        return self._width

    @property
    @abstractmethod
    def size(self) -> int:
        """Number of keys held."""

    @property
    def load_factor(self) -> float:
        """``size / capacity``."""
        return self.size / self.capacity

    def __len__(self) -> int:
        return self.size

    @abstractmethod
    def find(self, keys: Keys) -> Slots:
        """Slot of each key, -1 where absent."""

    @abstractmethod
    def find_or_insert(self, keys: Keys, initialise: bool = True) -> Slots:
        """Slot of each key, inserting absent keys with their initial rows (left unwritten with
        ``initialise=False``, for a caller that overwrites them at once with :meth:`put`).

        Raises :class:`TableFullError` (and leaves the table unchanged) if the distinct new
        keys do not fit.
        """

    @abstractmethod
    def gather(self, slots: Slots, columns: int | None = None) -> Rows:
        """Rows at ``slots`` as ``float32[n, width]`` (only their first ``columns`` floats when
        given: the weights without the optimizer state); a negative slot raises ``KeyError``."""

    @abstractmethod
    def put(self, slots: Slots, values: Values) -> None:
        """Overwrite the rows at ``slots`` (from :meth:`find` / :meth:`find_or_insert`) with
        ``values``, the write that mirrors :meth:`gather` (last duplicate wins); a slot that is
        not a row raises ``KeyError``."""

    @abstractmethod
    def scatter_add(self, keys: Keys, values: Values) -> None:
        """Add ``values[i]`` to the row of ``keys[i]``; every key must be present."""

    @abstractmethod
    def assign(self, keys: Keys, values: Values) -> None:
        """Set the rows of ``keys``, all of which must be present, to ``values`` (last duplicate
        wins); an absent key raises ``KeyError`` and nothing is written."""

    @abstractmethod
    def insert_or_assign(self, keys: Keys, values: Values) -> None:
        """Set the rows of ``keys`` to ``values``, inserting absent keys (last duplicate wins)."""

    @abstractmethod
    def erase(self, keys: Keys) -> int:
        """Remove ``keys`` (absent ones are ignored); returns how many were removed."""

    @abstractmethod
    def export(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        """All ``(keys uint64[size], rows float32[size, width])``, ordered by slot."""

    def keys(self) -> npt.NDArray[np.uint64]:
        """All keys held, ordered by slot (``export()`` without copying the rows)."""
        return self.export()[0]

    @abstractmethod
    def apply_gradients(self, keys: Keys, grads: Values, optimizer: SparseOptimizer, step: int) -> None:
        """Apply ``optimizer`` at global ``step`` to the rows of ``keys`` with gradients
        ``grads`` (``float32[n, dim]``, ``dim = init.dim``); duplicates are summed first."""

    def get(self, keys: Keys, columns: int | None = None) -> Rows:
        """Rows of ``keys`` (first ``columns`` floats), all of which must be present (``find``
        then ``gather``)."""
        return self.gather(self.find(keys), columns)


def check_columns(columns: int | None, width: int) -> int:
    """How many leading floats of each row a gather returns (all when ``None``)."""
    if columns is None:
        return width
    if not 0 < columns <= width:
        raise ValueError(f"gather: columns must be in 1..{width} (the row width), got {columns}")
    return int(columns)


def missing_key_error(keys: npt.NDArray[np.uint64], slots: npt.NDArray[np.int64], op: str) -> KeyError:
    """A ``KeyError`` naming how many keys were absent and the first of them."""
    absent = np.flatnonzero(slots < 0)
    return KeyError(f"{op}: {absent.size} of {keys.size} keys are not in the table (first: {int(keys[absent[0]])})")
