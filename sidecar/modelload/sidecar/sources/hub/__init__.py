"""The Hugging Face Hub as a store of models: ``hf://ORG/NAME[@REVISION][/PATH]`` (see :mod:`._store`)."""

from ._api import HubRef, parse_hub_uri
from ._store import HubFile, HubStore

__all__ = ["HubFile", "HubRef", "HubStore", "parse_hub_uri"]
