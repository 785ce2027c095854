"""Ray actors over the engines (Reader, MemPSShard, SSDPSShard, Trainer): placement, messaging
and metrics only; the logic lives in ``hpsray.tiers``, ``hpsray.data`` and ``hpsray.models``."""

from hpsray.env import omp_threads_sleep

# OpenMP threads (torch's intra-op pool, numba's parallel loops) of the stage actors sleep between
# parallel regions instead of spinning: a node runs several such processes, and spinning threads
# took the cores the other stages needed (the demo 1.7x faster; docs/operations.md, Threads).
# Only where no OpenMP runtime has started yet (an actor's process imports this first); a process
# that trains alone (the reference) keeps spinning, which suits it; a value the user set wins.
omp_threads_sleep()
