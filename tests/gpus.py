"""Whether a real CUDA device is usable here (torch, CuPy and numba-cuda all see it), for the
``gpu``-marked tests of several modules."""

import pytest
import torch


def cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - any missing piece means: no usable GPU here
        return False


CUDA = cuda_ready()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device with torch, CuPy and numba-cuda")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
