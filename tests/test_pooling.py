"""Sum pooling: values and gradients equal torch's ``embedding_bag``, empty bags included."""

import numpy as np
import torch
import torch.nn.functional as F

from hpsray.data import Batch
from hpsray.models.pooling import BagLayout, pool_sum


def test_pool_sum_and_its_gradient_equal_embedding_bag():
    # 3 examples, 2 slots; example 1 has an empty slot 1, slot 0 of example 2 repeats a key
    keys = np.array([7, 3, 9, 5, 5, 3], dtype=np.uint64)
    slots = np.array([0, 1, 0, 0, 0, 1], dtype=np.int32)
    offsets = np.array([0, 2, 3, 6], dtype=np.int64)
    batch = Batch(
        labels=np.zeros(3, np.float32),
        dense=np.zeros((3, 1), np.float32),
        keys=keys,
        offsets=offsets,
        slots=slots,
        n_slots=2,
    )
    layout = BagLayout.of(batch)
    rows = torch.randn(layout.unique_keys.size, 4, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    mine = rows.clone().requires_grad_(True)
    theirs = rows.clone().requires_grad_(True)
    pooled = pool_sum(mine, layout)
    expected = F.embedding_bag(
        torch.from_numpy(layout.inverse), theirs, torch.from_numpy(layout.bag_offsets), mode="sum"
    ).view(3, 2, 4)
    torch.testing.assert_close(pooled, expected, rtol=0, atol=0)
    assert torch.count_nonzero(pooled[1, 1]) == 0  # the empty bag
    upstream = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(1))
    (pooled * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    key5 = int(np.searchsorted(layout.unique_keys, 5))
    torch.testing.assert_close(mine.grad[key5], 2 * upstream[2, 0])  # counted once per occurrence
