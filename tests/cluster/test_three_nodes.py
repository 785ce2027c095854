"""BSP on three nodes (its own module: one simulated cluster at a time per process)."""

import pytest

from hpsray.pipelines import MemPSStage, Pipeline, SyntheticSource, TrainerStage

from test_multinode import CFG, GEN, check_lossless

pytestmark = pytest.mark.slow


def test_bsp_three_nodes_equals_reference_through_ssd(three_nodes_cluster):
    source = SyntheticSource(GEN, rows=1500)
    with Pipeline(source, TrainerStage(CFG), MemPSStage(capacity_rows=250), batch_size=100, nodes=3) as p:
        report = p.fit(progress=False)
        assert report["nodes"] == 3 and report["ssd"]["bytes_read"] > 0
        check_lossless(p, source, 3, batch=100)
