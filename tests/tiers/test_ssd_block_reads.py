"""SSD-PS partial loads: the touched blocks of many files in merged ranges, read in parallel
(``hpsray.blockio``), from the page cache or the device, equal the rows; damage is named."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hpsray.blockio import read_ranges
from hpsray.errors import CorruptFileError
from hpsray.fileio import drop_cache
from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.paramfile import block_rows_for, file_name

W = 32  # 8-row blocks of 1 KiB: blocks a few KiB apart share one range


def rows_for(keys: np.ndarray) -> np.ndarray:
    r = np.empty((keys.size, W), np.float32)
    r[:] = np.arange(W, dtype=np.float32) * 0.5
    r[:, 0] = keys
    return r


def _drop(directory) -> None:
    drop_cache(os.path.join(directory, name) for name in os.listdir(directory))


def test_read_ranges_reads_cached_and_uncached_ranges_in_parallel(tmp_path):
    paths = [tmp_path / f"f{i}" for i in range(3)]
    data = [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8) for i in range(3)]
    fds = []
    for p, d in zip(paths, data):
        p.write_bytes(d.tobytes())
        fds.append(os.open(p, os.O_RDONLY))
    try:
        rng = np.random.default_rng(9)
        n = 200  # enough ranges for several threads
        f = np.sort(rng.integers(0, 3, n))
        off = rng.integers(0, (1 << 20) - 5000, n)
        length = rng.integers(1, 5000, n)
        at = np.zeros(n + 1, np.int64)
        np.cumsum(length, out=at[1:])
        out = np.zeros(int(at[-1]), np.uint8)
        _drop(tmp_path)
        data[0][:4096].sum()  # noqa: B018 - only the page cache matters: file 0's first pages stay cached
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            short, mapped, _ = read_ranges(pool, 4, np.asarray(fds)[f], at[:-1] + out.ctypes.data, off, length)
        assert short == 0 and mapped == 0
        for r in range(n):
            assert np.array_equal(out[at[r] : at[r + 1]], data[f[r]][off[r] : off[r] + length[r]])
        end = np.asarray([(1 << 20) - 10])
        past, _, _ = read_ranges(None, 1, np.asarray(fds[:1]), np.asarray([out.ctypes.data]), end, np.asarray([20]))
        assert past == 1  # a range past the end of its file is a short read
    finally:
        for fd in fds:
            os.close(fd)


def test_read_ranges_copies_the_resident_ranges_of_mapped_files_and_reads_the_rest(tmp_path):
    import mmap

    data = [np.random.default_rng(i).integers(0, 256, 1 << 18, dtype=np.uint8) for i in range(3)]
    fds, maps = [], []
    for i, d in enumerate(data):
        (tmp_path / f"f{i}").write_bytes(d.tobytes())
        fds.append(os.open(tmp_path / f"f{i}", os.O_RDONLY))
        os.fsync(fds[-1])  # clean pages, which the hint below drops
    _drop(tmp_path)  # file 1 leaves the page cache; files 0 and 2 are read back into it
    for i in (0, 2):
        os.pread(fds[i], 1 << 18, 0)
    try:
        for i in (0, 1):  # file 2 is not mapped: read as before
            maps.append(mmap.mmap(fds[i], 1 << 18, prot=mmap.PROT_READ))
        base = np.asarray([np.frombuffer(m, np.uint8).ctypes.data for m in maps] + [0], np.uint64)
        rng = np.random.default_rng(4)
        f = np.repeat(np.arange(3), 40)
        off = np.concatenate([np.sort(rng.integers(0, (1 << 18) - 3000, 40)) for _ in range(3)])
        length = rng.integers(1, 3000, f.size)
        at = np.zeros(f.size + 1, np.int64)
        np.cumsum(length, out=at[1:])
        out = np.zeros(int(at[-1]), np.uint8)
        sizes = np.full(3, 1 << 18, np.int64)
        short, copied, _ = read_ranges(
            None, 1, np.asarray(fds)[f], at[:-1] + out.ctypes.data, off, length, (base[f], sizes[f])
        )
        assert short == 0 and copied == 40  # file 0's ranges; file 1's pages were not resident
        for r in range(f.size):
            assert np.array_equal(out[at[r] : at[r + 1]], data[f[r]][off[r] : off[r] + length[r]])
        short, copied, _ = read_ranges(
            None, 1, np.asarray(fds)[f], at[:-1] + out.ctypes.data, off, length, (base[f], sizes[f])
        )
        assert short == 0 and copied == 80  # file 1's ranges are resident now
        end, one = np.asarray([(1 << 18) - 10]), np.asarray([0])
        past, copied, _ = read_ranges(
            None, 1, np.asarray(fds[:1]), np.asarray([out.ctypes.data]), end, np.asarray([20]), (base[one], sizes[one])
        )
        assert (past, copied) == (1, 0)  # past the mapping: not copied, a short read
    finally:
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)


def _mapped_from(directory) -> list[str]:
    """This process's mappings of files under ``directory`` (``/proc/self/maps`` lines)."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if str(directory) in line]


