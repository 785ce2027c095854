"""OP+OSRP: one permutation hashing + one sign random projection (HierPS paper §2).

The paper's "Hash+DNN" baseline shrinks the ~10^11-dimensional binary feature vector of an
example before a DNN: one random permutation of the feature space is cut into ``k`` equal bins
(one permutation hashing), and within each bin the features present are summed with random
±1 weights and only the sign of the sum is kept (one sign random projection). An example so
becomes a binary vector of dimension ``2k`` with one non-zero per non-empty bin: feature
``2 b + bit`` for bin ``b``. Trained against the full model, it measures the AUC that hashing
costs.

Here a key's bin and sign come from two independent 64-bit mixes of the key (a random
permutation followed by an even cut is, for keys, a uniform hash to a bin). The output keys are
``hash_keys(out_slot, 2 b + bit)``, so the transformed batch goes through the same parameter
server; ``out_slots`` groups the bins into that many pooled slots (1: a single bag, i.e. a plain
sparse input layer over the ``2k``-dimensional vector).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numba as nb
import numpy as np

from hpsray.data.batch import Batch
from hpsray.data.keys import hash_keys, slot_salt
from hpsray.kernels.hashing import EMPTY_KEY, mix64, mix64_array

_BIN_SALT = np.uint64(0x8CB92BA72F3D8DD7)
_SIGN_SALT = np.uint64(0xB492B66FBE98F273)


@nb.njit(cache=True)
def _op_osrp(keys, offsets, k, out_slots, bin_seed, sign_seed, salts, out_keys, out_slots_arr, out_offsets):
    n = offsets.shape[0] - 1
    acc = np.zeros(k, np.int64)
    stamp = np.full(k, -1, np.int64)
    touched = np.empty(k, np.int64)
    pos = 0
    out_offsets[0] = 0
    for i in range(n):
        t = 0
        for p in range(offsets[i], offsets[i + 1]):
            key = keys[p]
            b = np.int64(mix64(key ^ bin_seed) % np.uint64(k))
            sign = 1 if (mix64(key ^ sign_seed) >> np.uint64(63)) == np.uint64(0) else -1
            if stamp[b] != i:
                stamp[b] = i
                acc[b] = 0
                touched[t] = b
                t += 1
            acc[b] += sign
        bins = np.sort(touched[:t])
        for j in range(t):
            b = bins[j]
            bit = np.uint64(1) if acc[b] > 0 else np.uint64(0)  # ties (sum 0) give bit 0
            slot = (b * out_slots) // k
            v = np.uint64(2 * b) + bit
            kk = mix64(v ^ salts[slot])
            if kk == EMPTY_KEY:
                kk = EMPTY_KEY - np.uint64(1)
            out_keys[pos] = kk
            out_slots_arr[pos] = slot
            pos += 1
        out_offsets[i + 1] = pos
    return pos


@dataclass(frozen=True)
class OPOSRP:
    """The OP+OSRP transform with ``k`` bins; call it on a :class:`Batch` (see module docstring).

    Labels and dense features pass through; each example keeps at most ``k`` keys (one per
    non-empty bin) in ``out_slots`` slots, drawn from ``2 k`` possible features.
    """

    k: int
    out_slots: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"osrp.k: must be a positive integer, got {self.k!r}")
        if isinstance(self.out_slots, bool) or not isinstance(self.out_slots, int) or not 1 <= self.out_slots <= self.k:
            raise ValueError(f"osrp.out_slots: must be an integer in [1, k={self.k}], got {self.out_slots!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "osrp") -> OPOSRP:
        known = {"k", "out_slots", "seed"}
        for key, value in d.items():
            if key not in known:
                raise ValueError(f"{where}.{key}: unknown key (known: k, out_slots, seed)")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}.{key}: must be an integer, got {value!r}")
        if "k" not in d:
            raise ValueError(f"{where}.k: missing (the number of bins)")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(str(e).replace("osrp.", f"{where}.", 1)) from None

    @property
    def dim(self) -> int:
        """Dimension of the hashed binary feature vector."""
        return 2 * self.k

    def feature_keys(self) -> np.ndarray:
        """``uint64[2k]``: the key of feature ``f = 2 b + bit`` (bin ``b``), indexed by ``f``."""
        f = np.arange(2 * self.k, dtype=np.uint64)
        slots = (np.arange(2 * self.k) // 2 * self.out_slots) // self.k
        return hash_keys(slots, f)

    def __call__(self, batch: Batch) -> Batch:
        seed = np.array([self.seed], np.uint64)
        bin_seed = mix64_array(seed ^ _BIN_SALT)[0]
        sign_seed = mix64_array(seed ^ _SIGN_SALT)[0]
        salts = slot_salt(np.arange(self.out_slots)).astype(np.uint64)
        n = len(batch)
        cap = int(min(batch.nnz, n * self.k))
        out_keys = np.empty(cap, np.uint64)
        out_slots = np.empty(cap, np.int32)
        out_offsets = np.empty(n + 1, np.int64)
        m = _op_osrp(
            batch.keys,
            batch.offsets,
            self.k,
            self.out_slots,
            bin_seed,
            sign_seed,
            salts,
            out_keys,
            out_slots,
            out_offsets,
        )
        return Batch(batch.labels, batch.dense, out_keys[:m], out_offsets, out_slots[:m], self.out_slots)
