"""The trainers' collective group: the per-mini-batch exchange of sparse and dense updates
(docs/architecture.md: One batch across nodes, step 4; invariant 1).

Over ``ray.util.collective`` (``gloo`` on CPU, ``nccl`` on GPU). Every rank gets the gathered
parts in rank order, so every copy applies the same arrays in the same order (bit-equal copies).
Every operation is bounded by ``timeout_s`` (``[cluster] fault_timeout_s``; docs/operations.md:
Network faults): one that times out raises :class:`~hpsray.errors.FaultTimeout` naming the group,
the rank and what Ray says is missing, and a :class:`~hpsray.cluster.faults.Watchdog` ends the
process should one outlive twice the timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from hpsray.cluster import faults
from hpsray.cluster.netaddr import bind_collectives
from hpsray.errors import FaultTimeout
from hpsray.kernels.arrays import array_module, is_device_array

_WORDS_PER_KEY = 2  # a uint64 key viewed as two float32 words


class CollectiveGroup:
    """This trainer's membership (``rank`` of ``world``) in the collective group ``name``.

    ``bytes_sent`` counts the payload bytes this rank contributed (padding included), so the
    report can give bytes exchanged per mini-batch.
    """

    def __init__(self, world: int, rank: int, name: str, backend: str = "gloo", timeout_s: float | None = None) -> None:
        import ray
        import ray.util.collective as col

        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a group of {world}")
        self.col, self.world, self.rank, self.name, self.backend = col, world, rank, name, backend
        self.timeout_s = float(timeout_s if timeout_s is not None else faults.fault_timeout())
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        # NCCL moves device memory only: payloads go to the GPU and back
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        # the node's own address, never the hostname's (which may resolve to loopback): issue 20
        self.binding = bind_collectives(backend)
        self._known = {n["NodeID"]: n for n in ray.nodes()}  # to tell which node died while we waited
        self._watchdog = faults.Watchdog(f"collective {name} rank {rank}")
        with self._guard("joining the group"), _default_timeout(self.timeout_s):
            col.init_collective_group(
                world,
                rank,
                backend=backend,  # type: ignore[arg-type]  # Ray types it as its Backend class; it takes a name
                group_name=name,
                gloo_timeout=int(self.timeout_s * 1000),
            )
        _set_timeout(col, name, self.timeout_s)
        self.bytes_sent = 0
        self.exchanges = 0
        self.size_exchanges = 0  # all-gathers of sizes: none where the caller knows them

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Run one operation under the watchdog (twice the timeout, plus the settling time) and
        turn a timeout into :class:`FaultTimeout`."""
        waited_for = f"{what} (collective group {self.name!r}, rank {self.rank} of {self.world})"
        self._watchdog.arm(2 * self.timeout_s + faults.settle_seconds(self.timeout_s) + 10, waited_for)
        try:
            yield
        except FaultTimeout:
            raise
        except Exception as e:
            if not _timed_out(e):
                raise
            raise faults.expired(waited_for, self.timeout_s, self._known) from e
        finally:
            self._watchdog.disarm()

    def allreduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``flat`` over every rank in rank order, rank 0's first, the same
        bits on every rank (a new tensor; ``flat`` is untouched): the order the reference states
        (docs/architecture.md: invariant 1). Two ranks all-reduce (``a + b`` commutes); more
        all-gather and add the parts in rank order, as the backend's ring order depends on the
        rank and the chunk."""
        out = flat.detach().to(self.device, copy=True).contiguous()
        if self.world <= 2:
            with self._guard("the all-reduce of the dense gradient"):
                self.col.allreduce(out, group_name=self.name)
        else:
            parts = [torch.empty_like(out) for _ in range(self.world)]
            with self._guard("the all-gather of the dense gradient"):
                self.col.allgather(parts, out, group_name=self.name)
            out = parts[0]
            for part in parts[1:]:
                out += part
        self.bytes_sent += out.numel() * out.element_size()
        return out.to(flat.device)

    def allgather_varlen(self, payload: Any, lengths: Sequence[int] | None = None) -> list[Any]:
        """Every rank's float32 ``payload`` (lengths may differ), in rank order, as arrays of the
        payload's kind: numpy for numpy, CuPy for device arrays (which NCCL gathers in place on
        the device, with no host staging). ``lengths``: every rank's payload length when the
        caller knows them (one collective, nothing read back); otherwise they are gathered
        first (``size_exchanges`` counts those) and read back. A ``lengths[rank]`` other than
        the payload's raises ``ValueError`` before anything is sent."""
        on_device = is_device_array(payload)
        xp = array_module("cuda" if on_device else "cpu")
        payload = xp.ascontiguousarray(payload, dtype=xp.float32).reshape(-1)
        dev = self.device
        if lengths is None:
            sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.world)]
            with self._guard("the all-gather of the sparse updates' sizes"):
                mine = torch.tensor([payload.size], dtype=torch.int64, device=dev)
                self.col.allgather(sizes, mine, group_name=self.name)
            lengths = [int(s.item()) for s in sizes]
            self.size_exchanges += 1
            self.bytes_sent += 8
        elif len(lengths) != self.world or int(lengths[self.rank]) != payload.size:
            raise ValueError(
                f"collective {self.name} rank {self.rank}: lengths {list(lengths)} do not give this rank's "
                f"payload of {payload.size} floats"
            )
        lengths = [int(n) for n in lengths]
        longest = max(lengths)
        if longest == 0:
            return [payload[:0] for _ in lengths]
        padded = torch.zeros(longest, dtype=torch.float32, device=dev)
        if payload.size:
            padded[: payload.size] = torch.as_tensor(payload).to(dev)
        parts = [torch.empty(longest, dtype=torch.float32, device=dev) for _ in range(self.world)]
        with self._guard("the all-gather of the sparse updates"):
            self.col.allgather(parts, padded, group_name=self.name)
        self.bytes_sent += longest * 4
        self.exchanges += 1
        if on_device:
            return [xp.asarray(p[:n]) for p, n in zip(parts, lengths)]
        return [p[:n].cpu().numpy() for p, n in zip(parts, lengths)]

    def allgather_sparse(self, keys: Any, grads: Any, counts: Sequence[int] | None = None) -> tuple[Any, Any]:
        """Every rank's ``(keys, grads)`` concatenated in rank order (duplicates kept); numpy
        in, numpy out; device arrays in, CuPy out. ``counts``: every rank's number of keys,
        when known (then no sizes are exchanged or read back)."""
        xp = array_module("cuda" if is_device_array(keys) else "cpu")
        dim = grads.shape[1]
        keys = xp.ascontiguousarray(keys, dtype=xp.uint64)
        payload = xp.concatenate([keys.view(xp.float32), xp.ascontiguousarray(grads, dtype=xp.float32).reshape(-1)])
        lengths = None if counts is None else [int(n) * (_WORDS_PER_KEY + dim) for n in counts]
        all_keys, all_grads = [], []
        for part in self.allgather_varlen(payload, lengths):
            n = part.size // (_WORDS_PER_KEY + dim)
            all_keys.append(part[: n * _WORDS_PER_KEY].view(xp.uint64))
            all_grads.append(part[n * _WORDS_PER_KEY :].reshape(n, dim))
        return xp.concatenate(all_keys), xp.concatenate(all_grads)

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        with self._guard("a barrier"):
            self.col.barrier(group_name=self.name)

    def destroy(self) -> None:
        self.col.destroy_collective_group(self.name)


