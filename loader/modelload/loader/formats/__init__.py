"""Model file formats: pure bytes in and out, no I/O beyond what the caller hands in.

Each format reads its index from the first bytes of a file (:func:`read_index`), so a remote reader plans
its byte ranges from one small read, and reads or writes tensors from byte ranges alone.
:func:`read_index` here detects the format (:func:`detect_format`) and dispatches to the format's reader.
Local files open as one :class:`ModelReader`, whichever the format (:func:`open_reader`).
"""

from modelload.loader.formats._detect import PREFIX_LENGTH, PrefixedRead, detect_format, read_index
from modelload.loader.formats._directory import (
    SAFETENSORS_INDEX,
    SMALL_FILE_LIMIT,
    SMALL_FILES_LIMIT,
    WELL_KNOWN_SMALL_FILES,
    ModelFiles,
    check_small_files,
    merge_indexes,
    select_model_files,
    weight_shards,
)
from modelload.loader.formats._index import (
    FormatName,
    ModelIndex,
    Names,
    RangeRead,
    TensorEntry,
    TensorTable,
    has_repeats,
)
from modelload.loader.formats._reader import ModelReader, open_reader

__all__ = [
    "PREFIX_LENGTH",
    "SAFETENSORS_INDEX",
    "SMALL_FILES_LIMIT",
    "SMALL_FILE_LIMIT",
    "WELL_KNOWN_SMALL_FILES",
    "FormatName",
    "ModelFiles",
    "ModelIndex",
    "ModelReader",
    "Names",
    "PrefixedRead",
    "RangeRead",
    "TensorEntry",
    "TensorTable",
    "check_small_files",
    "detect_format",
    "has_repeats",
    "merge_indexes",
    "open_reader",
    "read_index",
    "select_model_files",
    "weight_shards",
]
