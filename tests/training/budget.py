"""What a mini-batch launches and reads back, counted on the CPU (the twin of a CUDA device).

:func:`tally` runs a function under torch's profiler and counts, inside every range the
strategies mark as a mini-batch (:data:`hpsray.training.marks.MINIBATCH`):

- **launches**: aten ops that are no view, allocation or metadata and are not called by another
  aten op (on CUDA each is at least one kernel launch);
- **read-backs**: anywhere in the profiler tree, an op that reads a value back to the host or
  syncs on CUDA (``aten::item``, ``aten::_local_scalar_dense``, ``nonzero``, ``unique``,
  ``masked_select``, ...), and every ``Tensor.tolist`` / ``.item`` / ``.cpu`` / ``.numpy`` call
  (made visible as ``readback::<name>`` ranges; ``StepDevice.from_tensor``'s zero-copy numpy
  view, the twin of a CuPy view, is none);
- **numba** calls made from Python to a kernel of an ``hpsray`` module (``numba::<name>``);
- **forbidden** ops: sorts and dedupes (a mini-batch must not sort or dedupe its keys).

An op hpsray registers with ``torch.library`` (``hpsray::...``: the fused sparse update) counts as
one launch, as an aten op does; what runs inside it (its numba kernel, the zero-copy numpy views
of its tensors: on CUDA a kernel launch on device pointers) is its implementation, not counted.

Ops inside a range marked as a host step (:data:`hpsray.training.marks.HOST_STEP`: a relaxed
mode's publish, stated in docs/architecture.md's budget table) are counted apart. A check fails
on the fault it guards against: tests/training/test_budgets.py injects each.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from hpsray.models.device import StepDevice
from hpsray.training.marks import HOST_STEP, MINIBATCH

# launching ops per mini-batch of each path (tests/training/paths.py: dim 16, a 32-16 MLP, dense
# Adam; measured in docs/architecture.md's budget table). ``local`` steps with the fused sparse
# update (the CPU default); ``local_unfused`` is the same path with it off (the CUDA default)
LAUNCHES = {"local": 45, "local_unfused": 60, "bsp": 80, "ssp": 80, "asp": 80, "absp": 80, "devices": 80}
# reads in a relaxed mode's host step (its publish: the dense gradient; the row gradients are a
# StepDevice.from_tensor view on the CPU, a CuPy copy on CUDA; the apply of others' updates)
HOST_READS = {"ssp": 8, "asp": 8, "absp": 8}

# ops that launch no kernel: views, allocations, metadata
VIEWS = frozenset(
    """aten::view aten::slice aten::select aten::as_strided aten::t aten::transpose aten::expand
aten::squeeze aten::unsqueeze aten::detach aten::alias aten::_unsafe_view aten::empty
aten::empty_like aten::empty_strided aten::resolve_conj aten::resolve_neg aten::result_type aten::lift_fresh
aten::numel aten::view_as aten::set_ aten::requires_grad_ aten::detach_""".split()
)
# ops that launch only through the aten ops they call (a copy when needed): those count
TRANSPARENT = frozenset("aten::to aten::contiguous aten::reshape aten::item".split())
# ops that read a value back to the host, or sync on CUDA to size their output
READ_BACK_OPS = frozenset(
    """aten::item aten::_local_scalar_dense aten::is_nonzero aten::nonzero aten::nonzero_static
aten::unique aten::_unique aten::_unique2 aten::unique_dim aten::unique_consecutive aten::masked_select
aten::_assert_async""".split()
)
FORBIDDEN_OPS = frozenset(
    """aten::sort aten::argsort aten::msort aten::unique aten::_unique aten::_unique2 aten::unique_dim
aten::unique_consecutive""".split()
)
# reads of tensors that live on the host on every device: the dense optimizers' step counters
# (models/dense_optim.py keeps them on the CPU, as torch's non-fused optimizers do)
HOST_TENSOR_READS = frozenset(
    {("hpsray/models/dense_optim.py", "_adam"), ("hpsray/models/dense_optim.py", "<listcomp>")}
)
HOST_TENSOR = "host_tensor::"
READ_BACK_METHODS = ("tolist", "item", "cpu", "numpy", "__array__")
OWN_OPS = "hpsray::"  # ops registered by hpsray/training/fused_update.py


@dataclass
class MiniBatchCount:
    """One mini-batch range's count (op names, repeated as often as they ran)."""

    launches: list[str] = field(default_factory=list)
    read_backs: list[str] = field(default_factory=list)
    numba: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    host_step: list[str] = field(default_factory=list)  # ops and reads inside host-step ranges