def _timed_out(error: BaseException) -> bool:
    """Whether a collective's error says it timed out (gloo: "Timed out waiting ... for recv")."""
    text = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in text or "timeout" in text


@contextmanager
def _default_timeout(seconds: float) -> Iterator[None]:
    """torch's default process-group timeout set to ``seconds`` while Ray makes its group (it
    passes none, and torch's default is 30 minutes)."""
    import torch.distributed.distributed_c10d as c10d

    saved = c10d.default_pg_timeout, getattr(c10d, "default_pg_nccl_timeout", None)
    c10d.default_pg_timeout = timedelta(seconds=seconds)
    if saved[1] is not None:
        c10d.default_pg_nccl_timeout = timedelta(seconds=seconds)
    try:
        yield
    finally:
        c10d.default_pg_timeout = saved[0]
        if saved[1] is not None:
            c10d.default_pg_nccl_timeout = saved[1]


def _set_timeout(col: Any, name: str, seconds: float) -> None:
    """Set the timeout of the process group behind Ray's group ``name`` (gloo; NCCL's is the
    group's own)."""
    import torch.distributed.distributed_c10d as c10d

    pg = getattr(col.get_group_handle(name), "_pg", None)
    if pg is not None and hasattr(c10d, "_set_pg_timeout"):
        c10d._set_pg_timeout(timedelta(seconds=seconds), pg)
