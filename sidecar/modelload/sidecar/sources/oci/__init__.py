"""OCI registries as a store of models: ``oci://REGISTRY/REPOSITORY:TAG`` or ``@sha256:...`` (see
:mod:`._store`), and the registry's push side for ``modelload push`` (:mod:`._push`)."""

from ._auth import auths_from_docker_config, load_docker_config
from ._push import PushedLayer, PushResult, layer_media_type, push_directory
from ._reference import OciRef, parse_oci_uri
from ._store import OciStore

__all__ = [
    "OciRef",
    "OciStore",
    "PushResult",
    "PushedLayer",
    "auths_from_docker_config",
    "layer_media_type",
    "load_docker_config",
    "parse_oci_uri",
    "push_directory",
]
