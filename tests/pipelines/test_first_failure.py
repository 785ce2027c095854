"""A failure on one node is reported as that node's error, found by type through Ray's wrapper."""

import pytest

from hpsray.errors import DataError, PeerFailedError, caused_by
from hpsray.pipelines.schedule import first_failure


def test_the_root_cause_replaces_a_peer_failure(ray_local):
    ray = ray_local

    @ray.remote
    def fail(error):
        raise error

    root = fail.remote(DataError("part-0.tsv", "wrong_column_count", "expected 40 columns, got 39", line=17))
    peer = fail.remote(PeerFailedError(3))
    ray.wait([root, peer], num_returns=2, timeout=60)  # both failed (the driver looks at finished outcomes only)
    with pytest.raises(Exception) as got:
        ray.get(peer)
    wrapped = got.value
    assert caused_by(wrapped, PeerFailedError)  # Ray wraps it (RayTaskError); the type survives
    assert "batch 3 failed on another node" in str(wrapped)
    cause = first_failure(wrapped, [peer, root])
    assert caused_by(cause, DataError) and "line 17: wrong_column_count" in str(cause)
    # an error of this node is reported as it is
    with pytest.raises(Exception) as own:
        ray.get(root)
    assert first_failure(own.value, [peer, root]) is own.value
    # only peer failures: the one given is kept
    assert first_failure(wrapped, [peer]) is wrapped
