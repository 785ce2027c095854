"""SSD-PS compaction: rewriting the live rows of stale (or small) files, in a background thread.

A pass picks victims (:meth:`~hpsray.tiers.ssd.files.FileTable.victims`), reads them whole,
keeps the rows that still live there, writes them into new files *with their versions
unchanged*, and records outputs and deleted inputs in one manifest edit. Rows a dump superseded
while the pass ran are counted stale in the outputs, never mapped to them. The thread runs once
disk bytes pass ``compact_trigger`` × live bytes (or small files accumulate); a dump that leaves
more than ``max_space_ratio`` × live bytes waits for it (backpressure). A step (:meth:`Compaction.step`)
is a pass plus the retirement of tombstone files nothing older depends on any more.

Layout: with the store's load heat (:mod:`~hpsray.tiers.ssd.heat`) a pass writes its rows
hottest first (ties by key), so the rows that loads keep wanting share pages instead of each
taking a page among cold rows; :meth:`Compaction.relayout` rewrites the whole store that way.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hpsray.errors import SSDError, SSDFullError
from hpsray.tiers.ssd.files import remove_files
from hpsray.tiers.ssd.paramfile import FLAG_COMPACTED, read_file
from hpsray.tiers.ssd.state import StoreState

__all__ = ["Compaction", "space_ratio"]


def space_ratio(disk: int, live: int) -> float:
    """Disk bytes over live bytes (1 for an empty store)."""
    if live == 0:
        return 1.0 if disk == 0 else float("inf")
    return disk / live


class Compaction:
    """The compaction of one store: passes, the background thread, backpressure, errors."""

    def __init__(self, state: StoreState, background: bool) -> None:
        self.state = state
        self.lock = state.compaction_lock  # one compaction pass at a time
        self.wake = threading.Event()
        self.pass_done = threading.Condition(state.lock)
        self.passes = 0
        self.errors = 0
        self.last_error: str | None = None
        self.fatal_error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(target=self._loop, name="ssdps-compaction", daemon=True)

    def start(self) -> None:
        """Start the background thread (if any), once the store is complete."""
        if self.thread is not None:
            self.thread.start()

    def needed(self) -> bool:
        """Disk bytes exceed ``compact_trigger`` × live bytes and some file is over the stale
        threshold, or ``merge_small_files`` small files have accumulated."""
        st = self.state
        with st.lock:
            if st.files.small_slots(st.rows_per_file).size >= st.merge_small_files:
                return True
            if st.files.disk_bytes <= st.compact_trigger * st.live_bytes():
                return False
            return st.files.stale_slots(st.record, st.stale_threshold).size > 0

    def over_hard_limit(self) -> bool:
        """Disk bytes above ``max_space_ratio`` × live bytes (set: backpressure only runs then)
        with a file over the stale threshold."""
        st = self.state
        limit = st.max_space_ratio
        assert limit is not None
        with st.lock:
            over = st.files.disk_bytes > limit * st.live_bytes()
            return over and st.files.stale_slots(st.record, st.stale_threshold).size > 0

    def run_pass(self, full: bool = False, older_than: int | None = None) -> int:
        """One compaction pass; returns the files it rewrote (0: nothing to do). ``older_than``:
        rewrite the files numbered below it, stale or not (a relayout, :meth:`relayout`)."""
        st = self.state
        with self.lock:
            t0 = time.perf_counter()
            f, kmap = st.files, st.keys
            with st.lock:
                victims = f.victims(
                    st.record,
                    st.stale_threshold,
                    st.rows_per_file,
                    st.merge_small_files,
                    st.compact_pass_bytes,
                    full,
                    older_than,
                )
                victim_nos = f.no[victims].tolist()
            if victims.size == 0:
                return 0
            parts, bytes_read = [], 0
            for s, no in zip(victims.tolist(), victim_nos):
                pf = read_file(st.path(no), None, st.width)
                assert pf.rows is not None  # a whole read has rows
                bytes_read += pf.header.size
                with st.lock:
                    ok, _ = kmap.lives_at(pf.keys, s, np.arange(pf.keys.size))
                live = np.flatnonzero(ok)
                parts.append((pf.keys[live], pf.versions[live], pf.rows[live], np.full(live.size, s), live))
            keys = np.concatenate([p[0] for p in parts])
            vers = np.concatenate([p[1] for p in parts])
            rows = np.concatenate([p[2] for p in parts])
            src_slot = np.concatenate([p[3] for p in parts]).astype(np.int32)
            src_pos = np.concatenate([p[4] for p in parts]).astype(np.int32)
            del parts
            heat = st.heat
            if heat is not None and keys.size > 1:  # hot rows first, so rows missed together share pages
                order = np.lexsort((keys, -heat.estimate(keys)))
                keys, vers, rows = keys[order], vers[order], rows[order]
                src_slot, src_pos = src_slot[order], src_pos[order]
            st.hook("compaction:read")
            rpf = st.rows_per_file
            n_out = -(-keys.size // rpf)
            nos = st.allocate_file_numbers(n_out)
            sizes, tables = st.write_files(list(nos), keys, vers, rows, FLAG_COMPACTED) if n_out else ([], {})
            st.hook("compaction:written")
            with st.lock:
                still, slots = kmap.lives_at(keys, src_slot, src_pos)  # rows no dump superseded meanwhile
                try:
                    st.manifest.append(add=list(nos), delete=victim_nos, next_file_no=nos.stop)
                except BaseException:
                    remove_files(st.directory, nos)
                    raise
                st.hook("compaction:recorded")
                pos = np.arange(keys.size, dtype=np.int64)
                live_per = np.bincount(pos[still] // rpf, minlength=n_out)
                out_slots = f.add_written(nos, sizes, tables, int(keys.size), rpf, live_per, FLAG_COMPACTED)
                if n_out:
                    kmap.file_slot[slots[still]] = out_slots[pos[still] // rpf]
                    kmap.pos[slots[still]] = pos[still] % rpf
                for s in victims.tolist():
                    st.retire_file(s)
                stats = st.stats
                stats["compactions"] += 1
                stats["files_compacted"] += len(victim_nos)
                stats["compaction_bytes_read"] += bytes_read
                stats["compaction_bytes_written"] += sum(sizes)
                stats["compaction_seconds"] += time.perf_counter() - t0
            st.manifest.maybe_rewrite()
            return len(victim_nos)

    def relayout(self) -> int:
        """Rewrite every file there is now (not tombstones), a pass at a time, each pass's rows
        hottest first by the load heat; returns the files rewritten."""
        with self.state.lock:
            end = self.state.next_file_no
        done = 0
        while (n := self.run_pass(older_than=end)) > 0:
            done += n
        return done

    def step(self, full: bool = False) -> int:
        """One pass (:meth:`run_pass`), then the retirement of tombstone files
        (:meth:`retire_tombstones`); returns the files rewritten and retired."""
        done = self.run_pass(full)
        if self.state.tombstones:
            with self.lock:
                done += self.retire_tombstones()
        return done

    def retire_tombstones(self) -> int:
        """Remove the tombstone files none of whose dependencies is live any more (the caller
        holds the compaction lock); returns how many."""
        st = self.state
        with st.lock:
            live = np.fromiter(st.files.slot_of, dtype=np.int64, count=len(st.files.slot_of))
            done = [no for no, deps in st.tombstones.items() if not np.isin(deps, live).any()]
        if not done:
            return 0
        st.manifest.append(delete=done)
        with st.lock:
            for no in done:
                st.retire_file(st.files.slot_of[no])
                del st.tombstones[no]
            st.stats["tombstone_files_retired"] += len(done)
        st.manifest.maybe_rewrite()
        return len(done)

    def _loop(self) -> None:
        st = self.state
        while not st.closed:
            self.wake.wait(0.5)
            self.wake.clear()
            if st.closed:
                break
            try:
                while not st.closed and self.needed():
                    if self.step() == 0:
                        break
                    with st.lock:
                        self.passes += 1
                        self.pass_done.notify_all()
            except Exception as e:  # noqa: BLE001 - shown in stats; a fatal one fails the next dump
                with st.lock:
                    self.errors += 1
                    self.last_error = repr(e)
                    if not isinstance(e, SSDFullError):  # a full disk may drain; retry on wake
                        self.fatal_error = e
                    self.pass_done.notify_all()
                if self.fatal_error is not None:
                    return

    def raise_fatal(self) -> None:
        """Fail a dump once the background thread stopped on an error."""
        e = self.fatal_error
        if e is not None:
            raise SSDError(
                f"SSD-PS {self.state.directory}: background compaction stopped after an error ({e!r}); "
                "acknowledged rows are intact, reopen the store after fixing the cause"
            ) from e

    def backpressure(self) -> None:
        """Wait (or compact inline) until disk bytes ≤ ``max_space_ratio`` × live bytes.

        Never raises for a failed compaction: the dump it follows is already durable; the
        failure shows in the store's stats and, if fatal, fails the next dump.
        """
        st = self.state
        with st.lock:
            st.stats["backpressure_waits"] += 1
        if self.thread is None:
            try:
                while self.over_hard_limit() and self.step() > 0:
                    pass
            except Exception as e:  # noqa: BLE001 - the dump before it is durable; report, don't fail it
                with st.lock:
                    self.errors += 1
                    self.last_error = repr(e)
            return
        with st.lock:
            errors = self.errors
            while self.over_hard_limit() and self.thread.is_alive() and self.errors == errors and not st.closed:
                self.wake.set()
                self.pass_done.wait(0.05)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until compaction has nothing left to do (per ``compact_trigger``); compacts
        inline without a background thread. Returns False on timeout."""
        st = self.state
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.needed():
            if self.thread is None:
                self.step()
                continue
            with st.lock:
                passes, errors = self.passes, self.errors
                self.wake.set()
                while self.passes == passes and self.errors == errors:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self.wake.set()
                    self.pass_done.wait(0.1 if left is None else min(0.1, left))
                if self.errors != errors:
                    raise SSDError(f"SSD-PS {st.directory}: compaction failed: {self.last_error}")
        return True

    def stop(self) -> None:
        """Stop the background thread after its current pass (the store is marked closed)."""
        self.wake.set()
        if self.thread is not None:
            self.thread.join()
