"""hpsray: a hierarchical (HBM / host memory / SSD) parameter server on Ray for CTR models."""

from hpsray.version import __version__

__all__ = ["__version__"]
