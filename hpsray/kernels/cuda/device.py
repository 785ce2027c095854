"""Device arrays in and out of the CUDA backend: whether it can run (:func:`cuda_available`,
:func:`simulator_enabled`), what counts as a device array (:func:`is_device_array`), and the
host-or-device inputs of :class:`~hpsray.kernels.cuda.table.CudaHashTable` checked and put on the
device (keys, rows, indices)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from hpsray.kernels.arrays import DeviceArray
from hpsray.kernels.arrays import is_device_array as has_cuda_array_interface
from hpsray.kernels.cuda.common import config, cuda
from hpsray.kernels.table import Keys, Values, as_keys, as_rows


def simulator_enabled() -> bool:
    """Whether numba.cuda runs under its simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(config.ENABLE_CUDASIM)


def cuda_available() -> bool:
    """Whether :class:`~hpsray.kernels.cuda.table.CudaHashTable` can run here: a usable CUDA
    device, or the simulator."""
    try:
        return bool(cuda.is_available())
    except Exception:  # driver present but broken
        return False


_SimArray: tuple[type, ...]  # the simulator's device-array class, or nothing to match
if simulator_enabled():
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    _SimArray = (FakeCUDAArray,)
else:  # pragma: no cover - only without the simulator
    _SimArray = ()


def is_device_array(x: object) -> bool:
    """True for device arrays: numba device arrays, or anything with ``__cuda_array_interface__``."""
    return has_cuda_array_interface(x) or isinstance(x, _SimArray)


def as_device(x: DeviceArray) -> DeviceArray:
    """A numba device-array view of a device array (zero copy)."""
    if isinstance(x, _SimArray) or getattr(x, "__cuda_ndarray__", False):
        return x
    return cuda.as_cuda_array(x)


def device_keys(keys: Keys) -> tuple[DeviceArray, bool, npt.NDArray[np.uint64] | None]:
    """``(device uint64 keys, on_device, host keys or None)`` of host or device ``keys``."""
    if is_device_array(keys):
        d = as_device(keys)
        if d.ndim != 1:
            raise ValueError(f"keys: expected a 1-D array, got shape {d.shape}")
        if d.dtype == np.int64:
            d = d.view(np.uint64)
        elif d.dtype != np.uint64:
            raise TypeError(f"keys: device keys must be uint64 or int64, got dtype {d.dtype}")
        return d, True, None
    host = as_keys(keys)
    return cuda.to_device(host), False, host


def device_values(values: Values, n: int, width: int, name: str) -> DeviceArray:
    """``float32[n, width]`` host or device ``values`` on the device (device ones read in place)."""
    if is_device_array(values):
        d = as_device(values)
        if d.dtype != np.float32:
            raise TypeError(f"{name}: device values must be float32, got dtype {d.dtype}")
        if tuple(d.shape) != (n, width):
            raise ValueError(f"{name}: expected shape ({n}, {width}), got {tuple(d.shape)}")
        if not d.is_c_contiguous():
            raise ValueError(f"{name}: device values must be C-contiguous")
        return d
    return cuda.to_device(as_rows(values, n, width, name))


def device_index(x: npt.ArrayLike | DeviceArray, name: str) -> DeviceArray:
    """An int64 index array (host or device) on the device."""
    if is_device_array(x):
        d = as_device(x)
        if d.dtype != np.int64:
            raise TypeError(f"{name}: expected int64, got {d.dtype}")
        return d
    return cuda.to_device(np.ascontiguousarray(x, dtype=np.int64))
