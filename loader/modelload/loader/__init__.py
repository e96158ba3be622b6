"""modelload's loader: attach to a model that a sidecar streams into shared memory.

The public surface is what inference code imports; everything else is in submodules.
"""

from modelload.loader import errors

__all__ = ["errors"]
