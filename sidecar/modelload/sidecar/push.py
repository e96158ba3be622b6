"""``modelload push DIR oci://REGISTRY/REPOSITORY:TAG``: publish a model directory to an OCI registry.

The directory (a Hugging Face-style model: safetensors shards, their index, config and tokenizer files)
becomes
a CNCF ModelPack artifact with one uncompressed layer per file (see
:mod:`modelload.sidecar.sources.oci._push`), so the sidecar loads it by range from any registry
(``--source oci://...``) and ``oras pull`` gets the files back with their names.

Credentials: the Docker config's ``auths`` (``--docker-config``, default ``$DOCKER_CONFIG/config.json`` or
``~/.docker/config.json``, what ``docker login`` and ``oras login`` write). ``--plain-http`` reaches a
registry
without TLS (a local or in-cluster one). Prints the pushed artifact's digest reference on the last line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from modelload.loader.errors import ConfigError

__all__ = ["docker_config_path", "register"]


def docker_config_path(environ: dict[str, str] | None = None) -> Path:
    """Where the Docker tools keep credentials: ``$DOCKER_CONFIG/config.json``, else
    ``~/.docker/config.json``."""
    env = os.environ if environ is None else environ
    folder = env.get("DOCKER_CONFIG")
    return Path(folder) / "config.json" if folder else Path.home() / ".docker" / "config.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``modelload push`` to the main CLI (through the ``modelload.commands`` entry point)."""
    parser = subparsers.add_parser(
        "push",
        help="publish a model directory to an OCI registry as a ModelPack artifact",
        description=(
            "Push DIR's files as uncompressed layers (one per file, weights as "
            "application/vnd.cncf.model.weight.v1.raw), so any registry serves them by range to the sidecar "
            "(--source oci://...) and oras pull gets them back by name."
        ),
    )
    parser.add_argument("directory", type=Path, metavar="DIR", help="the model directory")
    parser.add_argument("reference", metavar="oci://REGISTRY/REPOSITORY:TAG", help="where to push")
    parser.add_argument("--plain-http", action="store_true", help="reach the registry over HTTP, not HTTPS")
    parser.add_argument(
        "--docker-config", type=Path, default=None, metavar="FILE",
        help="a Docker config with the registry's credentials (default ~/.docker/config.json)",
    )  # fmt: skip
    parser.add_argument(
        "--annotation",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a manifest annotation (repeat)",
    )
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from modelload.sidecar.sources import RegistrySettings, SourceSettings
    from modelload.sidecar.sources.oci import load_docker_config, parse_oci_uri, push_directory

    annotations = {}
    for item in args.annotation:
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise ConfigError(f"--annotation {item!r}: expected KEY=VALUE")
        annotations[key] = value
    ref = parse_oci_uri(args.reference)
    auths = load_docker_config(args.docker_config or docker_config_path())
    registry = RegistrySettings(auths=auths, plain_http=(ref.registry,) if args.plain_http else ())
    result = push_directory(
        args.directory,
        args.reference,
        SourceSettings(registry=registry),
        annotations=annotations,
        progress=lambda line: print(line, file=sys.stderr),
    )
    print(f"{ref.pinned(result.digest).uri}")
    return 0
