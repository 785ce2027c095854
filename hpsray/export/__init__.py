"""The export format, Ray-free: a trained model: rows to Parquet, dense weights to ``dense.pt``, a ``manifest.json``.

The format is documented in ``docs/export.md``. In short, a directory holding::

    manifest.json          format, version, export id, dim, state width, optimizer, model shape,
                           files, the data schema and serving inputs (raw values -> keys)
    rows-00000.parquet     key: uint64, weights: fixed_size_list<float32>[dim],
    rows-00001.parquet       state: fixed_size_list<float32>[state_width] (absent when 0)
    dense.pt               torch.save(state_dict) of the dense model
    delta-000001/          incremental exports on top of it (``export(..., incremental=True)``):
        manifest.json        format hpsray-export-delta, base export id, sequence, counts, files
        rows-00000.parquet   the rows whose values changed since the previous state (or are new)
        removed-00000.parquet  keys no longer present (only when some are)
        dense.pt             the whole dense model

Rows are written sorted by key. A ``manifest.json`` is written last, atomically, so a directory
(or delta directory) without it is an interrupted export. :func:`load_export` applies the deltas
in order, stopping (with a warning) at the first interrupted or foreign one.
"""

from hpsray.export.compare import compare_exports
from hpsray.export.read import (
    DELTA_FORMAT,
    DELTA_VERSION,
    FORMAT,
    MANIFEST,
    VERSION,
    export_chain,
    load_export,
    read_manifest,
)
from hpsray.export.write import DEFAULT_ROWS_PER_FILE, export, export_delta, input_spec, schema_of_source

__all__ = [
    "DEFAULT_ROWS_PER_FILE",
    "DELTA_FORMAT",
    "DELTA_VERSION",
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "compare_exports",
    "export",
    "export_chain",
    "export_delta",
    "input_spec",
    "load_export",
    "read_manifest",
    "schema_of_source",
]
