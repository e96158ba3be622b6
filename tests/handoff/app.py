"""An app process of the CPU hand-off tests: ``python -m tests.handoff.app SOCKET [--hold]``.

It connects to the keeper with the memfd stand-in, prints one JSON line (each tensor's SHA-256 as it reads
it from the mapped memory, and the memory's identity: the memfd inodes), then exits, or with ``--hold``
keeps the weights mapped until its standard input closes (or it is killed).
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from modelload.loader.handoff import connect
from tests.handoff.memfd import MemfdMapper


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    mapper = MemfdMapper()
    weights = connect(sys.argv[1], timeout=30, mapper=mapper)
    digests = {name: digest(weights.tensor(name)) for name in weights.names}
    print(json.dumps({"digests": digests, "inodes": mapper.inodes, "writable": weights.writable}), flush=True)
    if "--hold" in sys.argv:
        sys.stdin.read()


if __name__ == "__main__":
    main()
