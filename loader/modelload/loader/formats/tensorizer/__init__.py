"""The tensorizer file format (CoreWeave), read and written independently of the tensorizer package.

The format, byte by byte: ``docs/tensorizer-format.md``. Data versions 1-5 as tensorizer 2.12 writes them;
pure bytes,
no network: the caller hands in a ``read(offset, length)`` function, a file, or buffers.

Reading remotely (what the sidecar does)::

    index = read_index(read, source=uri, size=object_size)         # one or two range reads
    for entry in index.tensors:                                    # records are [header][data]
        header = parse_tensor_header(header_bytes, entry=entry, encrypted_file=index.encrypted)
        decrypt_in_place(header, data_view, key)                   # if header.encrypted
        verify(header, data_view)                                  # CRC32 and SHA-256 of the plaintext

The steps after parsing, as one call over a key's state shared by a load's threads:
:func:`.record.open_record` (the segment's ``TensorFinisher`` publishes on top of it).

Reading a local file: :class:`TensorizerReader`. Writing: :class:`TensorizerWriter`. Keys:
:class:`DecryptionKey` (reading) and :class:`EncryptionParams` (writing).
"""

from modelload.loader.formats.tensorizer.crypt_info import CryptInfo
from modelload.loader.formats.tensorizer.crypto import TensorDecryptor, decrypt_in_place
from modelload.loader.formats.tensorizer.file_header import FileHeader, parse_file_header
from modelload.loader.formats.tensorizer.hashes import TensorHasher, fastest_hash, verify
from modelload.loader.formats.tensorizer.index import read_index
from modelload.loader.formats.tensorizer.keys import Argon2Limits, DecryptionKey, EncryptionParams
from modelload.loader.formats.tensorizer.reader import TensorizerReader
from modelload.loader.formats.tensorizer.tensor_header import TensorHash, TensorHeader, parse_tensor_header
from modelload.loader.formats.tensorizer.writer import TensorizerWriter

__all__ = [
    "Argon2Limits",
    "CryptInfo",
    "DecryptionKey",
    "EncryptionParams",
    "FileHeader",
    "TensorDecryptor",
    "TensorHash",
    "TensorHasher",
    "TensorHeader",
    "TensorizerReader",
    "TensorizerWriter",
    "decrypt_in_place",
    "fastest_hash",
    "parse_file_header",
    "parse_tensor_header",
    "read_index",
    "verify",
]
