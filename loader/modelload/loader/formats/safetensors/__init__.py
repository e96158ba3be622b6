"""The safetensors format (Hugging Face), read and written without the safetensors package.

A file is three parts::

    offset 0      u64 little-endian N: the header's length in bytes
    offset 8      N bytes of UTF-8 JSON, an object:
                    {"__metadata__": {"key": "text", ...},               (optional, strings only)
                     "name": {"dtype": "F16", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
                  padded at the end with spaces (writers align the data to 8 bytes)
    offset 8 + N  the data buffer: each tensor's bytes, C order, little-endian, at [begin, end) relative
                  to the buffer's start; together the ranges cover the buffer exactly

What we check, and with which error, is tabled in :mod:`._header`. The pieces:

- :func:`read_index` reads and checks the header through a range reader (one or two reads), for remote
  sources and the planner;
- :class:`SafetensorsFile` / :func:`load_numpy` read a local file's tensors into caller-given buffers;
- :func:`save_file` / :func:`serialize` write numpy arrays, torch tensors and :class:`RawTensor` bytes,
  byte-identical to the reference writer; :func:`plan_header` lays out the same header for a writer that
  streams the tensors' bytes in afterwards.

torch stays optional: it is imported only when torch tensors are handed in or asked for.
"""

from modelload.loader.formats.safetensors._file import SafetensorsFile, WritableBuffer, load_numpy
from modelload.loader.formats.safetensors._header import (
    FIRST_READ_LENGTH,
    HEADER_SIZE_CAP,
    parse_header,
    read_index,
)
from modelload.loader.formats.safetensors._writer import RawTensor, plan_header, save_file, serialize

__all__ = [
    "FIRST_READ_LENGTH",
    "HEADER_SIZE_CAP",
    "RawTensor",
    "SafetensorsFile",
    "WritableBuffer",
    "load_numpy",
    "parse_header",
    "plan_header",
    "read_index",
    "save_file",
    "serialize",
]
