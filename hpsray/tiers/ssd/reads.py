"""SSD-PS reads: planning a load (which files, whole or partial) and running it on the I/O threads
(the planning kernels are :mod:`~hpsray.tiers.ssd.readplan`).

A load looks every key up once (in parallel), groups the found keys by file and chunk (a parallel
counting sort), and reads each file holding a requested key once: whole (every checksum verified
and the rows picked a cache-sized chunk at a time, :mod:`~hpsray.tiers.ssd.wholeread`), or, when the
requested rows lie in few checksummed blocks, only those blocks: the touched blocks of many files
are sorted by file and offset, adjacent blocks merged into one range; the ranges the page cache
holds are copied from the files' mappings, kept across loads (:mod:`~hpsray.tiers.ssd.maps`),
every other range hinted to the kernel (``WILLNEED``, so the device sees them all at once) and
read with ``pread`` from numba loops on the I/O threads, all into one staging buffer
(:mod:`hpsray.blockio`, shared with serving); then each block's checksum is verified and the
rows picked out, with no Python per row or block.
Files are opened in rounds under the store's lock, so a compaction that retires a file a moment
later cannot take it away from a round in flight; later rounds look again the rows of files a
compaction retired meanwhile.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from hpsray.blockio import copy_resident, read_ranges
from hpsray.errors import CorruptFileError
from hpsray.memlimit import memory_limit
from hpsray.tiers.ssd.blockpick import pick_known, pick_staged, touched_blocks, touched_blocks_upto
from hpsray.tiers.ssd.maps import FileMaps
from hpsray.tiers.ssd.outbuf import OutputPool
from hpsray.tiers.ssd.paramfile import read_file
from hpsray.tiers.ssd.readplan import group_keys, pick_rows, plan_blocks
from hpsray.tiers.ssd.state import StoreState
from hpsray.tiers.ssd.wholeread import ONE_PASS, Buffers, chunk_rows_for, read_pick

__all__ = ["DIRECT_SHARE", "MAX_OPEN_FILES", "PARTIAL_ROUND_FILES", "ROUND_BYTES", "Reads"]

MAX_OPEN_FILES = 64  # files opened per whole-file round: bounds descriptors...
ROUND_BYTES = 128 << 20  # ...and the bytes read ahead of the rows being picked
PARTIAL_ROUND_FILES = 256  # most files whose blocks one partial round reads (their ranges all in flight)...
PARTIAL_ROUND_BYTES = 32 << 20  # ...and about the most bytes of blocks it stages (one file's blocks at least)
DIRECT_SHARE = 0.5
"""A store whose files exceed this share of the memory its process may use (:func:`memory_limit`)
reads its partial loads' misses past the page cache (``O_DIRECT`` through the load thread's ring,
:func:`hpsray.blockio.ring_read`): the page cache could not keep them, so filling it only costs
reclaim; a smaller store reads through the cache, which then serves the next loads."""
PAGE_BYTES = 4096  # what the device and the page cache read at the least
MERGE_GAP_BYTES = PAGE_BYTES  # blocks of a file closer than this (a page) are read in one range, the gap too


def _will_need(fds: list[int]) -> None:
    """Start reading whole files into the page cache (it can block on a full device queue,
    so it runs on an I/O thread while the caller goes on)."""
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)


@dataclass(frozen=True)
class _BlockRead:
    """One partial round planned (:meth:`Reads._plan_blocks`): its files (``tasks``, each
    ``(indices into the load's keys, positions, file number)``; ``tstart``: where each starts in
    ``idx``/``pos``), each position's block (``ublk``), the blocks (task, number, where their keys
    and rows land, rows; ``expected``: checksums), the staging buffers, the ranges to read
    (descriptor, address, offset, length) with each file's mapping, and whether past the page cache."""

    tasks: list
    tstart: np.ndarray
    idx: np.ndarray
    pos: np.ndarray
    ublk: np.ndarray
    blk: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    expected: np.ndarray
    staged_keys: np.ndarray
    staged_rows: np.ndarray
    ranges: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    mapped_at: tuple[np.ndarray, np.ndarray]
    direct: bool


