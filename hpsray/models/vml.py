"""MKL's vector math (VML) resolved once per process, before any call runs on several threads.

torch's CPU build hands the float unary ops of :data:`VML_OPS` to MKL VML, each intra-op thread
calling it on its chunk, and MKL picks a function's kernel at its first call: when that call runs
on two threads at once, one of them can run a low-accuracy kernel over its whole chunk
(pytorch/pytorch#188792; for Adam's first ``sqrt``, thousands of ulp off in some fresh
processes: docs/benchmarks.md). :func:`warm_vml` calls each op once on a few elements (one
thread: below torch's grain), so every later call finds its kernel chosen.
:class:`~hpsray.models.dense_optim.DenseOptimizer` calls it, so every trainer and the reference
have before their first step.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["VML_OPS", "warm_vml"]

VML_OPS = (
    torch.acos,
    torch.asin,
    torch.atan,
    torch.cos,
    torch.erf,
    torch.erfc,
    torch.erfinv,
    torch.exp,
    torch.log,
    torch.log10,
    torch.log2,
    torch.sin,
    torch.sqrt,
    torch.tan,
    torch.tanh,
    torch.trunc,
)
"""The ops this torch build hands to VML (its ``vms*`` / ``vmd*`` calls: ``libtorch_cpu.so``)."""

_lock = threading.Lock()
_warm = False


def warm_vml() -> None:
    """Call each of :data:`VML_OPS` once in float32 and float64 on 16 elements (once per
    process; threads that call at once wait for the first)."""
    global _warm
    if _warm:
        return
    with _lock:
        if _warm:
            return
        for dtype in (torch.float32, torch.float64):
            x = torch.full((16,), 0.5, dtype=dtype)
            for op in VML_OPS:
                op(x)
        _warm = True
