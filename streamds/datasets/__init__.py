"""The datasets a user builds: StreamingJsonl, Mix, packed data, batches; checks of how they
are called.

Every dataset type registers itself with the base (`streamds.datasets.base`) under its KIND
when its module is imported; they are imported here so that each is registered before any
dataset exists (`.batch()` of a mix builds the registered batches type, and so on).
"""

from . import batching, dataset, mix, pack

__all__ = ["batching", "dataset", "mix", "pack"]
