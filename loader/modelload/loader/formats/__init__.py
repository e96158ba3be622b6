"""Model file formats: pure bytes in and out, no I/O beyond what the caller hands in.

Each format reads its index from the first bytes of a file (:func:`read_index`), so a remote reader plans
its byte ranges from one small read, and reads or writes tensors from byte ranges alone.
"""

from modelload.loader.formats._index import FormatName, ModelIndex, RangeRead, TensorEntry

__all__ = ["FormatName", "ModelIndex", "RangeRead", "TensorEntry"]