def test_partial_loads_copy_resident_blocks_from_kept_mappings_and_let_retired_files_go(tmp_path):
    br = block_rows_for(W)
    rpf = 64 * br
    keys = np.arange(1, 12 * rpf + 1, dtype=np.uint64)
    want = keys[:: 5 * br]  # a fifth of the blocks of every file: read partially
    with SSDPS(tmp_path / "s", W, rows_per_file=rpf, background=False) as s:
        for part in np.array_split(keys, 12):
            s.dump(part, rows_for(part))
    with SSDPS(tmp_path / "s", background=False) as s:
        _drop(tmp_path / "s")
        got, found = s.load(want)  # nothing resident: every range read from the files
        assert found.all() and np.array_equal(got, rows_for(want))
        cold = s.stats
        assert cold["reads_mapped"] == 0 and cold["files_read_partially"] == 12
        got, found = s.load(want)  # resident now: every range copied from a mapping
        assert found.all() and np.array_equal(got, rows_for(want))
        hot = s.stats
        assert hot["reads_mapped"] == hot["reads_issued"] - cold["reads_issued"] > 0
        assert len(_mapped_from(tmp_path / "s")) == 12
        s.dump(keys, rows_for(keys) + 1)  # every row superseded: compaction retires the old files
        s.compact(full=True)
        assert all(line.endswith("(deleted)") for line in _mapped_from(tmp_path / "s"))
        got, _ = s.load(want)  # the next load lets the retired files' mappings go
        assert np.array_equal(got, rows_for(want) + 1)
        assert not any(line.endswith("(deleted)") for line in _mapped_from(tmp_path / "s"))
    assert _mapped_from(tmp_path / "s") == []  # closed: nothing mapped


def test_partial_loads_of_many_files_equal_the_rows_cold_and_cached(tmp_path):
    br = block_rows_for(W)
    rpf = 64 * br
    rng = np.random.default_rng(3)
    with SSDPS(tmp_path / "s", W, rows_per_file=rpf, background=False) as s:
        keys = np.arange(1, 20 * rpf + 1, dtype=np.uint64)
        s.dump(keys, rows_for(keys))
        for _ in range(3):
            want = rng.choice(keys, 20 * 6, replace=False)  # a few blocks of every file, some adjacent
            want = np.concatenate([want, want[:5] + 1, [np.uint64(10**9)]])  # neighbours, an absent key
            want = np.unique(want)[rng.permutation(np.unique(want).size)]
            _drop(tmp_path / "s")
            cold, found = s.load(want)
            hot, found2 = s.load(want)
            present = want <= keys[-1]
            assert found.tolist() == present.tolist() and found2.tolist() == present.tolist()
            assert np.array_equal(cold[present], rows_for(want[present])) and np.array_equal(cold, hot)
            assert not cold[~present].any()
        st = s.stats
        assert st["files_read_partially"] == st["files_read"] == 6 * 20
        assert st["bytes_read"] < 6 * s.stats["disk_bytes"] // 4  # blocks, not whole files


def test_rounds_read_while_the_next_is_planned_place_every_row_and_a_bad_round_raises(tmp_path, monkeypatch):
    from hpsray.tiers.ssd import reads as ssd_reads

    monkeypatch.setattr(
        ssd_reads, "PARTIAL_ROUND_FILES", 3
    )  # 20 files: 7 rounds, each fetched while the next is planned
    br = block_rows_for(W)
    rpf = 64 * br
    keys = np.arange(1, 20 * rpf + 1, dtype=np.uint64)
    want = keys[:: 7 * br + 3]  # a few blocks of every file
    with SSDPS(tmp_path / "s", W, rows_per_file=rpf, background=False) as s:
        for part in np.array_split(keys, 20):
            s.dump(part, rows_for(part))
        _drop(tmp_path / "s")
        for _ in range(2):  # cold, then from the mappings
            got, found = s.load(want[::-1])
            assert found.all() and np.array_equal(got, rows_for(want[::-1]))
        assert s.stats["files_read_partially"] == 2 * 20
        middle = tmp_path / "s" / file_name(s.file_stats()[10]["file_no"])
        os.truncate(middle, 4096)  # a round in the middle fails; the rounds around it were in flight
        _drop(tmp_path / "s")
        with pytest.raises(CorruptFileError, match="short reads.*truncated|checksum mismatch"):
            s.load(want)
        ok = want[want <= 10 * rpf]  # the files before it are still served
        got, found = s.load(ok)
        assert found.all() and np.array_equal(got, rows_for(ok))


