"""What every family of CUDA kernels shares: the constants they compile in, and numba's modules.

``cuda`` and ``config`` are numba's own ``numba.cuda`` and ``numba.config``, bound to names typed
``Any``. numba and numba-cuda ship ``py.typed``, but their declarations do not describe the kernel
dialect (``cuda.grid`` is an intrinsic whose declared ``__call__`` also takes numba's typing
context; ``numba.config`` sets its attributes at run time), so mypy, which checks the bodies of
the unannotated kernels, would report every ``cuda.grid(1)``. numba resolves a kernel's globals by
value when it compiles it, so ``cuda.grid`` through this name is the very same intrinsic: the
compiled kernels do not change. The kernels themselves stay unannotated: numba types them from
the arguments of each launch, and an annotation would only repeat that with less precision.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import cuda as _numba_cuda

from hpsray.kernels.hashing import EMPTY_KEY

cuda: Any = _numba_cuda
config: Any = numba.config

EMPTY = EMPTY_KEY
BIG = np.int64(1 << 62)  # pending bucket slots hold (first input index - BIG) < -1
MAXI = np.int64(np.iinfo(np.int64).max)
MAX_TPB = 1024
CHUNK = 32  # elements per thread in scans and radix passes
