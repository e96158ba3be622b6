"""The one error tree of modelload, sorted by what the caller does next.

Every error that modelload raises on purpose is a :class:`ModelloadError`. Catch the branch that matches what
you can do about it::

    ModelloadError
    ├── ConfigError                    a setting, flag or URI is wrong: fix the configuration
    │   └── SourceUriError             the source URI cannot name a model
    ├── FormatError                    a model file breaks its format's rules: re-create or re-upload it
    │   ├── BadMagicError              not a file of the expected format
    │   ├── UnsupportedVersionError    a format version this build does not read
    │   ├── TruncatedError             the file ends before a structure it declares
    │   ├── BoundsError                an offset or size points outside the file
    │   ├── OverlapError               two tensors claim the same bytes
    │   ├── DuplicateNameError         two tensors share a name
    │   ├── HeaderError                a header or index entry that cannot be parsed
    │   ├── SizeMismatchError          a tensor's byte count disagrees with its dtype and shape
    │   ├── UnsupportedDtypeError      a dtype this build cannot represent
    │   └── HashMismatchError          the bytes read do not match the file's own hash
    ├── EncryptionError                decryption is impossible with what was given
    │   ├── MissingKeyError            the file is encrypted and no key or password was given
    │   ├── WrongKeyError              a key or password was given and does not open the file
    │   └── NotEncryptedError          a key was given for a file that is not encrypted
    ├── SourceError                    reading the model's source failed
    │   ├── SourceNotFoundError        the object does not exist (check the URI)
    │   ├── SourceAccessDeniedError    credentials were refused (check the Secret or role)
    │   ├── SourceChangedError         the object changed while it was being read
    │   ├── RangeNotSupportedError     the server cannot serve byte ranges
    │   ├── PeerAnswerError            a peer's answer failed its proof or the protocol (the sidecar drops
    │   │                              that peer and reads elsewhere: it never reaches an app)
    │   └── TransientSourceError       worth retrying, after ``retry_after`` seconds when known
    ├── SegmentError                   the shared-memory segment cannot be used
    │   ├── SegmentLayoutError         the segment breaks its layout's rules (see segment/SPEC.md)
    │   ├── SegmentVersionError        a layout version this loader does not know: upgrade the loader
    │   ├── SegmentSpaceError          the volume has no room for the model
    │   ├── TensorReleasedError        the tensor's pages were given back after every consumer copied it
    │   ├── MemoryWaitError            ring mode waited longer than allowed for consumers to free room
    │   ├── ModelClosedError           the Model was used after close(); attach again
    │   └── LoadFailedError            the writer gave up; ``reason`` says why
    ├── ModuleLoadError                a model's tensors do not fit a torch module: fix module or call
    │   ├── ModuleMismatchError        names or shapes differ, as torch's strict load reports (a RuntimeError)
    │   └── LeftOnMetaError            tensors of the module would stay on ``meta`` after the load
    ├── HandoffError                   the device hand-off (``modelload keeper``) cannot be used
    │   ├── KeeperUnavailableError     no keeper answers on the socket this process was pointed to
    │   ├── HandoffProtocolError       the keeper and this loader disagree on the protocol, or one broke it
    │   └── DeviceError                the CUDA driver refused: no VMM support, another GPU, out of memory
    ├── LoadTimeoutError               waiting for tensors took longer than allowed (also a TimeoutError)
    └── SidecarUnavailableError        no sidecar serves the segment this process was pointed to

Each class carries its own classification, as class attributes the consumers read instead of testing
classes or parsing messages:

``kind``
    a short snake_case label for metrics and logs (the sidecar's ``modelload_load_failures_total{kind}`` and
    its failure log line): what an operator should look at. ``internal`` for anything unclassified.
``condition``
    the ``reason`` of a ModelLoad's ``Ready`` condition when resolving it fails with this error (CamelCase,
    docs/operator.md lists them). ``Error`` for anything unclassified.
``transient``
    the same call may well succeed later, unchanged: the operator retries it as ``Retrying``.
``exit_status``
    the status a command exits with when this error ends it: 2 for a configuration error (as argparse's
    usage errors), 1 otherwise; for a service command (``modelload sidecar``), when it stops it at start.

A :class:`ConfigError` also names the ``setting`` it concerns (a flag, a variable, a spec field), which its
message starts with.

Third-party exceptions (botocore, HTTP clients, libsodium) are translated into this tree at one boundary,
inside the module that calls the library, and chained as ``__cause__``. Messages name the file, object or
setting involved and what to do; they never carry credentials, keys or passwords.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BadMagicError",
    "BoundsError",
    "ConfigError",
    "DuplicateNameError",
    "DeviceError",
    "EncryptionError",
    "FormatError",
    "HandoffError",
    "HandoffProtocolError",
    "HashMismatchError",
    "HeaderError",
    "KeeperUnavailableError",
    "LeftOnMetaError",
    "LoadFailedError",
    "LoadTimeoutError",
    "MemoryWaitError",
    "MissingKeyError",
    "ModelClosedError",
    "ModelloadError",
    "ModuleLoadError",
    "ModuleMismatchError",
    "NotEncryptedError",
    "OverlapError",
    "PeerAnswerError",
    "RangeNotSupportedError",
    "SegmentError",
    "SegmentLayoutError",
    "SegmentSpaceError",
    "SegmentVersionError",
    "SidecarUnavailableError",
    "SizeMismatchError",
    "SourceAccessDeniedError",
    "SourceChangedError",
    "SourceError",
    "SourceNotFoundError",
    "SourceUriError",
    "TensorReleasedError",
    "TransientSourceError",
    "TruncatedError",
    "UnsupportedDtypeError",
    "UnsupportedVersionError",
    "WrongKeyError",
]


class ModelloadError(Exception):
    """The base of every error modelload raises on purpose."""

    kind: ClassVar[str] = "internal"
    """The label of metrics and logs (see the module's docstring)."""
    condition: str = "Error"
    """The ModelLoad condition's reason. A class attribute; an operator error may set it per instance."""
    transient: ClassVar[bool] = False
    """Worth retrying unchanged."""
    exit_status: ClassVar[int] = 1
    """The exit status of a command this error ends."""


class ConfigError(ModelloadError, ValueError):
    """A setting, flag, environment variable or URI is invalid. Fix it: retrying will not help.

    ``setting`` names what is wrong (``--readers``, ``MODELLOAD_READERS``, ``spec.chunkSize``) when one
    setting is; the message then starts with it, and ``detail`` is the message without it.
    """

    kind = "config"
    condition = "BadSpec"
    exit_status = 2

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        self.setting = setting
        self.detail = message
        super().__init__(f"{setting}: {message}" if setting else message)


class SourceUriError(ConfigError):
    """The model's source URI cannot name a model: an unknown scheme, a malformed ``s3://`` or HTTP(S) URL, an
    empty path, a query string the operator refuses. Fix the URI (``--source``, ``spec.source``)."""

    condition = "BadSource"


# --- files -------------------------------------------------------------------------------------------------


class FormatError(ModelloadError):
    """A model file (tensorizer or safetensors) breaks a rule of its format.

    ``source`` names the file or object when known. The file has to be re-created or re-uploaded: reading it
    again gives the same answer.
    """

    kind = "format"
    condition = "BadModel"

    def __init__(self, message: str, *, source: str | None = None) -> None:
        self.source = source
        super().__init__(f"{source}: {message}" if source else message)


class BadMagicError(FormatError):
    """The first bytes are not the format's magic: the file is of another format, or not a model at all."""


class UnsupportedVersionError(FormatError):
    """The file declares a format version this build does not read."""


class TruncatedError(FormatError):
    """The file ends before a structure it declares (an interrupted upload or download)."""


class BoundsError(FormatError):
    """An offset or size in the file points outside the file or past a declared limit."""


class OverlapError(FormatError):
    """Two tensors claim overlapping bytes, or the data has holes a strict format forbids."""


class DuplicateNameError(FormatError):
    """Two tensors share one name."""


class HeaderError(FormatError):
    """A header or index entry cannot be parsed (bad JSON, bad UTF-8, an impossible field)."""


class SizeMismatchError(FormatError):
    """A tensor's byte count disagrees with its dtype and shape."""


class UnsupportedDtypeError(FormatError):
    """A dtype this build cannot represent (for example a quantized torch type)."""


class HashMismatchError(FormatError):
    """The bytes read do not match the hash the file stores for them: the file or the transfer is corrupt."""

    kind = "hash_mismatch"


# --- encryption --------------------------------------------------------------------------------------------


class EncryptionError(ModelloadError):
    """Encrypted data cannot be opened with what was given. Never carries the key or the password."""

    kind = "encryption"


class MissingKeyError(EncryptionError):
    """The file is encrypted and no key or password was given: pass --key-file or a password."""


class WrongKeyError(EncryptionError):
    """A key or password was given and the file's authentication tags do not verify with it."""


class NotEncryptedError(EncryptionError):
    """A key was given for a file that is not encrypted: drop the key, or check you have the right file."""


# --- sources -----------------------------------------------------------------------------------------------


class SourceError(ModelloadError):
    """Reading the model's source (a file, an HTTP(S) URL, an S3 object) failed.

    ``uri`` names the object without credentials. The subclasses say whether to fix something or retry.
    """

    def __init__(self, message: str, *, uri: str | None = None) -> None:
        self.uri = uri
        super().__init__(message)


class SourceNotFoundError(SourceError):
    """The object, bucket, file or URL does not exist. Check the URI."""

    kind = "not_found"
    condition = "SourceNotFound"


class SourceAccessDeniedError(SourceError):
    """The source refused the credentials, or none were found. Check the Secret, role or bucket policy."""

    kind = "access_denied"
    condition = "AccessDenied"


class SourceChangedError(SourceError):
    """The object changed (its ETag or size) while it was being read; the load would mix two versions."""

    kind = "changed"
    condition = "SourceUnreadable"
    transient = True


class RangeNotSupportedError(SourceError):
    """The server ignores HTTP Range requests, so the object cannot be read in parallel ranges."""

    kind = "range_unsupported"
    condition = "BadSource"


class PeerAnswerError(SourceError):
    """Another sidecar's answer cannot be used: it does not prove the peer token, its bytes differ from the
    digest it proved, or it breaks the peer protocol. The peer is dropped for the rest of the load and the
    chunk is read from another peer or the origin, so this never fails a load (docs/peers.md)."""

    kind = "peer"


class TransientSourceError(SourceError):
    """A failure worth retrying: a reset connection, a 5xx, throttling, a stalled stream.

    ``retry_after`` is the delay the source asked for, in seconds, when it named one.
    """

    kind = "transient"
    condition = "SourceUnreadable"
    transient = True

    def __init__(self, message: str, *, uri: str | None = None, retry_after: float | None = None) -> None:
        self.retry_after = retry_after
        super().__init__(message, uri=uri)


# --- segments ----------------------------------------------------------------------------------------------


class SegmentError(ModelloadError):
    """The shared-memory segment cannot be created, read or used."""

    kind = "segment"


class SegmentLayoutError(SegmentError):
    """The segment breaks a rule of its layout (segment/SPEC.md): it is corrupt, truncated or hostile."""


class SegmentVersionError(SegmentError):
    """The segment's layout version is unknown to this loader. Upgrade the loader to match the sidecar."""


class SegmentSpaceError(SegmentError, OSError):
    """The volume has no room for the segment. Raise the emptyDir sizeLimit or the memory limit."""

    kind = "no_space"

    def __str__(self) -> str:
        # The message alone: OSError's "[Errno 28] " prefix is noise in a line meant for a person.
        return self.strerror if self.errno is not None and self.strerror else super().__str__()


class TensorReleasedError(SegmentError):
    """The tensor was consumed by every registered consumer and the sidecar (memory mode release or ring)
    gave its pages back: it cannot be read any more. Keep the model with memory mode ``full``."""

    def __init__(self, message: str, *, name: str) -> None:
        self.name = name
        super().__init__(message)


class MemoryWaitError(SegmentError):
    """Ring mode waited longer than its limit for consumers to copy tensors and free room; the message names
    the consumers the load waited for."""


class ModelClosedError(SegmentError, ValueError):
    """A :class:`~modelload.loader.Model` was used after :meth:`~modelload.loader.Model.close`: attach again.
    Tensors handed out before it was closed stay valid."""


class LoadFailedError(SegmentError):
    """The writer of the segment marked the load failed. ``reason`` is the writer's message."""

    def __init__(self, reason: str, *, path: str | None = None) -> None:
        self.reason = reason
        self.path = path
        where = f" ({path})" if path else ""
        super().__init__(f"the model load failed{where}: {reason}")


# --- modules -----------------------------------------------------------------------------------------------


class ModuleLoadError(ModelloadError):
    """The model's tensors cannot be put into a torch module as asked. Nothing was assigned: fix the module
    (its config, its class), the model, or the call's options, and load again."""


class ModuleMismatchError(ModuleLoadError, RuntimeError):
    """Names or shapes differ between the model and the module: what torch's strict ``load_state_dict``
    reports (and, being a RuntimeError too, caught where torch's own error is). ``missing_keys`` are the
    module's names the model lacks, ``unexpected_keys`` the model's names the module lacks."""

    def __init__(
        self, message: str, *, missing_keys: tuple[str, ...] = (), unexpected_keys: tuple[str, ...] = ()
    ) -> None:
        self.missing_keys = missing_keys
        self.unexpected_keys = unexpected_keys
        super().__init__(message)


class LeftOnMetaError(ModuleLoadError):
    """Tensors of the module would stay on ``meta`` after the load (buffers computed in ``__init__``, weights
    the model lacks): a forward pass would crash or compute garbage. ``names`` lists them."""

    def __init__(self, message: str, *, names: tuple[str, ...]) -> None:
        self.names = names
        super().__init__(message)


# --- the device hand-off -----------------------------------------------------------------------------------


class HandoffError(ModelloadError):
    """The device hand-off cannot be used: a keeper process holds the weights in GPU memory and lends them to
    the app's processes (``modelload.loader.handoff``, docs/handoff.md). Falling back to ``attach()`` (a copy
    from the segment) is always possible where the pod also has the segment."""

    kind = "handoff"


class KeeperUnavailableError(HandoffError):
    """No keeper answers on the socket (``MODELLOAD_KEEPER``): it is not running yet, it died, or the socket
    is not in a volume this container mounts."""


class HandoffProtocolError(HandoffError):
    """The keeper and this loader do not speak a common protocol version, or a message broke the protocol's
    rules. Run the keeper and the app with the same modelload release (or versions that share a protocol)."""


class DeviceError(HandoffError):
    """The CUDA driver refused a step of the hand-off: no driver, a GPU without virtual memory management or
    POSIX file descriptor export, the keeper's GPU not visible here, or no device memory left. The message
    names the call and the driver's error. (The copy to a GPU meets it too, when pinning host memory is
    refused, and falls back to staging buffers: it never reaches the caller from there.)"""


class LoadTimeoutError(ModelloadError, TimeoutError):
    """Waiting for tensors took longer than the timeout. ``pending`` names the tensors still missing."""

    def __init__(self, message: str, *, pending: tuple[str, ...] = ()) -> None:
        self.pending = pending
        super().__init__(message)


class SidecarUnavailableError(ModelloadError):
    """No segment or sidecar is where this process was told to look (check MODELLOAD_SEGMENT)."""