@dataclass
class Tally:
    """Every mini-batch range a run went through, in order (all threads)."""

    minibatches: list[MiniBatchCount]

    def most(self, what: str) -> int:
        return max((len(getattr(m, what)) for m in self.minibatches), default=0)

    def worst(self, what: str) -> list[str]:
        return sorted(max((getattr(m, what) for m in self.minibatches), key=len, default=[]))

    def check(self, launches: int, host_reads: int = 0) -> None:
        """Assert every mini-batch launches at most ``launches`` ops, reads nothing back, calls
        no numba kernel, sorts nothing, and reads at most ``host_reads`` values in its host step."""
        assert self.minibatches, "no mini-batch ran: the check would hold vacuously"
        assert self.most("numba") == 0, f"a mini-batch calls numba: {self.worst('numba')}"
        assert self.most("read_backs") == 0, f"a mini-batch reads back to the host: {self.worst('read_backs')}"
        assert self.most("forbidden") == 0, f"a mini-batch sorts or dedupes: {self.worst('forbidden')}"
        assert 0 < self.most("launches") <= launches, (
            f"{self.most('launches')} launching ops in a mini-batch, budget {launches}: {self.worst('launches')}"
        )
        reads = max((sum(n.startswith("readback::") for n in m.host_step) for m in self.minibatches), default=0)
        assert reads <= host_reads, f"{reads} host reads in a mini-batch's host step, budget {host_reads}"


_views = threading.local()


def _numba_dispatchers() -> list[tuple[Any, str, Any]]:
    from numba.core.dispatcher import Dispatcher

    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("hpsray") and module is not None:
            for attr, value in vars(module).items():
                if isinstance(value, Dispatcher):
                    found.append((module, attr, value))
    return found


@contextmanager
def _watched() -> Iterator[None]:
    """Tensor read-back methods and hpsray's numba kernels, each call made a profiler range."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, new: Any) -> None:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    for name in READ_BACK_METHODS:
        original = getattr(torch.Tensor, name)

        def method(self: torch.Tensor, *args: Any, _f: Any = original, _n: str = name, **kwargs: Any) -> Any:
            if getattr(_views, "on", False):
                return _f(self, *args, **kwargs)
            caller = sys._getframe(1).f_code
            on_host = any(caller.co_filename.endswith(f) and caller.co_name == c for f, c in HOST_TENSOR_READS)
            with torch.profiler.record_function(f"{HOST_TENSOR if on_host else 'readback::'}{_n}"):
                return _f(self, *args, **kwargs)

        patch(torch.Tensor, name, method)
    from_tensor = StepDevice.from_tensor

    def view(self: StepDevice, t: torch.Tensor) -> Any:
        _views.on = True
        try:
            return from_tensor(self, t)
        finally:
            _views.on = False

    patch(StepDevice, "from_tensor", view)
    for module, attr, kernel in _numba_dispatchers():

        def counted(*args: Any, _k: Any = kernel, _n: str = f"numba::{module.__name__}.{attr}", **kwargs: Any) -> Any:
            with torch.profiler.record_function(_n):
                return _k(*args, **kwargs)

        patch(module, attr, counted)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def tally(fn: Callable[[], Any]) -> Tally:
    """Run ``fn`` and count what each of its mini-batches did (see the module docstring)."""
    with _watched(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = list(prof.events())
    counts: dict[int, MiniBatchCount] = {}
    for e in events:
        if e.name == MINIBATCH:
            counts[id(e)] = MiniBatchCount()
    for e in events:
        if e.name == MINIBATCH:
            continue
        chain, p = [], e.cpu_parent
        while p is not None and p.name != MINIBATCH:
            chain.append(p.name)
            p = p.cpu_parent
        if p is None:
            continue
        c = counts[id(p)]
        name = e.name
        in_host = any(n.startswith(HOST_STEP) for n in chain) or name.startswith(HOST_STEP)
        if in_host:
            if name.startswith(("readback::", "aten::")) and not any(n.startswith("aten::") for n in chain):
                c.host_step.append(name)
            continue
        if any(n.startswith(OWN_OPS) for n in chain):
            continue  # inside one of hpsray's registered ops: its implementation
        if name.startswith("numba::"):
            c.numba.append(name)
        if name.startswith(HOST_TENSOR) or any(n.startswith(HOST_TENSOR) for n in chain):
            continue
        if name.startswith("readback::") or name in READ_BACK_OPS:
            c.read_backs.append(name)
        if name in FORBIDDEN_OPS:
            c.forbidden.append(name)
        top = not any(n.startswith("aten::") and n not in TRANSPARENT for n in chain)
        if top and name.startswith(OWN_OPS):
            c.launches.append(name)
        elif top and name.startswith("aten::") and name not in VIEWS and name not in TRANSPARENT:
            c.launches.append(name)
    order = sorted((e for e in events if e.name == MINIBATCH), key=lambda e: e.time_range.start)
    return Tally([counts[id(e)] for e in order])
