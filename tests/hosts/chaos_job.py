"""The job of the network chaos test (test_network_faults.py), run inside host 0 (the head):
``python chaos_job.py CHECKPOINT_DIR FAULT_TIMEOUT_S OUT_JSON``.

BSP on the two hosts offering ``hpsray_node``, rows through SSD-PS, a checkpoint every 2 batches.
Writes one JSON object to OUT_JSON: ``{"outcome": "finished", "lossless": ..., "recoveries": n}``
(lossless: equal to the reference, as the uninterrupted run is; tests/cluster/test_multinode.py's
``check_lossless``) or ``{"outcome": "error", "types": [...], "message": ...}`` with the error's
chain of types (``TrainingStopped`` → ``NoSpareNode``, ``FaultTimeout``, ...).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/small_pipeline.py, which test_multinode imports

ROWS, BATCH = 2400, 100


def _types(error: BaseException) -> list[str]:
    seen, out, e = set(), [], error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(type(e).__name__)
        e = getattr(e, "cause", None) or e.__cause__
    return out


def main(checkpoints: str, fault_timeout_s: str, out: str) -> None:
    from hpsray.pipelines import (
        CheckpointSettings,
        MemPSSettings,
        Pipeline,
        SyncSettings,
        SyntheticSource,
        TrainerSettings,
    )

    from test_multinode import CFG, GEN, check_lossless

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    source = SyntheticSource(GEN, rows=ROWS)
    t0 = time.time()
    result: dict
    with Pipeline(
        source,
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=450),
        batch_size=BATCH,
        nodes=2,
        sync=SyncSettings(fault_timeout_s=float(fault_timeout_s)),
        checkpoint=CheckpointSettings(checkpoints, every_batches=2, keep=2, max_failures=2),
    ) as p:
        try:
            report = p.fit(progress=False)
        except Exception as e:  # noqa: BLE001 - the outcome is the finding
            result = {"outcome": "error", "types": _types(e), "message": str(e)[-2000:]}
            result["traceback"] = traceback.format_exc()[-3000:]
        else:
            lossless = True
            try:
                check_lossless(p, source, 2, batch=BATCH)
            except AssertionError as e:
                lossless, result = False, {"mismatch": str(e)[-1500:]}
            else:
                result = {}
            result.update(outcome="finished", lossless=lossless, recoveries=len(report.get("recovery", [])))
            result["recovery"] = report.get("recovery", [])
        result["ended_at"] = time.time()  # the outcome, before the actors are stopped
        result["seconds"] = round(result["ended_at"] - t0, 1)
        Path(out + ".part").write_text(json.dumps(result, default=str))
        os.replace(out + ".part", out)  # whole or absent: the test polls for it
        print(json.dumps(result, default=str)[-3000:], flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
