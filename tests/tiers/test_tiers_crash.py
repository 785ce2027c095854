"""SSD-PS durability under ``kill -9`` (docs/architecture.md: invariant 5).

A driver process (fresh interpreter, numba's fork-safe ``workqueue`` threading layer) forks a
writer per trial. The writer opens the store (recovering from the previous crash), then dumps
batches in a loop with aggressive compaction and reports each batch *after* ``dump`` returns
(its acknowledgement) through a pipe. The driver SIGKILLs it at a random moment, reopens the
store and checks every key.

Rule checked per key: let ``a`` be the last acknowledged batch that wrote it. Its stored row
must be ``a``'s value, or the value of a batch that was in flight at some kill (started, never
acknowledged) with a number greater than ``a`` that wrote this key — such a dump may or may
not have become durable before the kill, so both outcomes are correct. A key that no
acknowledged batch wrote is absent or holds such an in-flight value. Anything else (an older
value, a lost key, a torn row, a store that fails to open) is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

DRIVER = r"""
import json, os, random, signal, sys, time
import numpy as np
from hpsray.tiers.ssd import SSDPS

directory, mode, trials, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
W, UNIVERSE = 4, 3000
OPTS = dict(rows_per_file=32, compact_trigger=1.1, max_space_ratio=2.0, compact_pass_bytes=48 << 10, io_threads=2)


def batch(seq):
    r = np.random.default_rng(seq)
    keys = r.choice(UNIVERSE, int(r.integers(1, 300)), replace=False).astype(np.uint64)
    rows = np.empty((keys.size, W), np.float32)
    rows[:, 0] = seq
    rows[:, 1] = keys
    rows[:, 2] = seq * 0.5
    rows[:, 3] = -float(seq)
    return keys, rows


acked, inflight = [], set()
report = dict(trials=0, killed=0, acked=0, compactions=0, checks=0, files_seen=0)


def verify():
    expect = np.zeros(UNIVERSE, np.int64)
    for seq in acked:  # in order: the last acknowledged batch per key wins
        expect[batch(seq)[0].astype(np.int64)] = seq
    with SSDPS(directory, **OPTS) as s:
        keys = np.arange(UNIVERSE, dtype=np.uint64)
        rows, found = s.load(keys)
        report["files_seen"] = max(report["files_seen"], s.stats["files"])
        s.verify()
    for k in range(UNIVERSE):
        e = int(expect[k])
        if not found[k]:
            if e:
                raise AssertionError(f"key {k}: acknowledged by batch {e}, absent after the crash")
            continue
        seq = int(rows[k, 0])
        ok_row = rows[k, 1] == k and rows[k, 2] == seq * 0.5 and rows[k, 3] == -seq
        if not ok_row:
            raise AssertionError(f"key {k}: torn row {rows[k].tolist()}")
        if seq == e:
            continue
        if seq in inflight and seq > e and k in set(batch(seq)[0].tolist()):
            continue
        raise AssertionError(f"key {k}: holds batch {seq}, last acknowledged {e}, in flight {sorted(inflight)[-5:]}")
    report["checks"] += 1


def writer(start, w, hook_point=None):
    try:
        s = SSDPS(directory, W, **OPTS)
        if hook_point:  # deterministic crash at a named step of the protocol
            s.state.hook = lambda p: os.kill(os.getpid(), signal.SIGKILL) if p == hook_point else None
            if hook_point.startswith("compaction"):
                s.close()
                s = SSDPS(directory, W, background=False, **{k: v for k, v in OPTS.items()})
                s.state.hook = lambda p: os.kill(os.getpid(), signal.SIGKILL) if p == hook_point else None
                os.write(w, (0).to_bytes(8, "little") + (0).to_bytes(8, "little"))
                s.compact(full=True)
                os._exit(4)  # compaction found nothing to do: the test is misconfigured
        seq = start
        while True:
            k, v = batch(seq)
            s.dump(k, v)
            os.write(w, seq.to_bytes(8, "little") + s.stats["compactions"].to_bytes(8, "little"))
            seq += 1
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(3)


def trial(next_seq, delay, hook_point=None, min_acks=0):
    # a writer killed delay s after its min_acks-th acknowledgement (a busy machine can take
    # seconds to start one), or at hook_point
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        writer(next_seq, w, hook_point)
    os.close(w)
    chunks = []
    while sum(len(c) for c in chunks) < 16 * min_acks:
        c = os.read(r, 1 << 16)
        if not c:
            break
        chunks.append(c)
    if hook_point is None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    while True:
        c = os.read(r, 1 << 16)
        if not c:
            break
        chunks.append(c)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise AssertionError(f"writer ended with status {status}, not by SIGKILL")
    data = b"".join(chunks)
    msgs = [(int.from_bytes(data[i:i + 8], "little"), int.from_bytes(data[i + 8:i + 16], "little"))
            for i in range(0, len(data) // 16 * 16, 16)]
    got = [m[0] for m in msgs if m[0]]
    acked.extend(got)
    if msgs:
        report["compactions"] += msgs[-1][1]
    last = got[-1] if got else next_seq - 1
    inflight.add(last + 1)
    report["trials"] += 1
    report["killed"] += 1
    report["acked"] += len(got)
    verify()
    return last + 2  # never reuse the number of the batch that was in flight


rng = random.Random(seed)
nxt = 1
if mode == "random":
    for t in range(trials):  # every other kill may land while the writer starts (open, recovery)
        nxt = trial(nxt, rng.uniform(0.0, 0.35), min_acks=7 * (t % 2))  # the others after 7 dumps
else:
    nxt = trial(nxt, 0.3, min_acks=3)  # some data first (overlapping keys: stale rows to compact)
    for point in mode.split(","):
        nxt = trial(nxt, 0.0, hook_point=point)
        if point.startswith("dump"):
            nxt = trial(nxt, 0.1, min_acks=1)
print(json.dumps(report))
"""


def _run_driver(tmp_path, mode: str, trials: int, seed: int, timeout: float) -> dict:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")  # fork-safe after kernels ran
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), mode, str(trials), str(seed)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kill9_at_random_moments_keeps_every_acknowledged_row(tmp_path):
    report = _run_driver(tmp_path, "random", trials=60, seed=12345, timeout=240)
    assert report["killed"] == 60 and report["checks"] == 60
    assert report["acked"] > 200, report  # the writer made real progress between kills
    assert report["compactions"] > 10, report  # compaction was running while being killed


def test_kill9_at_each_step_of_the_protocol(tmp_path):
    points = "dump:written,dump:recorded,compaction:written,compaction:recorded"
    report = _run_driver(tmp_path, points, trials=0, seed=1, timeout=120)
    assert report["checks"] == 1 + 4 + 2
