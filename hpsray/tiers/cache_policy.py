"""Replacement policy of MEM-PS: LRU → LFU with pinning (paper §5, App. D), over slot arrays.

The cache's ``capacity`` slots are split into an LRU region of ``lru_fraction × capacity``
slots and an LFU region holding the rest. Every visited row enters the LRU region (a row
found in the LFU region moves back); when the LRU region overflows, its least recently used
unpinned rows move to the LFU region; when the cache needs room, the LFU region gives up its
least frequently used rows (ties: least recently used). ``lru_fraction=1`` is plain LRU,
``lru_fraction=0`` plain LFU (the rows of the batch in flight are pinned either way).

State is per slot in numpy arrays (region, last-visit tick, frequency, pin count); each call
handles a whole batch of slots and picks victims with ``argpartition`` — no per-row Python.
Frequencies are halved every ``aging × capacity`` visits so that rows that *were* hot give way
to a drifting hot set (the reset of TinyLFU).

:func:`belady_hit_rate` is the offline optimum (evict the row used farthest in the future)
over the same batch-granular trace model, for the cache benchmark; :func:`unbounded_hit_rate`
the ceiling of any capacity (a cache that never evicts misses each key's first use only).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hpsray.errors import CapacityError
from hpsray.kernels.distinct import distinct_sorted
from hpsray.kernels.hashing import mix64

FREE, LRU, LFU = -1, 0, 1

DEFAULT_LRU_FRACTION = 0.25
"""Share of MEM-PS capacity given to the LRU region; measured by ``hpsray bench cache
--sweep`` (docs/tiers.md)."""

DEFAULT_AGING = 16.0
"""Frequencies halve after ``DEFAULT_AGING × capacity`` row visits (measured, docs/tiers.md)."""

DEFAULT_HISTORY = 4.0
"""Counters per sketch row of the frequency history, × capacity (``None``: no history)."""

_EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_SKETCH_SALTS = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], dtype=np.uint64
)


class FrequencySketch:
    """Count-min sketch (depth 4, ``uint16`` counters) of the frequencies of evicted rows, so a
    row that comes back from SSD-PS regains its count instead of restarting at 1 (the history
    TinyLFU keeps). Resident rows count in the policy's own array; the sketch is written when a
    row leaves and read when it returns, so a cache that never evicts never touches it.
    Estimates never undercount what was remembered; :meth:`halve` ages every counter."""

    def __init__(self, counters: int) -> None:
        width = self.width_for(counters)
        self._mask = np.uint64(width - 1)
        self.table = np.zeros((_SKETCH_SALTS.size, width), dtype=np.uint16)

    @staticmethod
    def width_for(counters: int) -> int:
        """Counters per sketch row: ``counters`` rounded up to a power of two."""
        return 1 << max(6, int(np.ceil(np.log2(max(2, counters)))))

    def remember(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Raise each of ``keys``' counters to at least its count (saturating)."""
        _sketch_remember(
            self.table,
            _SKETCH_SALTS,
            self._mask,
            np.ascontiguousarray(keys, dtype=np.uint64),
            np.ascontiguousarray(counts, dtype=np.int64),
        )

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Each key's remembered count (0 for a key never remembered, up to collisions)."""
        est = np.empty(keys.size, dtype=np.int64)
        _sketch_estimate(self.table, _SKETCH_SALTS, self._mask, np.ascontiguousarray(keys, dtype=np.uint64), est)
        return est

    def halve(self) -> None:
        self.table >>= 1

    @property
    def nbytes(self) -> int:
        return self.table.nbytes


@njit(cache=True, nogil=True)
def _sketch_remember(table, salts, mask, keys, counts):
    for d in range(salts.size):
        row = table[d]
        for i in range(keys.size):
            c = mix64(keys[i] ^ salts[d]) & mask
            v = min(counts[i], 0xFFFF)
            if row[c] < v:
                row[c] = v


