"""Hash-table and sparse-optimizer kernels: one interface, CPU (numba) and CUDA backends."""

from __future__ import annotations

from hpsray.kernels.cpu import CpuHashTable
from hpsray.kernels.init import RowInit
from hpsray.kernels.optim import SGD, Adagrad, Adam, SparseOptimizer, make_optimizer
from hpsray.kernels.table import HashTable

DEVICES = ("cpu", "cuda")

__all__ = [
    "HashTable",
    "CpuHashTable",
    "RowInit",
    "SGD",
    "Adagrad",
    "Adam",
    "SparseOptimizer",
    "make_optimizer",
    "make_table",
]


def make_table(
    capacity: int, width: int, init: RowInit | None = None, device: str = "cpu", **options: int | None
) -> HashTable:
    """A :class:`HashTable` on ``device``: ``"cpu"`` (numba) or ``"cuda"`` (numba.cuda; also runs
    under the simulator, ``NUMBA_ENABLE_CUDASIM=1``). ``options`` go to the backend's constructor
    (e.g. ``threads_per_block`` for CUDA)."""
    if device == "cpu":
        return CpuHashTable(capacity, width, init, **options)
    if device == "cuda":
        try:
            from hpsray.kernels.cuda import CudaHashTable, cuda_available
        except ImportError as exc:
            raise RuntimeError(f"device='cuda' needs numba-cuda (pip install 'numba-cuda[cu12]'): {exc}") from exc
        if not cuda_available():
            raise RuntimeError(
                "device='cuda' but no CUDA device is available here; use device='cpu', or set "
                "NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported to run on numba's simulator"
            )
        return CudaHashTable(capacity, width, init, **options)
    raise ValueError(f"unknown device {device!r}; choose one of {', '.join(map(repr, DEVICES))}")
