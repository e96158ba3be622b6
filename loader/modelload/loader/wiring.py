"""The names that wire one pod together: the variables, paths and ports the webhook writes into a pod, the
sidecar serves on and the loader library reads (docs/contracts.md, "Pod wiring").

The operator, the sidecar and the loader may come from different releases, so these values are a contract,
changed only as docs/contracts.md's versioning rules allow. They live here, at the bottom of the loader
(which the sidecar and the operator both import, and which imports nothing), so that each of the three takes
them from one place instead of repeating them. Standard library only.
"""

from __future__ import annotations

__all__ = [
    "HUGE_PAGES_MOUNT_PATH",
    "HUGE_PAGES_SEGMENT_PATH",
    "KEEPER_ENV",
    "KEEPER_SOCKET",
    "MODEL_DIR_ENV",
    "MODEL_DIR_PATH",
    "MOUNT_PATH",
    "NOTIFY_ENDPOINT",
    "NOTIFY_ENV",
    "PEER_PORT",
    "PEER_STATS_PATH",
    "SEGMENT_ENV",
    "SEGMENT_PATH",
    "STATUS_PORT",
    "STATUS_URL",
    "STATUS_URL_ENV",
    "status_url",
]

# --- variables ---------------------------------------------------------------------------------------------

SEGMENT_ENV = "MODELLOAD_SEGMENT"
"""The segment file: the sidecar creates it (``--segment``), ``attach()`` opens it."""
NOTIFY_ENV = "MODELLOAD_NOTIFY"
"""The pyzmq endpoint the sidecar publishes on (``--notify``) and ``attach()`` subscribes to."""
MODEL_DIR_ENV = "MODELLOAD_MODEL_DIR"
"""Where a directory model's small files go (``--model-dir``), for the app to pass to its engine."""
STATUS_URL_ENV = "MODELLOAD_STATUS_URL"
"""The sidecar's status API as an app container reaches it (``attach()``, ``modelload monitor``)."""
KEEPER_ENV = "MODELLOAD_KEEPER"
"""The keeper's Unix socket (the opt-in CUDA hand-off, docs/handoff.md): ``modelload keeper --socket`` and
``modelload.loader.handoff.connect()`` read it. The webhook does not set it."""

# --- paths -------------------------------------------------------------------------------------------------

MOUNT_PATH = "/run/modelload"
"""Where the shared memory volume is mounted, in the sidecar and in every target container."""
SEGMENT_PATH = f"{MOUNT_PATH}/model.seg"
"""The segment in a pod; also the sidecar's default ``--segment``."""
NOTIFY_ENDPOINT = f"ipc://{MOUNT_PATH}/notify.sock"
"""The notify socket the webhook gives the sidecar and the targets."""
MODEL_DIR_PATH = f"{MOUNT_PATH}/model"
"""A directory model's config and tokenizer in a pod (the sidecar's default: ``model/`` beside the
segment)."""
HUGE_PAGES_MOUNT_PATH = "/run/modelload-hugepages"
"""Where the huge-page volume is mounted (``spec.memory.hugePages``), beside the memory volume: hugetlbfs
holds only mapped files, so the model directory and the notify socket stay at :data:`MOUNT_PATH`."""
HUGE_PAGES_SEGMENT_PATH = f"{HUGE_PAGES_MOUNT_PATH}/model.seg"
"""The segment in a pod with huge pages."""
KEEPER_SOCKET = f"{MOUNT_PATH}/keeper.sock"
"""Where the keeper listens and the app connects when ``MODELLOAD_KEEPER`` is not set."""

# --- ports -------------------------------------------------------------------------------------------------

STATUS_PORT = 8479
"""The sidecar's status API (probes, ``/status``, ``/metrics``)."""
PEER_PORT = 8480
"""Where a sidecar serves its chunks to the other sidecars of its model (docs/peers.md)."""
PEER_STATS_PATH = "/peer/v1/stats"
"""On the peer port: the sidecar's peer counters, which the operator sums into ``status.fleet``."""


def status_url(port: int = STATUS_PORT) -> str:
    """The status API as a container of the same pod reaches it."""
    return f"http://127.0.0.1:{port}"


STATUS_URL = status_url()
"""The default of ``MODELLOAD_STATUS_URL``."""
