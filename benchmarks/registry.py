"""An OCI registry as the origin: the sidecar loading ``oci://`` by range against what a user does today.

Today a model in a registry is pulled to a directory first (``oras pull``), then loaded from it. The sidecar
reads the artifact's raw layers by range straight into the segment and proves each blob by its digest. Both
run against the same real registry (Debian's ``docker-registry``, the CNCF distribution server, over
loopback, its storage in /dev/shm), on the same ``modelload push``-ed Hugging Face directory of safetensors
shards, each contender in a fresh process, rounds rotating the order:

- ``sidecar oci://``: ``modelload sidecar --source oci://...`` from process start to the last tensor READY
  (digests checked: the load is not COMPLETE before every blob's SHA-256 matches);
- ``oras pull + sidecar file://``: the ORAS Python client pulls the artifact to a folder in /dev/shm, then the
  sidecar loads that folder (the second copy a pull-then-load path pays);
- ``oras pull`` alone, for reference.

Each line gives seconds, GiB/s and CPU-seconds per GiB of the contender's processes (user + system) and of the
registry's; the load average is recorded. Also measured: SHA-256 over 1 GiB in memory (the digest check's
cost per GiB). Results go to ``benchmarks/results/registry-TIMESTAMP.jsonl``.

    python benchmarks/registry.py [--size 1] [--shards 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from harness import _free_port, make_safetensors  # noqa: E402
from peers import wait_complete  # noqa: E402
from scratch import scratch  # noqa: E402

from tests.support.registry import RegistryServer  # noqa: E402

GIB = 1 << 30


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sidecar(source: str, segment: Path, *, extra: list[str]) -> dict[str, Any]:
    port = _free_port()
    argv = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar", "--source", source,
        "--segment", str(segment), "--host", "127.0.0.1", "--port", str(port), "--notify", "none", *extra,
    ]  # fmt: skip
    started = time.time()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        status = wait_complete(port, process, timeout_s=900)
    finally:
        process.terminate()
        process.wait(timeout=60)
        segment.unlink(missing_ok=True)
    return {"seconds": float(status["finished_at"]) - started, "nbytes": int(status["bytes_total"])}


PULL = """
import sys, oras.client
client = oras.client.OrasClient(hostname=sys.argv[1], insecure=True)
client.pull(target=sys.argv[2], outdir=sys.argv[3])
"""


def oras_pull(host: str, target: str, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", PULL, host, target, str(out)], check=True, capture_output=True)
    return time.perf_counter() - started


def sha256_cost() -> dict[str, float]:
    """CPU-seconds per GiB of SHA-256 over bytes already in memory (one thread)."""
    data = os.urandom(256 << 20)
    started, cpu = time.perf_counter(), time.process_time()
    hasher = hashlib.sha256()
    for _ in range(4):
        hasher.update(data)
    return {"seconds_per_gib": time.perf_counter() - started, "cpu_s_per_gib": time.process_time() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=float, default=1.0, help="model size in GiB (1)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    out = results / f"registry-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    lines: list[dict[str, Any]] = [
        {"meta": True, "size_gib": args.size, "shards": args.shards, "cpus": os.cpu_count()}
    ]
    with scratch("modelload-bench-registry-") as work:
        model = work / "source"
        make_safetensors(model, int(args.size * GIB), shards=args.shards)
        nbytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        segment = work / "pod" / "model.seg"  # its model directory goes beside it, in pod/model
        segment.parent.mkdir()
        registry = RegistryServer(work / "storage")
        try:
            uri = registry.uri("bench/model", "v1")
            subprocess.run(
                [sys.executable, "-m", "modelload.loader.cli.main", "push", str(model), uri, "--plain-http"],
                check=True, capture_output=True,
            )  # fmt: skip
            target = f"{registry.host}/bench/model:v1"
            oci_flags = ["--registry-plain-http", registry.host]
            contenders = ["sidecar oci://", "oras pull + sidecar file://", "oras pull"]
            for round_number in range(args.runs):
                order = contenders[round_number % 3 :] + contenders[: round_number % 3]
                for name in order:
                    load1 = os.getloadavg()[0]
                    cpu0, server0 = _children_cpu(), _process_cpu(registry._process.pid)
                    pulled = work / f"pulled-{round_number}"
                    if name == "sidecar oci://":
                        figures = sidecar(uri, segment, extra=oci_flags)
                        seconds, pull_s = figures["seconds"], 0.0
                    else:
                        pull_s = oras_pull(registry.host, target, pulled)
                        seconds = pull_s
                        if name != "oras pull":
                            seconds += sidecar(str(pulled), segment, extra=[])["seconds"]
                    line = {
                        "contender": name,
                        "round": round_number,
                        "seconds": round(seconds, 3),
                        "pull_seconds": round(pull_s, 3),
                        "gib_per_s": round(nbytes / seconds / GIB, 3),
                        "cpu_s_per_gib": round((_children_cpu() - cpu0) / (nbytes / GIB), 3),
                        "registry_cpu_s_per_gib": round(
                            (_process_cpu(registry._process.pid) - server0) / (nbytes / GIB), 3
                        ),
                        "loadavg_1m": round(load1, 2),
                    }
                    lines.append(line)
                    print(json.dumps(line), flush=True)
                    subprocess.run(["rm", "-rf", str(pulled)], check=True)
        finally:
            registry.close()
    hashing = sha256_cost()
    lines.append({"sha256": hashing})
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(
        f"\nSHA-256 in memory: {hashing['cpu_s_per_gib']:.2f} CPU-s/GiB ({1 / hashing['seconds_per_gib']:.2f} GiB/s)"
    )
    print(f"{'contender':32} {'median s':>9} {'GiB/s':>7} {'CPU-s/GiB':>10} {'registry CPU-s/GiB':>19}")
    for name in contenders:
        mine = [line for line in lines if line.get("contender") == name]
        print(
            f"{name:32} {statistics.median(m['seconds'] for m in mine):9.2f} "
            f"{statistics.median(m['gib_per_s'] for m in mine):7.2f} "
            f"{statistics.median(m['cpu_s_per_gib'] for m in mine):10.2f} "
            f"{statistics.median(m['registry_cpu_s_per_gib'] for m in mine):19.2f}"
        )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
