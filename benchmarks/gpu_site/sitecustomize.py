"""Put first on ``PYTHONPATH`` by ``benchmarks/gpu_check`` for every Python it starts (and by
tests/test_gpu_check.py). Two things, then the interpreter's own ``sitecustomize`` (if any) runs:

- ``numpy.row_stack`` again where NumPy dropped it (2.5): numba-cuda's array overloads name it
  when ``numba.cuda`` is imported on a real device.
- ``HPSRAY_BLOCK_IMPORTS=ray,hypothesis,...``: those top-level packages fail to import
  (``ModuleNotFoundError``), as on a GPU machine without them; for checking that the check and
  the test collection get by without them.
"""

import importlib.machinery
import importlib.util
import os
import sys

try:
    import numpy as _np

    if not hasattr(_np, "row_stack"):
        _np.row_stack = _np.vstack
except ImportError:
    pass

_BLOCKED = {name.strip() for name in os.environ.get("HPSRAY_BLOCK_IMPORTS", "").split(",") if name.strip()}


if _BLOCKED:  # refused where every finder (pytest's assertion rewriter too) looks on sys.path
    _path_find_spec = importlib.machinery.PathFinder.find_spec

    def _find_spec(cls, name, path=None, target=None):
        if name.split(".", 1)[0] in _BLOCKED:
            return None
        return _path_find_spec(name, path, target)

    importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _next is not None and _next.loader is not None:  # the interpreter's own sitecustomize, as if alone
    _mod = importlib.util.module_from_spec(_next)
    _next.loader.exec_module(_mod)
