"""Where a training step runs: a torch device and the array module of its keys and rows.

On ``"cpu"`` tensors are torch CPU tensors over numpy arrays; on ``"cuda"`` they are CUDA
tensors over CuPy / numba.cuda device arrays, shared without copies through
``__cuda_array_interface__``. The step code calls :meth:`StepDevice.tensor` and
:meth:`StepDevice.array` and never asks which device it is on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hpsray.kernels.arrays import array_module, is_device_array

__all__ = ["StepDevice"]


class StepDevice:
    """A trainer's device: ``name`` (``"cpu"`` or ``"cuda"``), ``torch`` (a ``torch.device``)
    and ``xp`` (``numpy`` or ``cupy``).

    On CUDA the process's current device is used: one trainer per GPU, and Ray sets
    ``CUDA_VISIBLE_DEVICES`` so that each trainer sees its own GPU as device 0.
    """

    def __init__(self, name: str = "cpu") -> None:
        self.xp = array_module(name)
        if name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch sees no CUDA device here (a CPU build of torch, or no GPU)")
        self.name = name
        self.torch = torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")

    def __repr__(self) -> str:
        return f"StepDevice({self.name!r})"

    def __deepcopy__(self, memo: dict) -> StepDevice:  # a device is not copied with what runs on it
        return self

    def __reduce__(self):  # pickles as its name (the array module is not picklable)
        return (StepDevice, (self.name,))

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def array(self, a: Any) -> Any:
        """``a`` in this device's array module (a host-to-device copy for numpy on CUDA)."""
        return self.xp.asarray(a)

    def tensor(self, a: Any) -> torch.Tensor:
        """``a`` (numpy, CuPy, numba.cuda or torch) as a tensor on this device, sharing memory
        where it already lives there. Read-only numpy arrays (object-store views) are copied,
        since torch tensors are writable."""
        if isinstance(a, torch.Tensor):
            return a.to(self.torch)
        if isinstance(a, np.ndarray):
            if not a.flags.writeable or not a.flags.c_contiguous:
                a = np.array(a, order="C")
            return torch.from_numpy(a).to(self.torch)
        if is_device_array(a):
            return torch.as_tensor(a, device=self.torch)
        return torch.as_tensor(np.asarray(a), device=self.torch)

    def from_tensor(self, t: torch.Tensor) -> Any:
        """A detached tensor of this device as an ``xp`` array, without a copy."""
        t = t.detach()
        return self.xp.asarray(t) if self.is_cuda else t.numpy()
