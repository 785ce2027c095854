"""Data: the Batch type, key hashing, sources, formats and the synthetic generator."""

from hpsray.data.batch import Batch
from hpsray.data.keys import hash_keys
from hpsray.data.synthetic import PlantedCTR

__all__ = ["Batch", "PlantedCTR", "hash_keys"]