class Reads:
    """The loads of one store and their per-thread read buffers. Works on the store's key map
    and file table (``state``) under the state's lock."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self._tls = threading.local()
        # files opened per whole-file round: about ROUND_BYTES, at least 2, at most MAX_OPEN_FILES
        self.round_files = int(min(MAX_OPEN_FILES, max(2, ROUND_BYTES // (state.record * state.rows_per_file))))
        self.chunk_rows = chunk_rows_for(state.width)  # whole files are verified and picked a chunk at a time
        self.outputs = OutputPool()  # the memory of released outputs, for the next loads
        self.maps = FileMaps()  # partial loads copy resident blocks from these
        # one thread reads a partial round's blocks while the load's thread plans the next
        self.fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssdps-fetch")
        # files larger than this are read past the page cache (DIRECT_SHARE)
        self.direct_above = int(memory_limit()[0] * DIRECT_SHARE)

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """Rows of ``keys``, the found mask, and the load's counters (see :meth:`SSDPS.load`)."""
        st = self.state
        pool = st.pool
        # every found key's row is written below; the absent ones are zeroed at the end
        out = self.outputs.rows(keys.size, st.width)
        first_fds: list[int] = []
        pending: list[list] = []  # futures of whole-file rounds in flight
        opened: list[tuple[list, list, list]] = []
        prefetch: list = []
        gone: list[np.ndarray] = []  # keys deleted between the lookup and their round
        fetching: list[tuple[_BlockRead, Future]] = []  # partial rounds whose reads are in flight
        n_files = n_bytes = n_reads = 0
        n_partial = n_mapped = n_ring = 0
        partial_bytes = partial_pages = 0
        with st.lock:
            self.maps.begin(st.files.slot_of)
        try:
            with st.lock:
                files, kmap = st.files, st.keys
                if keys.size * st.block_rows >= 2 * st.partial_read_share * kmap.size:
                    # So many keys that (nearly) every file will be read whole: start reading
                    # the first files while the lookup and grouping below run (~0.1 s per 2M keys).
                    early = np.flatnonzero(files.no >= 0)[: self.round_files]
                    opened.append(([], first_fds, []))  # closed at the end
                    for no in files.no[early].tolist():
                        first_fds.append(os.open(st.path(no), os.O_RDONLY))
                    prefetch.append(pool.submit(_will_need, first_fds))
                fs, ps = kmap.locate(keys)
                n_chunks = max(1, -(-int(files.n.max()) // self.chunk_rows))
                idx, pos, starts = group_keys(fs, ps, files.capacity, self.chunk_rows, n_chunks)
                file_no = files.no.copy()
                groups = np.flatnonzero(starts[1:] > starts[:-1])
                partial = self._partial_groups(groups, starts, pos, file_no)
                whole = groups[~partial]
                rf = self.round_files
                rounds = [whole[r : r + rf] for r in range(0, whole.size, rf)]
                if rounds:  # start the I/O right away
                    opened.append(self._open_round(keys, rounds[0], starts, idx, pos, file_no, gone))
            whole_rounds = opened[-1:] if rounds else []
            if rounds:
                prefetch.append(pool.submit(_will_need, whole_rounds[0][1]))
            found = fs >= 0
            n_present = int(idx.size)
            # Files whose requested rows fill few blocks: only those blocks are read (merged
            # ranges, all in flight, checksummed blocks), in rounds of open descriptors.
            part = groups[partial]
            cuts = self._partial_rounds(part, starts, pos)
            last_cut = cuts[-1] if cuts else None
            for cut in cuts:
                opened.append(self._open_round(keys, cut, starts, idx, pos, file_no, gone))
                tasks, fds, metas = opened[-1]
                blocky = [t for t, (_, table) in enumerate(metas) if table is not None]
                if len(blocky) < len(tasks):  # moved to a file without a block table: read whole
                    futures = [
                        pool.submit(self._read_rows, keys, out, tasks[t][0], tasks[t][1], st.path(tasks[t][2]), fds[t])
                        for t in range(len(tasks))
                        if metas[t][1] is None
                    ]
                    wait(futures)
                    n_bytes += sum(fut.result()[0] for fut in futures)
                    n_reads += sum(self._whole_reads(m) for m in metas if m[1] is None)
                if blocky:
                    picked = ([tasks[t] for t in blocky], [fds[t] for t in blocky], [metas[t] for t in blocky])
                    plan = self._plan_blocks(*picked)
                    # past the page cache, few blocks are resident: they are found and copied
                    # here, so the fetch thread only reads (its mincore calls kept the device
                    # idle between rounds); through it, most are, and the fetch thread copies
                    # them while this thread plans the next round
                    r_dest, r_off, r_len = plan.ranges[1:]
                    resident = copy_resident(r_dest, r_off, r_len, plan.mapped_at) if plan.direct else None
                    fetching.append((plan, self.fetcher.submit(self._fetch_blocks, plan, resident)))
                    n_partial += len(blocky)
                n_files += len(tasks)
                # the next round is planned while this one's reads are in flight; then the
                # previous round's rows are placed
                while len(fetching) > 1 or (fetching and cut is last_cut):
                    plan, fut = fetching.pop(0)
                    got, ranges, mapped, ringed, pages = self._place_blocks(keys, out, plan, fut.result())
                    n_bytes += got
                    partial_bytes += got
                    partial_pages += pages
                    n_reads += ranges
                    n_mapped += mapped
                    n_ring += ringed
            # Whole files: rounds of a few files (ROUND_BYTES), opened under the lock: an open
            # descriptor keeps a file readable even if compaction unlinks it a moment later.
            # Later rounds check that their files are still live and look up again the rows of
            # files a compaction retired. Round r + 1 is opened, hinted (WILLNEED, so the device
            # sees a deep queue) and queued on the I/O threads as soon as round r is queued; round
            # r + 2 waits until round r is done (two rounds in flight, no idle threads between).
            for r in range(len(rounds)):
                tasks, fds, metas = whole_rounds[r]
                n_reads += sum(self._whole_reads(m) for m in metas)
                pending.append(
                    [
                        pool.submit(self._read_rows, keys, out, i, p, st.path(no), fd)
                        for (i, p, no), fd in zip(tasks, fds)
                    ]
                )
                n_files += len(tasks)
                if len(pending) > 1:
                    wait(pending[0])
                    n_bytes += sum(fut.result()[0] for fut in pending.pop(0))
                if r + 1 < len(rounds):
                    opened.append(self._open_round(keys, rounds[r + 1], starts, idx, pos, file_no, gone))
                    whole_rounds.append(opened[-1])
                    prefetch.append(pool.submit(_will_need, opened[-1][1]))
            while pending:
                wait(pending[0])
                n_bytes += sum(fut.result()[0] for fut in pending.pop(0))
        finally:
            for futures in pending:  # an error left reads running: they use the descriptors
                wait(futures)
            wait([fut for _, fut in fetching])
            wait(prefetch)  # before their descriptors close
            self.maps.end()  # no read of this load runs any more
            for _, fds, _ in opened:
                self.close_all(fds)
        if gone:
            lost = np.concatenate(gone)
            found[lost] = False
            n_present -= int(lost.size)
        if n_present < keys.size:
            out[~found] = 0
        counts = {
            "rows_loaded": n_present,
            "rows_absent": int(keys.size - n_present),
            "files_read": n_files,
            "files_read_partially": n_partial,
            "bytes_read": n_bytes,
            "reads_issued": n_reads,
            "reads_mapped": n_mapped,
            "reads_ring": n_ring,
            "pages_read": partial_pages + -(-(n_bytes - partial_bytes) // PAGE_BYTES),
        }
        return out, found, counts

    def _whole_reads(self, meta: tuple[int, np.ndarray | None]) -> int:
        """The positioned reads of a whole-file read of a file of ``meta[0]`` rows: header,
        index, its chunks of rows, and its block table (``meta[1]``) where it has one."""
        return 2 + -(-meta[0] // self.chunk_rows) + (meta[1] is not None)

    def close(self) -> None:
        """Release the kept output memory, every file mapping and the fetch thread (no load may
        be running)."""
        self.fetcher.shutdown(wait=True)
        self.outputs.clear()
        self.maps.close()

    def close_all(self, fds: list[int]) -> None:
        """Close the descriptors of a round."""
        for fd in fds:
            os.close(fd)

    def _open_round(
        self,
        keys: np.ndarray,
        group_slots: np.ndarray,
        starts: np.ndarray,
        idx: np.ndarray,
        pos: np.ndarray,
        file_no: np.ndarray,
        gone: list[np.ndarray],
    ) -> tuple[list, list, list]:
        """Tasks ``(idx, pos, file number)`` for the file slots ``group_slots`` and, per task, an
        open descriptor and ``(rows, block table or None)`` of the file, taken under the lock.
        The keys of a file retired since ``file_no`` are looked up again; those no longer stored
        (deleted meanwhile) are appended to ``gone`` (positions into ``keys``), read nowhere."""
        st = self.state
        tasks: list[tuple[np.ndarray, np.ndarray, int]] = []
        fds: list[int] = []
        metas: list[tuple[int, np.ndarray | None]] = []
        moved: list[np.ndarray] = []
        with st.lock:
            files, kmap = st.files, st.keys
            for s in group_slots.tolist():
                a, b = int(starts[s]), int(starts[s + 1])
                if files.no[s] == file_no[s]:
                    tasks.append((idx[a:b], pos[a:b], int(file_no[s])))
                else:
                    moved.append(idx[a:b])
            if moved:
                mi = np.concatenate(moved)
                ms = kmap.find(keys[mi])
                if (ms < 0).any():  # deleted since the lookup
                    gone.append(mi[ms < 0])
                    mi, ms = mi[ms >= 0], ms[ms >= 0]
                mf, mp = kmap.file_slot[ms], kmap.pos[ms]
                for s in np.unique(mf).tolist():
                    sel = np.flatnonzero(mf == s)
                    sel = sel[np.argsort(mp[sel] // self.chunk_rows, kind="stable")]  # by chunk
                    tasks.append((mi[sel], mp[sel].astype(np.int64), int(files.no[s])))
            try:
                for t in tasks:
                    fds.append(os.open(st.path(t[2]), os.O_RDONLY))
                    metas.append((int(files.n[files.slot_of[t[2]]]), files.tables.get(t[2])))
            except BaseException:
                self.close_all(fds)
                raise
        return tasks, fds, metas

    def _read_rows(
        self, keys: np.ndarray, out: np.ndarray, idx: np.ndarray, pos: np.ndarray, path: str, fd: int
    ) -> tuple[int, bool]:
        """Read the file ``path`` (open as ``fd``) whole, verify it, and place its rows at
        positions ``pos`` (sorted by chunk) as ``out[idx]``; returns ``(bytes read, False)``."""
        if ONE_PASS:  # checksums and picking in one pass over cached chunks, no GIL
            bufs = getattr(self._tls, "bufs", None)  # reused by each I/O thread
            if bufs is None:
                bufs = self._tls.bufs = Buffers()
            return read_pick(path, fd, self.state.width, bufs, idx, pos, keys, out), False
        buf = getattr(self._tls, "buf", None)  # one reused read buffer per I/O thread
        size = os.fstat(fd).st_size
        if buf is None or buf.size < size:
            buf = self._tls.buf = np.empty(max(size, 1 << 20), dtype=np.uint8)
        pf = read_file(path, fd, self.state.width, buf=buf)
        bad = pick_rows(out, idx, pf.rows, pos, pf.keys, keys)
        if bad >= 0:
            raise CorruptFileError(
                f"{path}: row {int(pos[bad])} does not hold key {int(keys[idx[bad]])} as the mapping says"
            )
        return pf.header.size, False

    def _partial_groups(
        self, groups: np.ndarray, starts: np.ndarray, pos: np.ndarray, file_no: np.ndarray
    ) -> np.ndarray:
        """Which of the file slots ``groups`` to read partially: files with a block table
        (format 3) whose requested rows lie in at most ``partial_read_share`` of their blocks."""
        st = self.state
        tables = st.files.tables
        if groups.size == 0 or st.partial_read_share <= 0 or not tables:
            return np.zeros(groups.size, dtype=bool)
        br = st.block_rows
        blocks = -(-st.files.n[groups] // br)
        limits = np.floor(st.partial_read_share * blocks).astype(np.int64)
        ok = touched_blocks_upto(pos, starts, groups, br, limits) <= limits  # the same as touched <= share * blocks
        if ok.any():
            have = np.fromiter((int(no) in tables for no in file_no[groups[ok]]), bool, int(ok.sum()))
            ok[np.flatnonzero(ok)[~have]] = False
        return ok

    def _partial_rounds(self, part: np.ndarray, starts: np.ndarray, pos: np.ndarray) -> list[np.ndarray]:
        """The file slots ``part`` cut into rounds of at most :data:`PARTIAL_ROUND_FILES` files
        and about :data:`PARTIAL_ROUND_BYTES` of touched blocks (bounding the staging memory)."""
        if part.size == 0:
            return []
        st = self.state
        block_bytes = st.block_rows * (8 + 4 * st.width)
        done = np.cumsum(touched_blocks(pos, starts, part, st.block_rows) * block_bytes)
        rounds, at = [], 0
        while at < part.size:
            base = done[at - 1] if at else 0
            end = int(np.searchsorted(done, base + PARTIAL_ROUND_BYTES, side="right"))
            end = min(max(end, at + 1), at + PARTIAL_ROUND_FILES)
            rounds.append(part[at:end])
            at = end
        return rounds

    def _plan_blocks(self, tasks: list, fds: list[int], metas: list) -> _BlockRead:
        """Plan the reads of the touched blocks of the files ``tasks`` (open as ``fds``;
        ``metas``: rows and block table of each): merged ranges into one staging buffer, each
        block's expected checksum, and where each position's block lands."""
        st = self.state
        sizes = np.fromiter((t[0].size for t in tasks), np.int64, len(tasks))
        tstart = np.zeros(len(tasks) + 1, np.int64)
        np.cumsum(sizes, out=tstart[1:])
        idx = np.concatenate([t[0] for t in tasks])
        pos = np.concatenate([t[1] for t in tasks])
        nrows = np.fromiter((m[0] for m in metas), np.int64, len(metas))
        tfd = np.asarray(fds, np.int32)
        row_bytes = 4 * st.width
        # each position's block, numbered among its task's distinct blocks (NumPy's sort: the
        # planner stays a plain loop, cheap to compile)
        task_of = np.repeat(np.arange(len(tasks), dtype=np.int64), sizes)
        pblk = pos // st.block_rows
        span = int(pblk.max()) + 1 if pos.size else 1
        distinct, inverse = np.unique(task_of * span + pblk, return_inverse=True)
        ustart = np.searchsorted(distinct // span, np.arange(len(tasks) + 1))
        known = st.block_rows == 1  # one-row blocks: the key asked for is the one the checksum covers
        blk_task, blk_b, blk_kat, blk_at, blk_n, umap, ranges, n_keys, n_rows = plan_blocks(
            ustart, distinct % span, nrows, tfd, st.block_rows, row_bytes, MERGE_GAP_BYTES, not known
        )
        ublk = umap[inverse.ravel()]
        ublk[pos >= nrows[task_of]] = -1
        r_fd, r_off, r_len, r_kind, r_dest = (np.ascontiguousarray(c) for c in ranges.T)
        staged_keys = np.empty(n_keys, np.uint64)
        staged_rows = np.empty((n_rows, st.width), np.float32)
        dest = r_dest + np.where(r_kind == 0, staged_keys.ctypes.data, staged_rows.ctypes.data)
        expected = np.empty(blk_b.size, np.uint32)
        bstart = np.searchsorted(blk_task, np.arange(len(tasks) + 1))
        for t, (_, table) in enumerate(metas):
            a, b = bstart[t], bstart[t + 1]
            expected[a:b] = table[blk_b[a:b]]
        bases, lengths = self.maps.addresses([t[2] for t in tasks], fds)
        by_fd = np.argsort(tfd)
        r_task = by_fd[np.searchsorted(tfd[by_fd], r_fd)]
        return _BlockRead(
            tasks=tasks,
            tstart=tstart,
            idx=idx,
            pos=pos,
            ublk=ublk,
            blk=(blk_task, blk_b, blk_kat, blk_at, blk_n),
            expected=expected,
            staged_keys=staged_keys,
            staged_rows=staged_rows,
            ranges=(r_fd, dest, r_off, r_len),
            mapped_at=(bases[r_task], lengths[r_task]),
            direct=st.files.disk_bytes > self.direct_above,
        )

    def _fetch_blocks(self, plan: _BlockRead, resident: tuple[np.ndarray, int] | None) -> tuple[int, int, int]:
        """Read ``plan``'s ranges into its staging buffers: those the page cache holds copied from
        the files' mappings (unless ``resident`` says which were, :func:`~hpsray.blockio.copy_resident`),
        the rest through this thread's ring (or hinted, then read on the I/O threads). Returns
        the short reads, the mapped copies and the ranges the ring read."""
        st = self.state
        r_fd, dest, r_off, r_len = plan.ranges
        return read_ranges(
            st.pool, st.io_threads, r_fd, dest, r_off, r_len, plan.mapped_at, plan.direct, resident=resident
        )

    def _place_blocks(
        self, keys: np.ndarray, out: np.ndarray, plan: _BlockRead, fetched: tuple[int, int, int]
    ) -> tuple[int, int, int, int, int]:
        """After :meth:`_fetch_blocks`: verify each block's checksum and the key at each position
        (one-row blocks: the checksum over the key asked for and the row read, no key read), and
        place the rows in ``out``. Returns the bytes read, the reads (merged ranges) issued, how
        many of them were mapped copies, how many the ring read, and the pages they span."""
        st = self.state
        short, mapped, ringed = fetched
        tasks, idx, pos, ublk = plan.tasks, plan.idx, plan.pos, plan.ublk
        blk_task, blk_b, blk_kat, blk_at, blk_n = plan.blk
        r_fd, _, r_off, r_len = plan.ranges
        if short:
            raise CorruptFileError(
                f"{short} short reads of blocks in {len(tasks)} parameter files "
                f"({st.path(tasks[0][2])}, ...): a file shorter than its rows (truncated)"
            )
        if st.block_rows == 1:
            r = pick_known(plan.staged_rows, blk_b, blk_at, plan.expected, out, idx, ublk, keys)
        else:
            r = pick_staged(
                plan.staged_keys,
                plan.staged_rows,
                blk_b,
                blk_kat,
                blk_at,
                blk_n,
                plan.expected,
                out,
                idx,
                pos,
                ublk,
                keys,
                st.block_rows,
            )
        if r > 0:
            u = r - 1
            t = int(blk_task[u])
            raise CorruptFileError(
                f"{st.path(tasks[t][2])}: block {int(blk_b[u])} checksum mismatch (rows "
                f"{int(blk_b[u]) * st.block_rows}..{(int(blk_b[u]) + 1) * st.block_rows - 1} of the file at stake)"
            )
        if r < 0:
            j = -r - 1
            t = int(np.searchsorted(plan.tstart, j, side="right") - 1)
            raise CorruptFileError(
                f"{st.path(tasks[t][2])}: row {int(pos[j])} does not hold key {int(keys[idx[j]])} as the mapping says"
            )
        pages = int(((r_off + r_len - 1) // PAGE_BYTES - r_off // PAGE_BYTES + 1).sum())
        return int(r_len.sum()), int(r_len.size), mapped, ringed, pages
