"""The training progress bar: examples, rate and ETA on a terminal; silent elsewhere."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from hpsray.data import PlantedCTR, Schema, write_synthetic
from hpsray.pipelines.progress import known_examples, progress_bar
from hpsray.pipelines.sources import FileSource, SyntheticSource

BAR = """
import time
from hpsray.pipelines.progress import progress_bar
bar = progress_bar({total}, {enabled})
for _ in range(4):
    bar.update(2500)
    time.sleep(0.05)
bar.close()
"""


def _stderr_on_a_terminal(total, enabled=True) -> str:
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    proc = subprocess.Popen(
        [sys.executable, "-c", BAR.format(total=total, enabled=enabled)], stderr=secondary, stdout=subprocess.DEVNULL
    )
    os.close(secondary)
    out = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the pty closes when the child exits
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(primary)
    return out.decode(errors="replace")


def test_bar_shows_examples_rate_and_eta_on_a_terminal():
    shown = _stderr_on_a_terminal(10_000)
    assert "10.0k/10.0k" in shown and "examples/s" in shown and "<" in shown  # elapsed<remaining
    unknown = _stderr_on_a_terminal(None)
    assert "10.0k examples" in unknown and "examples/s" in unknown
    assert _stderr_on_a_terminal(10_000, enabled=False) == ""


def test_bar_is_silent_when_stderr_is_not_a_terminal(capfd):
    bar = progress_bar(100)
    bar.update(100)
    bar.close()
    assert capfd.readouterr().err == ""


def test_known_examples(tmp_path):
    gen = PlantedCTR(n_slots=2, keys_per_slot=100, n_dense=1, seed=0)
    synthetic = known_examples(SyntheticSource(gen, rows=1234))
    assert synthetic is not None and (synthetic.rows, synthetic.exact) == (1234, True)
    write_synthetic(str(tmp_path / "p"), gen, 3000, "parquet", shard_rows=1000)
    schema = Schema(format="parquet", label="label", dense=("I1",), categorical=("C1", "C2"))
    parquet = known_examples(FileSource([str(tmp_path / "p")], schema))
    assert parquet is not None and (parquet.rows, parquet.exact) == (3000, True)
    # Text: counted when one file is read whole, else estimated from bytes (and said so).
    write_synthetic(str(tmp_path / "t"), gen, 300, "criteo")
    one = known_examples(FileSource([str(tmp_path / "t")], Schema.criteo(1, 2)))
    assert one is not None and (one.rows, one.exact) == (300, True)
    write_synthetic(str(tmp_path / "m"), gen, 3000, "criteo", shard_rows=1000)
    many = known_examples(FileSource([str(tmp_path / "m")], Schema.criteo(1, 2)))
    assert many is not None and not many.exact and abs(many.rows - 3000) <= 60, many
