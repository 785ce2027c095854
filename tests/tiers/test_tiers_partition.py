from __future__ import annotations

import numpy as np
import pytest

from hpsray.kernels.hashing import mix64_array
from hpsray.tiers.partition import Partitioner, device_of, group_by, owner_of, place


def test_four_node_device_combinations_get_a_quarter_each():
    keys = np.random.default_rng(0).integers(0, 2**63, size=200_000, dtype=np.uint64)
    owner, device = place(keys, 2, 2)
    counts = np.bincount(owner * 2 + device, minlength=4) / keys.size
    assert np.allclose(counts, 0.25, atol=0.01), counts


def test_sequential_keys_are_balanced_too():
    # consecutive ids (e.g. unhashed vocabularies) must not map node 0 to device 0 only
    keys = np.arange(100_000, dtype=np.uint64)
    owner, device = place(keys, 2, 2)
    counts = np.bincount(owner * 2 + device, minlength=4) / keys.size
    assert np.allclose(counts, 0.25, atol=0.01), counts


def test_owner_and_device_follow_the_design_formula():
    keys = np.random.default_rng(1).integers(0, 2**63, size=1000, dtype=np.uint64)
    h = mix64_array(keys)
    assert np.array_equal(owner_of(keys, 3), (h % np.uint64(3)).astype(np.int64))
    assert np.array_equal(device_of(keys, 3, 4), ((h // np.uint64(3)) % np.uint64(4)).astype(np.int64))


def test_device_is_independent_of_node():
    keys = np.random.default_rng(2).integers(0, 2**63, size=100_000, dtype=np.uint64)
    owner, device = place(keys, 4, 8)
    for node in range(4):
        share = np.bincount(device[owner == node], minlength=8) / np.count_nonzero(owner == node)
        assert np.allclose(share, 1 / 8, atol=0.015), (node, share)


def test_partitioner_splits_and_groups():
    p = Partitioner(3, 2)
    keys = np.random.default_rng(3).integers(0, 2**63, size=5000, dtype=np.uint64)
    parts = p.split_by_owner(keys)
    assert sum(x.size for x in parts) == keys.size
    for node, part in enumerate(parts):
        assert np.all(p.owner(part) == node)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(keys))
    order, offsets = group_by(np.array([2, 0, 2, 1, 0]), 3)
    assert offsets.tolist() == [0, 2, 3, 5]
    assert order.tolist() == [1, 4, 3, 0, 2]  # stable: input order inside a part
    devs = p.split_by_device(parts[0])
    assert all(np.all(p.device(d) == i) for i, d in enumerate(devs))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n_nodes"):
        Partitioner(0)
    with pytest.raises(ValueError, match="n_devices"):
        device_of(np.array([1], np.uint64), 1, 0)
    with pytest.raises(ValueError, match="reserved"):
        owner_of(np.array([2**64 - 1], np.uint64), 2)
