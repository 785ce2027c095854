"""Settings built from a job section or the command line by field name (hpsray/fields.py): every
field of the same name arrives, renamed ones are given, nothing else is taken."""

import argparse
import dataclasses

from hpsray.fields import same_fields
from hpsray.job.sections import ClusterSection
from hpsray.pipelines.settings import SyncSettings


def test_every_shared_field_of_cluster_reaches_the_sync_settings():
    from hpsray.job import JobConfig
    from hpsray.job.build import cluster_kwargs

    cluster = {"consistency": "ssp", "staleness": 5, "dense_staleness": 1, "work_per_clock": 3}
    cluster |= {"propagation": "pull", "dense_sync": "chunked", "chunk_bytes": 4096, "fault_timeout_s": 12.5}
    job = JobConfig.from_dict({"data": {"synthetic": {"rows": 100}}, "cluster": cluster}, where="job.toml")
    sync = cluster_kwargs(job)["sync"]
    shared = {f.name for f in dataclasses.fields(ClusterSection)} & {f.name for f in dataclasses.fields(SyncSettings)}
    assert shared == set(cluster) - {"dense_sync"}
    for name in shared:
        assert getattr(sync, name) == cluster[name], name
    assert sync.dense == "chunked"


def test_the_serve_command_line_becomes_serve_options():
    from hpsray.cli import serve
    from hpsray.serving import ServeOptions

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["models/ctr", "--port", "8100", "--replicas", "3", "--mem-rows", "500", "--watch", "7"])
    options = ServeOptions(**same_fields(ServeOptions, args, watch_s=args.watch))
    assert (options.port, options.replicas, options.mem_rows, options.watch_s) == (8100, 3, 500, 7.0)
    assert options.name == ServeOptions().name  # not on the command line: the default


def test_values_win_and_unknown_attributes_are_left():
    ns = argparse.Namespace(consistency="absp", dense="chunked", unrelated=1)
    kwargs = same_fields(SyncSettings, ns, dense="allreduce")
    assert kwargs == {"consistency": "absp", "dense": "allreduce"}
