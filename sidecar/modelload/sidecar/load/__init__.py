"""The load path: one model from its source into its segment.

``engine`` (:class:`~modelload.sidecar.load.engine.Engine`) runs a load; ``landing`` chooses how bytes reach
the segment (splice or the mapping, by the pages under it); ``integrity`` checks that the bytes landed are
the origin's; ``meter`` counts bytes as they land; ``modeldir`` copies a directory's small files
beside the segment; ``settings`` holds :class:`LoadSettings`. The engine is imported from its module, not from
here, so reading the settings (``modelload sidecar --help``) never loads the engine.
"""

from modelload.sidecar.load.landing import LANDINGS, Landing
from modelload.sidecar.load.settings import (
    DEFAULT_SEGMENT,
    MAX_CHUNK,
    MAX_READERS,
    MIN_CHUNK,
    LoadSettings,
    ModelFormat,
)

__all__ = [
    "DEFAULT_SEGMENT",
    "LANDINGS",
    "MAX_CHUNK",
    "MAX_READERS",
    "MIN_CHUNK",
    "Landing",
    "LoadSettings",
    "ModelFormat",
]
