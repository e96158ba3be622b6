"""modelload's loader: attach to a model that a sidecar streams into shared memory.

Inference code needs one call::

    from modelload.loader import attach

    model = attach()                       # the segment named by MODELLOAD_SEGMENT
    model.load_into_module(net, device="cuda")

Tensors are zero-copy views of the segment, usable while the rest still arrives: each accessor waits for the
tensor it returns. Errors are in :mod:`modelload.loader.errors`, sorted by what the caller does next.
"""

from modelload.loader import errors
from modelload.loader._api.attach import attach
from modelload.loader._api.model import DEFAULT, Model, Progress
from modelload.loader.errors import LoadFailedError, LoadTimeoutError, ModelloadError

__all__ = [
    "DEFAULT",
    "LoadFailedError",
    "LoadTimeoutError",
    "Model",
    "ModelloadError",
    "Progress",
    "attach",
    "errors",
]