def test_a_truncated_file_is_named_by_a_partial_load(tmp_path):
    br = block_rows_for(W)
    rpf = 64 * br
    s = SSDPS(tmp_path / "s", W, rows_per_file=rpf, background=False)
    keys = np.arange(1, 2 * rpf + 1, dtype=np.uint64)
    s.dump(keys, rows_for(keys))
    last = tmp_path / "s" / file_name(s.file_stats()[-1]["file_no"])
    os.truncate(last, os.path.getsize(last) // 2)
    with pytest.raises(CorruptFileError, match="short reads.*truncated"):
        s.load(keys[[-1, 5]])
    rows, _ = s.load(keys[[5, 9]])  # the other file is still served
    assert np.array_equal(rows, rows_for(keys[[5, 9]]))
    s.close()
    with SSDPS(tmp_path / "t", W, rows_per_file=rpf, background=False) as s:  # truncated after a load mapped it
        s.dump(keys, rows_for(keys))
        first = tmp_path / "t" / file_name(s.file_stats()[0]["file_no"])
        assert np.array_equal(s.load(keys[[5, 9]])[0], rows_for(keys[[5, 9]]))
        os.truncate(first, 4096)
        with pytest.raises(CorruptFileError, match="short reads.*truncated|checksum mismatch"):
            s.load(keys[[9, rpf - 1]])


@pytest.mark.parametrize(
    "where, message",
    [
        (lambda n: 64 + 8 * 7, "index checksum"),  # a key
        (lambda n: 64 + 16 * n + 4 * W * (n - 1) + 5, "rows checksum"),  # the last row, in the last chunk
        (lambda n: 64 + 16 * n + 4 * W * n + 2, "block table checksum"),
    ],
    ids=["index", "rows", "table"],
)
def test_whole_file_loads_verify_every_section_in_one_pass(tmp_path, where, message):
    from hpsray.tiers.ssd.wholeread import CHUNK_BYTES, ONE_PASS

    assert ONE_PASS
    n = 3 * CHUNK_BYTES // (4 * W) + 5  # several chunks, the last one short
    d = tmp_path / "s"
    s = SSDPS(d, W, rows_per_file=n, partial_read_share=0.0)  # every load reads whole files
    k = np.arange(1, n + 1, dtype=np.uint64)
    s.dump(k, rows_for(k))
    got, found = s.load(k[::-1])
    assert found.all() and np.array_equal(got, rows_for(k[::-1]))
    f = d / file_name(s.file_stats()[0]["file_no"])
    data = bytearray(f.read_bytes())
    data[where(n)] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=f"{f.name}.*{message}"):
        s.load(k[:1])
    s.close()


def test_one_pass_read_names_a_key_mismatch_a_position_beyond_the_file_and_truncation(tmp_path):
    from hpsray.tiers.ssd.paramfile import write_tmp
    from hpsray.tiers.ssd.wholeread import Buffers, chunk_rows_for, read_pick

    n = 2 * chunk_rows_for(W) + 3
    k = np.arange(10, 10 + n, dtype=np.uint64)
    tmp, size, _ = write_tmp(str(tmp_path), 1, k, np.zeros(n, np.uint64), rows_for(k))
    path = str(tmp_path / "f.hps")
    os.rename(tmp, path)
    bufs = Buffers()
    want = np.array([n - 1, 0, 5], np.int64)  # file order: sorted by chunk
    pos = np.sort(want)
    idx = np.arange(3, dtype=np.int64)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros((3, W), np.float32)
        assert read_pick(path, fd, W, bufs, idx, pos, k[pos], out) == size
        assert np.array_equal(out, rows_for(k[pos]))
        wrong = k[pos].copy()
        wrong[1] += 1
        with pytest.raises(CorruptFileError, match=f"row 5 does not hold key {int(wrong[1])}"):
            read_pick(path, fd, W, bufs, idx, pos, wrong, np.zeros((3, W), np.float32))
        beyond = np.array([0, n + 7], np.int64)
        with pytest.raises(CorruptFileError, match=f"row {n + 7} does not hold"):
            read_pick(path, fd, W, bufs, idx[:2], beyond, np.array([k[0], 1], np.uint64), np.zeros((2, W), np.float32))
    finally:
        os.close(fd)
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptFileError, match="size"):
            read_pick(path, fd, W, bufs, idx, pos, k[pos], np.zeros((3, W), np.float32))
    finally:
        os.close(fd)


