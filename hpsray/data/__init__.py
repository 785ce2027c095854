"""Data: the Batch type, key hashing, sources, formats, bad-input policy and the synthetic generator.

A file layout is a :class:`Format` (``hpsray.data.formats``), named by ``Schema.format`` and
registered by name (:func:`register` for one outside hpsray).

The reading path a pipeline uses::

    from hpsray.data import DataReader, Schema, BadInputPolicy
    reader = DataReader("s3://bucket/clicks/", Schema.criteo(), reader_index=i, num_readers=n)
    for batch in reader: ...
    reader.report.summary()
"""

from hpsray.data.bad_input import LENIENT, STRICT, BadInputPolicy, BadInputReport
from hpsray.data.batch import Batch
from hpsray.data.categorical import hash_strings
from hpsray.data.formats import Format, RowCount, format_of, register
from hpsray.data.generate import dataset_schema, load_dataset, write_synthetic
from hpsray.data.keys import hash_keys
from hpsray.data.osrp import OPOSRP
from hpsray.data.readers import DataReader, count_rows, read_batches, read_split
from hpsray.data.schema import Schema
from hpsray.data.sources import Split, list_files, open_source, plan_splits, resolve_filesystem
from hpsray.data.synthetic import PlantedCTR

__all__ = [
    "LENIENT",
    "OPOSRP",
    "STRICT",
    "BadInputPolicy",
    "BadInputReport",
    "Batch",
    "DataReader",
    "Format",
    "PlantedCTR",
    "RowCount",
    "Schema",
    "Split",
    "count_rows",
    "dataset_schema",
    "format_of",
    "hash_keys",
    "hash_strings",
    "list_files",
    "load_dataset",
    "open_source",
    "plan_splits",
    "read_batches",
    "read_split",
    "register",
    "resolve_filesystem",
    "write_synthetic",
]
