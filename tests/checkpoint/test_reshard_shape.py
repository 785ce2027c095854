"""Re-partitioning a checkpoint onto another shape (hpsray/checkpoint/reshard.py), without Ray:
real SSD-PS stores, snapshots and checkpoints; a damaged checkpoint and a disk too small for the
new copy of the rows leave the checkpoint directory byte for byte as it was."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from hpsray.checkpoint import Checkpoints, node_dir
from hpsray.checkpoint.reshard import ADMISSION, SSD_SNAPSHOT, TRAINER_STATE, reshard
from hpsray.errors import CheckpointError, CheckpointFullError
from hpsray.tiers.partition import owner_of
from hpsray.tiers.ssd import SSDPS

W = 32
FP = "job-shape"


def rows_for(keys: np.ndarray) -> np.ndarray:
    return (keys[:, None].astype(np.float32) * 0.5 + np.arange(W, dtype=np.float32)).astype(np.float32)


def write_checkpoint(root: Path, stores: Path, nodes: int, n_keys: int, admission: bool = False) -> Checkpoints:
    """A checkpoint of batch 6 written by ``nodes`` nodes, each owning ``h(key) % nodes``."""
    keys = np.arange(1, n_keys + 1, dtype=np.uint64) * np.uint64(7919)
    owner = owner_of(keys, nodes)
    ckpts = Checkpoints(root, keep=2)
    with ckpts.staged(6) as staging:
        for i in range(nodes):
            k = keys[owner == i]
            with SSDPS(stores / f"s{i}", W, rows_per_file=256, background=False) as s:
                s.dump(k, rows_for(k))
                s.dump(k[::3], rows_for(k[::3]))  # stale versions in the files: only the live ones move
                s.snapshot(node_dir(staging, i) / SSD_SNAPSHOT)
            (node_dir(staging, i) / TRAINER_STATE).write_bytes(f"dense state of node {i}".encode())
            if admission:
                with open(node_dir(staging, i) / ADMISSION, "wb") as f:
                    np.savez(
                        f,
                        keys=k,
                        count=np.full(k.size, 2, np.int64),
                        last=np.full(k.size, 5, np.int64),
                        settings=np.array([2, -1], np.int64),
                        expired_through=np.array([-1, 0], np.int64),
                        totals=np.array([k.size, 1], np.int64),
                    )
        ckpts.commit(staging, 6, {"nodes": nodes, "pass_first": 0}, fingerprint=FP)
    return ckpts


def rows_of(snapshot: Path, tmp: Path) -> tuple[np.ndarray, np.ndarray]:
    SSDPS.restore(snapshot, tmp)
    with SSDPS(tmp, background=False) as s:
        parts = list(s.scan())
    k = np.concatenate([p[0] for p in parts])
    r = np.concatenate([p[1] for p in parts])
    order = np.argsort(k)
    return k[order], r[order]


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root``: its relative path and a hash of its bytes."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d + "/" for d in dirs]:
            p = Path(dirpath) / name.rstrip("/")
            rel = str(p.relative_to(root)) + ("/" if name.endswith("/") else "")
            out[rel] = "" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1)])
def test_reshard_shape_moves_every_row_to_its_new_owner(tmp_path, ssd_warm, old, new):
    ckpts = write_checkpoint(tmp_path / "ckpt", tmp_path / "stores", old, 1500, admission=True)
    before = ckpts.latest(FP)
    assert before is not None
    after = reshard(ckpts, before, new, rows_per_file=100)
    assert after.batch == 6 and after.meta["nodes"] == new and after.meta["reshaped_from"] == old
    assert [p.name for p in ckpts.committed()] == ["ckpt-000006"]  # in the old one's place
    latest = ckpts.latest(FP, deep=True)
    assert latest is not None and latest.meta["nodes"] == new
    all_keys = []
    for j in range(new):
        k, r = rows_of(latest.node(j) / SSD_SNAPSHOT, tmp_path / f"read-{j}")
        assert np.all(owner_of(k, new) == j)
        np.testing.assert_array_equal(r, rows_for(k))
        all_keys.append(k)
        assert (latest.node(j) / TRAINER_STATE).read_bytes() == f"dense state of node {j % old}".encode()
        with np.load(latest.node(j) / ADMISSION) as a:
            np.testing.assert_array_equal(np.sort(a["keys"]), k)
            assert np.all(a["count"] == 2) and a["totals"][0] == (1500 if j == 0 else 0)
    keys = np.concatenate(all_keys)
    assert keys.size == np.unique(keys).size == 1500
    assert not any(p.name.startswith(".") for p in (tmp_path / "ckpt").iterdir())  # no staging left


def test_reshard_shape_of_a_damaged_checkpoint_names_the_file_and_changes_nothing(tmp_path, ssd_warm):
    ckpts = write_checkpoint(tmp_path / "ckpt", tmp_path / "stores", 2, 1500)
    ckpt = ckpts.latest(FP)
    assert ckpt is not None
    victim = sorted((ckpt.node(1) / SSD_SNAPSHOT).glob("*.hps"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a row's bytes: the header still checks, the rows' checksum does not
    os.unlink(victim)  # the store's name keeps the original blocks; the checkpoint's file is damaged
    victim.write_bytes(bytes(data))
    before = tree(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as e:
        reshard(ckpts, ckpt, 3)
    assert str(ckpt.path) in str(e.value) and f"node-1/ssd/{victim.name}: rows checksum" in str(e.value)
    assert tree(tmp_path / "ckpt") == before


def test_reshard_shape_that_the_disk_cannot_hold_is_refused_and_changes_nothing(tmp_path, small_fs, ssd_warm):
    """A 1 MiB file system holds the checkpoint (about 560 KB) but not a second copy of its rows."""
    ckpts = write_checkpoint(small_fs / "ckpt", small_fs / "stores", 2, 3600)
    ckpt = ckpts.latest(FP)
    assert ckpt is not None
    before = tree(small_fs / "ckpt")
    with pytest.raises(CheckpointFullError) as e:
        reshard(ckpts, ckpt, 1)
    assert e.value.directory == str(small_fs / "ckpt") and e.value.needed > 0
    assert "no space left for the checkpoint of batch 6" in str(e.value)
    assert tree(small_fs / "ckpt") == before
    assert ckpts.latest(FP, deep=True) is not None  # the old shape still resumes


def test_reshard_shape_to_the_same_shape_is_the_checkpoint_itself(tmp_path, ssd_warm):
    ckpts = write_checkpoint(tmp_path / "ckpt", tmp_path / "stores", 2, 50)
    ckpt = ckpts.latest(FP)
    assert ckpt is not None
    assert reshard(ckpts, ckpt, 2) is ckpt
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        reshard(ckpts, ckpt, 0)


def test_reshard_shape_of_row_groups_moves_each_groups_rows_at_its_width(tmp_path, ssd_warm):
    """Tables of several row layouts snapshot one store per group (``ssd/group-G-width-W``):
    each group's rows move to their new owners and keep their width."""
    from hpsray.tiers.padded import split
    from hpsray.tiers.rowgroups import RowGroups
    from hpsray.tiers.ssd.grouped import GroupedSSDPS, group_directory

    groups = RowGroups((8, 24), (4, 8), ((0,), (1,)), (0, 1), ("'a'", "'b'"))
    keys = np.arange(1, 601, dtype=np.uint64) * np.uint64(7919)
    keys[1::2] |= np.uint64(1) << np.uint64(56)  # every other key of table 1
    owner = owner_of(keys, 2)
    widths = np.where(keys >> np.uint64(56) == 1, 24, 8)

    def rows(k: np.ndarray, w: int) -> np.ndarray:
        return (k[:, None].astype(np.float32) * 0.5 + np.arange(w, dtype=np.float32)).astype(np.float32)

    ckpts = Checkpoints(tmp_path / "ckpt", keep=2)
    with ckpts.staged(6) as staging:
        for i in range(2):
            k = keys[owner == i]
            padded = np.zeros((k.size, 24), np.float32)
            for w in (8, 24):
                at = widths[owner == i] == w
                padded[at, :w] = rows(k[at], w)
            with GroupedSSDPS(tmp_path / f"s{i}", groups, rows_per_file=64, background=False) as s:
                s.dump(k, split(groups, k, padded))
                s.snapshot(node_dir(staging, i) / SSD_SNAPSHOT)
            (node_dir(staging, i) / TRAINER_STATE).write_bytes(b"dense")
        ckpts.commit(staging, 6, {"nodes": 2, "pass_first": 0}, fingerprint=FP)
    new = reshard(ckpts, ckpts.latest(), 3)
    seen = 0
    for j in range(3):
        for g, w in enumerate(groups.widths):
            k, r = rows_of(
                new.node(j) / SSD_SNAPSHOT / Path(group_directory("", g, w)).name, tmp_path / f"back-{j}-{g}"
            )
            assert r.shape[1] == w and (owner_of(k, 3) == j).all()
            np.testing.assert_array_equal(r, rows(k, w))
            seen += k.size
    assert seen == keys.size