def test_touched_blocks_upto_decides_as_the_full_count():
    from hpsray.tiers.ssd.blockpick import touched_blocks, touched_blocks_upto

    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 400, 12)
    starts = np.zeros(13, np.int64)
    np.cumsum(sizes, out=starts[1:])
    pos = rng.integers(0, 2000, int(starts[-1])).astype(np.int64)  # duplicates too
    groups = np.arange(12, dtype=np.int64)
    limits = rng.integers(0, 120, 12).astype(np.int64)
    full = touched_blocks(pos, starts, groups, 8)
    upto = touched_blocks_upto(pos, starts, groups, 8, limits)
    assert np.array_equal(upto <= limits, full <= limits)
    assert np.array_equal(upto[full <= limits], full[full <= limits])
    assert np.array_equal(touched_blocks(pos, starts, groups, 8), full)  # the marks were cleared


def test_locate_gives_each_keys_file_slot_and_position_like_find():
    from hpsray.tiers.ssd.keymap import KeyMap

    km = KeyMap()
    k = np.random.default_rng(4).permutation(np.arange(1, 5001, dtype=np.uint64) * np.uint64(2654435761))
    km.grow(k.size)
    km.place(k, np.arange(k.size, dtype=np.int32) % 7, np.arange(k.size, dtype=np.int32))
    q = np.concatenate([k[::3], k[:50] + np.uint64(1)])  # present, then absent keys
    fs, ps = km.locate(q)
    slots = km.find(q)
    ok = slots >= 0
    assert ok.sum() == k[::3].size
    assert np.array_equal(fs[ok], km.file_slot[slots[ok]]) and np.array_equal(ps[ok], km.pos[slots[ok]])
    assert (fs[~ok] == -1).all()


def test_both_ways_of_grouping_a_loads_keys_agree():
    from hpsray.tiers.ssd.readplan import _group, group_keys

    rng = np.random.default_rng(5)
    for n, slots, chunks in ((200_000, 7, 5), (300, 50, 40), (0, 3, 2)):
        fs = rng.integers(-1, slots, n).astype(np.int32)  # -1: absent
        ps = rng.integers(0, 100 * chunks, n).astype(np.int32)
        want = _group(fs, ps, slots, 100, chunks, 2)
        got = group_keys(fs, ps, slots, 100, chunks)
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        idx, pos, starts = want
        for f in range(slots):  # each file's keys, by chunk, then in batch order
            i = idx[starts[f] : starts[f + 1]]
            assert (fs[i] == f).all() and np.array_equal(pos[starts[f] : starts[f + 1]], ps[i])
            assert np.array_equal(np.lexsort((i, ps[i] // 100)), np.arange(i.size))


def test_wide_rows_read_one_row_blocks_without_keys_and_older_files_load_whole(tmp_path, monkeypatch):
    """A wide row is a block of its own (width 128: 512 bytes), read without its key: the block's
    checksum covers the key asked for, so a changed row fails it. A store reopened with files
    written at another block size (at least 8 rows, as before 2026-11-28) reads those whole, with
    the same rows."""
    import hpsray.tiers.ssd.paramfile as paramfile_module
    import hpsray.tiers.ssd.state as state_module

    wide = 128
    assert block_rows_for(wide) == 1 and block_rows_for(64) == 2 and block_rows_for(8) == 16
    keys = np.arange(1, 4097, dtype=np.uint64)
    rows = np.repeat(keys.astype(np.float32)[:, None], wide, axis=1)
    for module in (state_module, paramfile_module):  # the earlier minimum of 8 rows a block
        monkeypatch.setattr(module, "block_rows_for", lambda width: 8)
    with SSDPS(tmp_path / "old", wide, rows_per_file=1024, background=False) as s:
        s.dump(keys, rows)
    monkeypatch.undo()
    want = keys[::97]
    with SSDPS(tmp_path / "old", background=False) as s:  # reopened at today's one-row blocks
        got, found = s.load(want)
        assert found.all() and np.array_equal(got, rows[::97])
        assert s.stats["files_read_partially"] == 0  # 8-row blocks: read whole, never misread
    with SSDPS(tmp_path / "new", wide, rows_per_file=1024, background=False) as s:
        s.dump(keys, rows)
        got, found = s.load(want)
        assert found.all() and np.array_equal(got, rows[::97])
        st = s.stats
        assert st["files_read_partially"] == st["files_read"] == 4
        assert st["bytes_read"] == want.size * 4 * wide  # each row's 512 bytes, no key read
        name = sorted(n for n in os.listdir(tmp_path / "new") if n.endswith(".hps"))[0]
    path = tmp_path / "new" / name
    data = bytearray(path.read_bytes())
    row_at = 64 + 16 * 1024 + 97 * 4 * wide  # file 0's row 97 (the key 98, asked for below)
    data[row_at + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with SSDPS(tmp_path / "new", background=False) as s:
        with pytest.raises(CorruptFileError, match=f"{name}: block 97 checksum mismatch"):
            s.load(np.array([98], dtype=np.uint64))
        got, found = s.load(np.array([99], dtype=np.uint64))  # its neighbour is intact
        assert found.all() and np.array_equal(got[0], rows[98])
