"""The bounded edge between two stages (hpsray.pipelines.edge): how many batches it holds and
how many left it, which a failed pass's salvage counts as written back."""

import pytest
import ray

from hpsray.pipelines.edge import BoundedEdge


@ray.remote
def _value(x):
    return x


@ray.remote
def _fail():
    raise ValueError("the consumer failed")


def test_batches_whose_consumers_finished_leave_and_are_counted(ray_local):
    edge = BoundedEdge("train→write-back", capacity=2)
    for k in range(3):
        edge.wait_room()
        edge.put([_value.remote(k)])
        done = _value.remote(k)
        edge.taken([done])
        ray.get(done)
    edge.wait_room()  # the finished batches leave here, however early they finished
    assert len(edge) == 0 and edge.left == 3
    assert edge.in_flight() == []


def test_a_failed_consumer_is_raised_and_its_batch_not_counted(ray_local):
    edge = BoundedEdge("train→write-back", capacity=1)
    edge.put([_value.remote(0)])
    failed = _fail.remote()
    edge.taken([failed])
    with pytest.raises(ray.exceptions.RayTaskError, match="the consumer failed"):
        edge.wait_room()
    assert edge.left == 0


def test_drain_counts_the_batches_it_waited_for(ray_local):
    edge = BoundedEdge("pull→load", capacity=3)
    for k in range(2):
        edge.put([_value.remote(k)])
        edge.taken([_value.remote(10 + k)])
    edge.put([_value.remote(2)])  # no consumer yet: stays
    # batch 0 may have left already, at the second put (its consumer done by then): counted there
    assert edge.drain() in ([10, 11], [11])
    assert edge.left == 2 and len(edge) == 1