@njit(cache=True, nogil=True)
def _sketch_estimate(table, salts, mask, keys, est):
    for i in range(keys.size):
        m = 0xFFFF
        for d in range(salts.size):
            v = table[d, mix64(keys[i] ^ salts[d]) & mask]
            if v < m:
                m = v
        est[i] = m


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` smallest ``values`` (unordered)."""
    if k >= values.size:
        return np.arange(values.size)
    return np.argpartition(values, k - 1)[:k]


class LruLfuPolicy:
    """LRU → LFU replacement state of ``capacity`` slots (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        lru_fraction: float = DEFAULT_LRU_FRACTION,
        aging: float | None = DEFAULT_AGING,
        history: float | None = DEFAULT_HISTORY,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0.0 <= lru_fraction <= 1.0:
            raise ValueError(f"lru_fraction must be in [0, 1], got {lru_fraction}")
        if aging is not None and aging <= 0:
            raise ValueError(f"aging must be > 0 (or None for no aging), got {aging}")
        self.capacity = int(capacity)
        self.lru_fraction = float(lru_fraction)
        self.lru_capacity = round(capacity * lru_fraction)
        self.region = np.full(capacity, FREE, dtype=np.int8)
        self.tick = np.zeros(capacity, dtype=np.int64)
        self.freq = np.zeros(capacity, dtype=np.int64)
        self.pins = np.zeros(capacity, dtype=np.int32)
        self.clock = 0
        self.n_lru = 0
        self.n_lfu = 0
        self.n_pinned = 0
        self.aging_window = 0 if aging is None else max(1, int(aging * capacity))
        self._visits = 0
        self.sketch = FrequencySketch(int(history * capacity)) if history else None
        self._remembered = False  # nothing was written to the sketch yet

    @property
    def resident(self) -> int:
        return self.n_lru + self.n_lfu

    def evictable(self, also_pinned: np.ndarray = _EMPTY_SLOTS) -> int:
        """Resident unpinned slots, not counting ``also_pinned`` (slots about to be pinned)."""
        extra = int(np.count_nonzero(self.pins[also_pinned] == 0)) if also_pinned.size else 0
        return self.resident - self.n_pinned - extra

    def touch(self, slots: np.ndarray, keys: np.ndarray | None = None) -> None:
        """Record a visit of ``slots`` (distinct; resident or just admitted) holding ``keys``
        (needed for the frequency history: an admitted row starts from the count it had when it
        was evicted; without keys counts start at 1 on admission)."""
        if slots.size == 0:
            return
        self.clock += 1
        r = self.region[slots]
        self.n_lfu -= int(np.count_nonzero(r == LFU))
        self.n_lru += int(np.count_nonzero(r != LRU))
        self.region[slots] = LRU
        self.tick[slots] = self.clock
        self.freq[slots] += 1  # a released slot's count is 0
        if self._remembered and keys is not None and self.sketch is not None:
            admitted = r == FREE
            if admitted.any():
                self.freq[slots[admitted]] += self.sketch.estimate(keys[admitted])
        if self.aging_window:
            self._visits += slots.size
            if self._visits >= self.aging_window:
                self.freq >>= 1
                if self.sketch is not None:
                    self.sketch.halve()
                self._visits = 0

    def pin(self, slots: np.ndarray) -> None:
        """Pin ``slots`` (distinct) once more."""
        if slots.size:
            self.n_pinned += int(np.count_nonzero(self.pins[slots] == 0))
            self.pins[slots] += 1

    def unpin(self, slots: np.ndarray) -> None:
        """Undo one :meth:`pin` of ``slots``."""
        if slots.size:
            self.pins[slots] -= 1
            self.n_pinned -= int(np.count_nonzero(self.pins[slots] == 0))

    def make_room(self, n_evict: int, incoming: int) -> np.ndarray:
        """Demote LRU overflow (counting ``incoming`` rows about to enter) to the LFU region and
        return ``n_evict`` unpinned victim slots; the caller flushes and :meth:`release`\\ s them."""
        over = self.n_lru + incoming - self.lru_capacity
        if over > 0:
            cand = np.flatnonzero((self.region == LRU) & (self.pins == 0))
            if cand.size:
                demote = cand[_smallest(self.tick[cand], min(over, cand.size))]
                self.region[demote] = LFU
                self.n_lru -= demote.size
                self.n_lfu += demote.size
        if n_evict <= 0:
            return _EMPTY_SLOTS
        cand = np.flatnonzero((self.region == LFU) & (self.pins == 0))
        # least frequent first, then least recent: one int64 key
        order = (np.minimum(self.freq[cand], (1 << 30) - 1) << 32) | (self.tick[cand] & 0xFFFFFFFF)
        victims = cand[_smallest(order, min(n_evict, cand.size))]
        short = n_evict - victims.size
        if short > 0:
            lru = np.flatnonzero((self.region == LRU) & (self.pins == 0))
            if lru.size < short:
                raise CapacityError(f"need {n_evict} evictable rows, only {victims.size + lru.size} are unpinned")
            victims = np.concatenate([victims, lru[_smallest(self.tick[lru], short)]])
        return victims

    def release(self, slots: np.ndarray, keys: np.ndarray | None = None) -> None:
        """Forget evicted ``slots`` (unpinned); the sketch remembers the counts of their
        ``keys`` (when given) for their return."""
        if self.sketch is not None and keys is not None and slots.size:
            self.sketch.remember(keys, self.freq[slots])
            self._remembered = True
        r = self.region[slots]
        self.n_lru -= int(np.count_nonzero(r == LRU))
        self.n_lfu -= int(np.count_nonzero(r == LFU))
        self.region[slots] = FREE
        self.freq[slots] = 0
        self.tick[slots] = 0


def unbounded_hit_rate(trace: list[np.ndarray], count_from: int = 0) -> dict:
    """Hit rate of a cache that never evicts on a trace of batches (each an array of keys): a
    batch's distinct key hits when an earlier batch named it. No capacity does better; the
    misses left are first uses (compulsory). Counted from batch ``count_from`` on (the
    batches before it only warm the cache), over distinct keys per batch, as MEM-PS counts."""
    batches = [distinct_sorted(np.asarray(b, dtype=np.uint64)) for b in trace]
    if not batches:
        return {"hits": 0, "accesses": 0, "hit_rate": 0.0}
    keys = np.concatenate(batches)
    when = np.repeat(np.arange(len(batches), dtype=np.int64), [b.size for b in batches])
    first = np.zeros(keys.size, dtype=bool)
    first[np.unique(keys, return_index=True)[1]] = True  # the earliest batch naming each key
    counted = when >= count_from
    total = int(np.count_nonzero(counted))
    hits = int(np.count_nonzero(counted & ~first))
    return {"hits": hits, "accesses": total, "hit_rate": hits / total if total else 0.0}


def belady_hit_rate(trace: list[np.ndarray], capacity: int, count_from: int = 0) -> dict:
    """Hit rate of the offline optimum on a trace of batches (each an array of keys), counted
    from batch ``count_from`` on (the batches before it only warm the cache).

    Model (the same as MEM-PS): a batch's distinct keys must all be resident while it runs;
    misses are admitted, and when room is needed the resident rows not in the batch whose next
    use is farthest away are evicted (Belady's MIN, which is optimal for this model).
    """
    from hpsray.kernels.cpu import CpuHashTable

    batches = [distinct_sorted(np.asarray(b, dtype=np.uint64)) for b in trace]
    sizes = np.array([b.size for b in batches], dtype=np.int64)
    if sizes.size and sizes.max() > capacity:
        raise CapacityError(f"a batch has {sizes.max()} distinct keys, capacity is {capacity}")
    keys = np.concatenate(batches) if batches else np.empty(0, np.uint64)
    when = np.repeat(np.arange(len(batches), dtype=np.int64), sizes)
    order = np.lexsort((when, keys))
    nxt = np.full(keys.size, np.iinfo(np.int64).max, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = when[order[1:][same]]
    index = CpuHashTable(capacity, 0)
    next_use = np.zeros(capacity, dtype=np.int64)
    slot_key = np.zeros(capacity, dtype=np.uint64)
    in_batch = np.zeros(capacity, dtype=bool)
    hits = 0
    start = 0
    for t, b in enumerate(batches):
        nb = nxt[start : start + b.size]
        start += b.size
        slots = index.find(b)
        hit = slots >= 0
        if t >= count_from:
            hits += int(np.count_nonzero(hit))
        miss = b[~hit]
        need = index.size + miss.size - capacity
        if need > 0:
            in_batch[slots[hit]] = True
            occupied = np.flatnonzero(slot_key != 0)  # keys stored +1, so 0 marks free
            cand = occupied[~in_batch[occupied]]
            victims = cand[np.argpartition(-next_use[cand], need - 1)[:need]]
            in_batch[slots[hit]] = False
            index.erase(slot_key[victims] - np.uint64(1))
            slot_key[victims] = 0
        new = index.find_or_insert(miss)
        slot_key[new] = miss + np.uint64(1)
        slots[~hit] = new
        next_use[slots] = nb
    total = int(sizes[count_from:].sum())
    return {"hits": hits, "accesses": total, "hit_rate": hits / total if total else 0.0}
