"""The CUDA hand-off (opt-in): weights that stay on the GPU when the app's container restarts.

A keeper process of the pod (``modelload keeper``) copies the model from the segment into GPU memory it
can export, and lends it over a Unix socket to the app's processes, which map it without a copy::

    from modelload.loader.handoff import connect

    weights = connect()                     # the keeper at MODELLOAD_KEEPER (/run/modelload/keeper.sock)
    weights.load_into_module(net)           # net built on meta; its tensors are the keeper's, on the GPU

An app container that restarts (a crash, an OOM kill, a new image) finds its weights already on the device.
The memory is CUDA virtual-memory allocations exported as POSIX file descriptors and passed with
``SCM_RIGHTS``: no shared PID namespace, no privilege, only the same GPU visible in both containers.
docs/handoff.md gives the protocol, the lifetimes, and what a pod needs.

Nothing here is imported by ``attach()``; the module imports torch and the driver only when used.
"""

from modelload.loader.handoff.client import DeviceModel, connect, status

__all__ = ["DeviceModel", "connect", "status"]
