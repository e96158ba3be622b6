"""The GCS and Azure Blob sources on their emulators, against other readers of the same origin, and what
checking every byte against the store's checksum costs.

Origins: fake-gcs-server (GCS's JSON API) and Azurite (Azure Blob), both on loopback, in memory. Each
serves one safetensors file of ``--size`` GiB. Contenders, per origin, in one round each, in an order that
rotates from round to round (the swings of a shared machine hit all alike; ratios are taken within a round):

- ``modelload``: the sidecar's engine into a segment in /dev/shm, every file proven against the store's
  checksum (GCS: CRC32C, composed from the ranges; Azure: Content-MD5, a pass over the landed bytes);
- ``modelload-unchecked``: the same load with the proof replaced by the pinned version alone: the
  difference is the checksum's cost, in CPU seconds per GiB of this process;
- ``curl``: one stream of the whole object into tmpfs (the floor of landing bytes in new memory);
- ``azure-sdk`` (Azurite only): azure-storage-blob's ``download_blob(max_concurrency=8).readinto`` a tmpfs
  file, the client an Azure user would reach for.

Each result is a JSON line in ``benchmarks/results/cloud-TIMESTAMP.jsonl`` (with the load average), and a
table is printed::

    python benchmarks/cloud_origins.py [--size 0.5] [--rounds 3] [--readers 8]

The emulators, not the loaders, bound the throughput here (Azurite is Node.js, fake-gcs-server copies each
range): compare contenders on one origin, never origins with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from tests.support.cloud_emulators import Azurite, FakeGcs  # noqa: E402

GIB = 1 << 30


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_file(size: int) -> bytes:
    """A safetensors file of ``size`` bytes: 64 float16 tensors of random bytes."""
    import numpy as np

    from modelload.loader.formats.safetensors import serialize

    tensors = {}
    count = 64
    per = size // count // 2
    rng = np.random.default_rng(0)
    for i in range(count):
        tensors[f"layers.{i}.weight"] = rng.integers(0, 1 << 16, per, dtype=np.uint16).view(np.float16)
    return bytes(serialize(tensors))


def load_with_modelload(uri: str, settings: Any, *, readers: int, checked: bool) -> float:
    from modelload.sidecar.load import LoadSettings, engine, proof
    from modelload.sidecar.progress import LoadTracker

    segment = Path("/dev/shm/modelload-bench-cloud/model.seg")
    shutil.rmtree(segment.parent, ignore_errors=True)
    segment.parent.mkdir(parents=True)
    original = engine._decide_proofs
    if not checked:

        def unchecked(model: Any, load: Any, *, encrypted: bool) -> list[Any]:
            return [proof.FileProof(f, model.display(f), "validator") for f in range(len(model.sources))]

        engine._decide_proofs = unchecked  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        engine.Engine(
            LoadSettings(source=uri, segment=segment, readers=readers),
            sources=settings,
            observer=LoadTracker(),
        ).run()
        return time.perf_counter() - start
    finally:
        engine._decide_proofs = original  # type: ignore[assignment]
        shutil.rmtree(segment.parent, ignore_errors=True)


def curl(url: str) -> float:
    target = Path("/dev/shm/modelload-bench-cloud-curl")
    start = time.perf_counter()
    subprocess.run(["curl", "-sf", "-o", str(target), url], check=True)
    elapsed = time.perf_counter() - start
    target.unlink()
    return elapsed


def azure_sdk(server: Azurite, container: str, blob: str) -> float:
    from azure.storage.blob import BlobServiceClient

    client = BlobServiceClient.from_connection_string(server.connection_string).get_blob_client(
        container, blob
    )
    target = Path("/dev/shm/modelload-bench-cloud-sdk")
    start = time.perf_counter()
    with target.open("wb") as out:  # the SDK writes into a seekable stream: a tmpfs file
        client.download_blob(max_concurrency=8).readinto(out)
    elapsed = time.perf_counter() - start
    target.unlink()
    return elapsed


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from modelload.sidecar.sources import AzureCredentials, AzureSettings, GcsSettings, SourceSettings

    size = int(args.size * GIB)
    data = make_file(size)
    results: list[dict[str, Any]] = []
    gcs, azurite = FakeGcs(), Azurite()
    try:
        gcs_uri = gcs.put("bench", "model.safetensors", data)
        az_uri = azurite.put("bench", "model.safetensors", data)
        sas = azurite.sas("bench")
        gcs_settings = SourceSettings(gcs=GcsSettings(gcs.endpoint, anonymous=True))
        az_settings = SourceSettings(
            azure=AzureSettings(credentials=AzureCredentials(connection_string=azurite.connection_string))
        )
        contenders: dict[str, dict[str, Callable[[], float]]] = {
            "gcs": {
                "modelload": lambda: load_with_modelload(
                    gcs_uri, gcs_settings, readers=args.readers, checked=True
                ),
                "modelload-unchecked": lambda: load_with_modelload(
                    gcs_uri, gcs_settings, readers=args.readers, checked=False
                ),
                "curl": lambda: curl(f"{gcs.endpoint}/storage/v1/b/bench/o/model.safetensors?alt=media"),
            },
            "azure": {
                "modelload": lambda: load_with_modelload(
                    az_uri, az_settings, readers=args.readers, checked=True
                ),
                "modelload-unchecked": lambda: load_with_modelload(
                    az_uri, az_settings, readers=args.readers, checked=False
                ),
                "curl": lambda: curl(f"{azurite.endpoint}/bench/model.safetensors?{sas}"),
                "azure-sdk": lambda: azure_sdk(azurite, "bench", "model.safetensors"),
            },
        }
        for round_ in range(args.rounds):
            for origin, table in contenders.items():
                names = list(table)
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    before = _cpu()
                    load1 = os.getloadavg()[0]
                    seconds = table[name]()
                    cpu = _cpu() - before
                    row = {
                        "origin": origin,
                        "contender": name,
                        "round": round_,
                        "bytes": len(data),
                        "seconds": seconds,
                        "gib_per_s": len(data) / GIB / seconds,
                        "cpu_s_per_gib": cpu / (len(data) / GIB) if name != "curl" else None,
                        "loadavg_1m": load1,
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        gcs.stop()
        azurite.stop()
    return results


def summary(results: list[dict[str, Any]]) -> None:
    print(f"\n{'origin':8} {'contender':22} {'GiB/s':>7} {'vs modelload':>13} {'CPU s/GiB':>10}")
    for origin in sorted({r["origin"] for r in results}):
        rows = [r for r in results if r["origin"] == origin]
        base = {r["round"]: r["seconds"] for r in rows if r["contender"] == "modelload"}
        for name in dict.fromkeys(r["contender"] for r in rows):
            mine = [r for r in rows if r["contender"] == name]
            ratio = sorted(base[r["round"]] / r["seconds"] for r in mine)[len(mine) // 2]
            rate = sorted(r["gib_per_s"] for r in mine)[len(mine) // 2]
            cpus = sorted(r["cpu_s_per_gib"] for r in mine if r["cpu_s_per_gib"] is not None)
            cpu = f"{cpus[len(cpus) // 2]:.3f}" if cpus else "-"
            print(f"{origin:8} {name:22} {rate:7.3f} {ratio:13.2f} {cpu:>10}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=0.5, help="GiB of the model (default 0.5)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--readers", type=int, default=8)
    args = parser.parse_args(argv)
    results = run(args)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    path = out / f"cloud-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in results))
    summary(results)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
