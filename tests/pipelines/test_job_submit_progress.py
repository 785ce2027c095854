"""A job submitted with ``ray job submit`` shows its progress lines in ``ray job logs`` (issue 31):
its driver's stderr is no terminal, so ``hpsray train`` logs them there."""

import json
import re
import subprocess
import sys
import time
import uuid

import pytest
from test_job_submit import RAY, ROOT, head, head_output  # noqa: F401 - the module's head node fixture

pytestmark = pytest.mark.slow


def test_submitted_job_logs_progress_lines(head, tmp_path):  # noqa: F811
    address, env, log = head
    job = tmp_path / "job.toml"
    example = (ROOT / "examples" / "train.toml").read_text()
    job.write_text(example.replace("rows = 200000", "rows = 40000").replace("batch_size = 20000", "batch_size = 4000"))
    sid = f"hpsray-progress-{uuid.uuid4().hex[:8]}"
    runtime_env = json.dumps({"env_vars": {"HPSRAY_PROGRESS_SECONDS": "0.2"}})
    deadline = time.time() + 120
    while True:  # `ray job list` answers before the node's job agent takes submissions
        out = subprocess.run(
            [RAY, "job", "submit", "--address", address, "--submission-id", sid, "--runtime-env-json", runtime_env]
            + ["--", sys.executable, "-m", "hpsray", "train", str(job)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if "No available agent to submit job" not in out.stdout + out.stderr or time.time() > deadline:
            break
        time.sleep(3)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + "\nhead node:\n" + head_output(log)
    logs = subprocess.run(
        [RAY, "job", "logs", "--address", address, sid], env=env, capture_output=True, text=True, timeout=120
    ).stdout
    lines = re.findall(r"hpsray\.progress: progress: batches \d+, examples [\d,]+/40,000 .*ETA \d+:\d\d:\d\d", logs)
    assert lines, logs[-3000:]
    assert re.search(r"hpsray\.progress: pass end: batches 10, examples 40,000/40,000 \(100%\)", logs), logs[-3000:]
    assert "time to first batch" in logs
