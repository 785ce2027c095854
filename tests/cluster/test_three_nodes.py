"""BSP on three nodes (its own module: one simulated cluster at a time per process)."""

import pytest

from hpsray.pipelines import SyntheticSource

from small_pipeline import small_pipeline  # tests/small_pipeline.py
from test_multinode import CFG, GEN, check_bit_for_bit, check_lossless

pytestmark = pytest.mark.slow


def test_bsp_three_nodes_equals_reference_through_ssd(three_nodes_cluster):
    source = SyntheticSource(GEN, rows=1500)
    with small_pipeline(source, CFG, mem_rows=250, batch_size=100, nodes=3) as p:
        report = p.fit(progress=False)
        assert report["nodes"] == 3 and report["ssd"]["bytes_read"] > 0
        check_lossless(p, source, 3, batch=100, atol=0)  # allreduce over three, bit for bit (issue 33)


def test_bsp_three_nodes_with_chunked_dense_sync_equal_the_reference_bit_for_bit(three_nodes_cluster):
    """Chunked aggregation sums in rank order for any number of nodes; allreduce over three
    does too (all-gathered, added in rank order): the test above checks it at atol 0."""
    check_bit_for_bit(3, "chunked")
