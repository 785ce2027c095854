"""The trainers' collective group: per-mini-batch exchange of sparse and dense updates.

Paper §4.2 / App. C.3: after every mini-batch all trainers combine their sparse updates (keys
and gradients, a different number per node) and dense gradients, so every copy of a row and of
the dense model applies the same update. Over ``ray.util.collective`` (``gloo`` on CPU, through
torch.distributed; ``nccl`` on GPU). Its allgather needs equal sizes, so a variable-length
exchange first all-gathers the lengths, pads every payload to the longest, and trims after.

Sparse updates travel as one float32 payload per node: the keys' 64 bits as two float32 words
each, then the gradient rows. Every node concatenates the gathered parts in rank order, so all
nodes hold the same arrays in the same order and sum duplicates identically (bit-equal copies).
"""

from __future__ import annotations

import torch

from hpsray.cluster.netaddr import bind_collectives
from hpsray.kernels.arrays import array_module, is_device_array

_WORDS_PER_KEY = 2  # a uint64 key viewed as two float32 words


class CollectiveGroup:
    """This trainer's membership (``rank`` of ``world``) in the collective group ``name``.

    ``bytes_sent`` counts the payload bytes this rank contributed (padding included), so the
    report can give bytes exchanged per mini-batch.
    """

    def __init__(self, world: int, rank: int, name: str, backend: str = "gloo") -> None:
        import ray.util.collective as col

        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a group of {world}")
        self.col, self.world, self.rank, self.name, self.backend = col, world, rank, name, backend
        # NCCL moves device memory only: payloads go to the GPU and back
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        # the node's own address, never the hostname's (which may resolve to loopback): issue 20
        self.binding = bind_collectives(backend)
        col.init_collective_group(world, rank, backend=backend, group_name=name)
        self.bytes_sent = 0
        self.exchanges = 0

    def allreduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``flat`` over every rank (a new tensor; ``flat`` is untouched)."""
        out = flat.detach().to(self.device, copy=True).contiguous()
        self.col.allreduce(out, group_name=self.name)
        self.bytes_sent += out.numel() * out.element_size()
        return out.to(flat.device)

    def allgather_varlen(self, payload):
        """Every rank's float32 ``payload`` (lengths may differ), in rank order, as arrays of the
        payload's kind: numpy for numpy, CuPy for device arrays (which NCCL gathers in place on
        the device, with no host staging)."""
        on_device = is_device_array(payload)
        xp = array_module("cuda" if on_device else "cpu")
        payload = xp.ascontiguousarray(payload, dtype=xp.float32).reshape(-1)
        dev = self.device
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.world)]
        self.col.allgather(sizes, torch.tensor([payload.size], dtype=torch.int64, device=dev), group_name=self.name)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        if longest == 0:
            return [payload[:0] for _ in lengths]
        padded = torch.zeros(longest, dtype=torch.float32, device=dev)
        if payload.size:
            padded[: payload.size] = torch.as_tensor(payload).to(dev)
        parts = [torch.empty(longest, dtype=torch.float32, device=dev) for _ in range(self.world)]
        self.col.allgather(parts, padded, group_name=self.name)
        self.bytes_sent += 8 + longest * 4
        self.exchanges += 1
        if on_device:
            return [xp.asarray(p[:n]) for p, n in zip(parts, lengths)]
        return [p[:n].cpu().numpy() for p, n in zip(parts, lengths)]

    def allgather_sparse(self, keys, grads):
        """Every rank's ``(keys, grads)`` concatenated in rank order (duplicates kept); numpy
        in, numpy out; device arrays in, CuPy out."""
        xp = array_module("cuda" if is_device_array(keys) else "cpu")
        dim = grads.shape[1]
        keys = xp.ascontiguousarray(keys, dtype=xp.uint64)
        payload = xp.concatenate([keys.view(xp.float32), xp.ascontiguousarray(grads, dtype=xp.float32).reshape(-1)])
        all_keys, all_grads = [], []
        for part in self.allgather_varlen(payload):
            n = part.size // (_WORDS_PER_KEY + dim)
            all_keys.append(part[: n * _WORDS_PER_KEY].view(xp.uint64))
            all_grads.append(part[n * _WORDS_PER_KEY :].reshape(n, dim))
        return xp.concatenate(all_keys), xp.concatenate(all_grads)

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        self.col.barrier(group_name=self.name)

    def destroy(self) -> None:
        self.col.destroy_collective_group(self.name)
