"""Feature admission and expiry: which keys get a row, and when a row is dropped
(docs/architecture.md: Admission and expiry).

As production CTR systems do, a key gets a row only once it has been *seen* in ``admit_after``
batches, and a row whose key has not been seen for ``expire_after_batches`` batches is dropped
from every tier. "Seen" counts batches, not examples: a key seen in batch ``b`` counts once
for ``b`` however many examples, borrowers or nodes had it, which is what an owner's MEM-PS
can count exactly (it lends each key once per borrower per batch) and what the reference
trainer counts over the same global batch. The counts are exact (a key → count table, not a
sketch), so the pipeline and the reference make the same decisions bit for bit.

:class:`Admission` is that table, Ray-free: :meth:`Admission.see` counts a batch's keys and
answers which are admitted; :meth:`Admission.expire` forgets the keys last seen too long
ago and names those that had rows. The owner (:class:`~hpsray.tiers.lending.Lender`) and
:class:`~hpsray.reference.ReferenceTrainer` apply the rules around it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hpsray.admission_rules import check_admission
from hpsray.kernels.cpu import CpuHashTable
from hpsray.kernels.distinct import is_sorted_distinct
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.table import as_keys
from hpsray.tiers.tagcount import N_TAGS

__all__ = ["Admission"]

_NEVER = np.iinfo(np.int64).min  # "last seen" of a key inserted by the current call
_NO_EXPIRY = 1 << 62  # a table that never expires its keys: no batch is that far on
_EMPTY_KEYS = np.empty(0, dtype=np.uint64)
# bytes per tracked key: hash buckets (2 × 16 at load 0.5) + the index's own key, free stack and
# chain arrays (24) + our key, count and last-seen arrays (20)
BYTES_PER_KEY = 76


class Admission:
    """Exact per-key batch counts and last-seen batches, for admission and expiry.

    Args:
        admit_after: a key is admitted (gets a row, and its updates are kept) from the batch in
            which it has been seen in ``admit_after`` batches on; ``0`` and ``1`` admit every key.
        expire_after_batches: at the end of batch ``b`` every key last seen in batch
            ``b - expire_after_batches`` or earlier is forgotten: its row is dropped and its count
            starts again at its next sighting (``None``: never).
        capacity: keys tracked before the table first grows (it doubles as needed).
        per_table: tables of their own admission (keys tagged with their table,
            :mod:`hpsray.tables`): table ``t``'s ``(admit_after, expire_after_batches)`` for its
            keys, in place of the two above (a table with neither admits every key and never
            forgets it).

    Batch ids are integers that grow by one per batch (the pipeline's, continued across passes).
    """

    def __init__(
        self,
        admit_after: int = 0,
        expire_after_batches: int | None = None,
        capacity: int = 1024,
        per_table: Sequence[tuple[int, int | None]] | None = None,
    ) -> None:
        check_admission(admit_after, expire_after_batches)
        self.admit_after = int(admit_after)
        self.expire_after = None if expire_after_batches is None else int(expire_after_batches)
        self._need = max(self.admit_after, 1)
        self.per_table = (
            None if per_table is None else tuple((int(a), e if e is None else int(e)) for a, e in per_table)
        )
        self._need_tag = self._expire_tag = None
        if self.per_table is not None:  # by key tag: a table's need and expiry (never: _NO_EXPIRY)
            for admit, expire in self.per_table:
                check_admission(admit, expire)
            self._need_tag = np.ones(N_TAGS, np.int32)
            self._expire_tag = np.full(N_TAGS, _NO_EXPIRY, np.int64)
            for t, (admit, expire) in enumerate(self.per_table):
                self._need_tag[t] = max(admit, 1)
                self._expire_tag[t] = _NO_EXPIRY if expire is None else expire
            self.admit_after = max(a for a, _ in self.per_table)
            expiries = [e for _, e in self.per_table if e is not None]
            self.expire_after = min(expiries) if expiries else None  # whether anything expires at all
        self._alloc(max(int(capacity), 16))
        self._expired_through: int | None = None
        self.totals = {"admitted": 0, "rejected": 0, "expired": 0, "forgotten": 0}

    def _need_of(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.int32] | int:
        """Sightings each key needs to be admitted."""
        if self._need_tag is None:
            return self._need
        return self._need_tag[(keys >> np.uint64(56)).astype(np.int64)]

    def _alloc(self, capacity: int) -> None:
        self._index = CpuHashTable(capacity, 0)
        self._key = np.full(capacity, EMPTY_KEY, dtype=np.uint64)
        self._count = np.zeros(capacity, dtype=np.int32)
        self._last = np.full(capacity, _NEVER, dtype=np.int64)

    @property
    def enabled(self) -> bool:
        """Whether either rule is on (else every key is admitted and nothing expires)."""
        return self.admit_after > 1 or self.expire_after is not None

    @property
    def size(self) -> int:
        """Keys tracked (seen and not expired)."""
        return self._index.size

    def __len__(self) -> int:
        return self.size

    def _grow(self, extra: int) -> None:
        need = self._index.size + extra
        if need <= self._index.capacity:
            return
        occupied = np.flatnonzero(self._key != EMPTY_KEY)
        keys, count, last = self._key[occupied], self._count[occupied], self._last[occupied]
        self._alloc(max(need, 2 * self._index.capacity))
        slots = self._index.find_or_insert(keys)
        self._key[slots], self._count[slots], self._last[slots] = keys, count, last

    def see(self, batch: int, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Count ``keys`` (distinct) as seen in ``batch`` and return which are admitted there.

        A key counts once per batch however often it is passed for that batch (an owner lends
        it to several borrowers). A key reaching ``admit_after`` sightings is admitted from this
        batch on; it stays admitted until it expires.
        """
        keys = as_keys(keys)
        if not is_sorted_distinct(keys):
            uk, inv = np.unique(keys, return_inverse=True)
            if uk.size != keys.size:
                return self.see(batch, uk)[inv]
        batch = int(batch)
        self._grow(keys.size)
        slots = self._index.find(keys)
        miss = slots < 0
        if miss.any():
            new = self._index.find_or_insert(keys[miss])
            self._key[new] = keys[miss]
            self._count[new] = 0
            self._last[new] = _NEVER
            slots[miss] = new
        first = self._last[slots] != batch
        fs = slots[first]
        need = self._need_of(keys)
        need_fs = need if isinstance(need, int) else need[first]
        before = self._count[fs]
        after = np.minimum(before + 1, need_fs).astype(np.int32)
        self._count[fs] = after
        self._last[fs] = batch
        admitted = self._count[slots] >= need
        self.totals["admitted"] += int(np.count_nonzero((before < need_fs) & (after >= need_fs)))
        self.totals["rejected"] += int(np.count_nonzero(first & ~admitted))
        return admitted

    def admitted(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Whether each key is admitted now (no counting)."""
        keys = as_keys(keys)
        slots = self._index.find(keys)
        out = slots >= 0
        need = self._need_of(keys[out])
        out[out] = self._count[slots[out]] >= need
        return out

    def expire(self, through: int) -> npt.NDArray[np.uint64]:
        """Forget the keys that expire at the end of batch ``through`` (last seen in batch
        ``through - expire_after_batches`` or before) and return those that had rows (admitted),
        sorted. Idempotent: a batch already expired through returns nothing."""
        through = int(through)
        if self.expire_after is None or (self._expired_through is not None and through <= self._expired_through):
            return _EMPTY_KEYS
        self._expired_through = through
        live = self._key != EMPTY_KEY
        if self._expire_tag is None:
            slots = np.flatnonzero((self._last <= through - self.expire_after) & live)
        else:  # each key by its table's expiry
            after = self._expire_tag[(self._key >> np.uint64(56)).astype(np.int64)]
            slots = np.flatnonzero((self._last <= through - after) & live)
        if slots.size == 0:
            return _EMPTY_KEYS
        keys = self._key[slots]
        had_row = self._count[slots] >= self._need_of(keys)
        self._index.erase(keys)
        self._key[slots] = EMPTY_KEY
        self._count[slots] = 0
        self._last[slots] = _NEVER
        gone = np.sort(keys[had_row])
        self.totals["expired"] += int(gone.size)
        self.totals["forgotten"] += int(slots.size - gone.size)
        return gone

    @property
    def stats(self) -> dict:
        """``admitted`` (keys given a row; again after expiring), ``rejected`` (sightings of a
        key in a batch that gave it no row), ``expired`` (rows dropped), ``forgotten`` (counts of
        keys never admitted dropped for expiry) and ``tracked`` (keys counted now)."""
        return {**self.totals, "tracked": self.size}

    # -- state, for checkpoints ----------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """The whole table as arrays (see :meth:`restore`)."""
        occupied = np.flatnonzero(self._key != EMPTY_KEY)
        through = -1 if self._expired_through is None else self._expired_through
        return {
            "keys": self._key[occupied].copy(),
            "count": self._count[occupied].copy(),
            "last": self._last[occupied].copy(),
            "settings": self._settings(),
            "expired_through": np.array([through, self._expired_through is not None], np.int64),
            "totals": np.array([self.totals[k] for k in sorted(self.totals)], np.int64),
        }

    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Replace the table by a :meth:`state` (of an Admission with the same settings)."""
        settings = np.asarray(state["settings"], np.int64)
        if not np.array_equal(settings, self._settings()):
            raise ValueError(
                f"admission state of settings {settings.tolist()} (admit_after, expire_after_batches; then per "
                f"table) restored into {self._settings().tolist()}"
            )
        keys = as_keys(state["keys"])
        self._alloc(max(16, 2 * keys.size))
        slots = self._index.find_or_insert(keys)
        self._key[slots], self._count[slots], self._last[slots] = keys, state["count"], state["last"]
        through, known = (int(v) for v in state["expired_through"])
        self._expired_through = through if known else None
        self.totals = dict(zip(sorted(self.totals), (int(v) for v in state["totals"])))

    def _settings(self) -> npt.NDArray[np.int64]:
        """``admit_after, expire_after_batches`` (-1: never), then each table's pair."""
        pairs = [(self.admit_after, self.expire_after)] + list(self.per_table or ())
        return np.array([v for a, e in pairs for v in (a, -1 if e is None else e)], np.int64)

    def save(self, path: str | os.PathLike) -> int:
        """Write :meth:`state` to ``path`` (``.npz``, fsynced); returns its bytes."""
        tmp = os.fspath(path) + ".tmp"
        with open(tmp, "wb") as f:
            st = self.state()
            np.savez(
                f,
                keys=st["keys"],
                count=st["count"],
                last=st["last"],
                settings=st["settings"],
                expired_through=st["expired_through"],
                totals=st["totals"],
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return os.path.getsize(path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore the table :meth:`save` wrote to ``path``."""
        with np.load(path) as data:
            self.restore({k: data[k] for k in data.files})

    def __repr__(self) -> str:
        return (
            f"Admission(admit_after={self.admit_after}, expire_after_batches={self.expire_after}, tracked={self.size})"
        )
