"""The benchmark as Kubernetes Jobs: the sidecar, tensorizer and Run:ai loading the user's model from the
user's bucket, on the user's nodes, measured by the same ``contenders.py`` as ``make bench``.

    python benchmarks/cluster.py --write    # regenerate manifests/benchmarks/benchmark.yaml
    python benchmarks/cluster.py --check    # fail when the file on disk differs (a test runs this)

The manifest is generated, never edited by hand, so that the ConfigMap always carries the current
``contenders.py``. What it holds and how to use it is in ``manifests/benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MANIFEST = ROOT / "manifests" / "benchmarks" / "benchmark.yaml"
NAMESPACE = "modelload-benchmark"
LABEL = "modelload.dev/benchmark"
SIDECAR_IMAGE = "ghcr.io/modelload/sidecar:0.1.0"
PYTHON_IMAGE = "python:3.11-slim-bookworm"
ROUNDS = 3

# What each contender installs before it is measured (the install is not timed). torch's CPU build: the loads
# land in CPU memory, and the CUDA wheels would add gigabytes to every pod's start.
TORCH = "pip install -q --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
INSTALL = {
    "tensorizer": f"apt-get update -qq && apt-get install -y -qq curl >/dev/null && {TORCH} && "
    "pip install -q --no-cache-dir tensorizer==2.12.1",
    "runai": f"{TORCH} && pip install -q --no-cache-dir runai-model-streamer==0.17.0 "
    "'runai-model-streamer-s3>=0.17,<0.18'",
}
SOURCE = {"sidecar": "SOURCE_SAFETENSORS", "tensorizer": "SOURCE_TENSORIZER", "runai": "SOURCE_SAFETENSORS"}


def settings() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "modelload-benchmark-settings", "namespace": NAMESPACE},
        "data": {
            # Set these to your model: the same tensors as safetensors (sidecar, Run:ai) and as tensorizer.
            "SOURCE_SAFETENSORS": "s3://YOUR-BUCKET/model/model.safetensors",
            "SOURCE_TENSORIZER": "s3://YOUR-BUCKET/model/model.tensors",
            # Ranges in flight and bytes per range, for all three (Run:ai: RUNAI_STREAMER_CONCURRENCY and
            # RUNAI_STREAMER_CHUNK_BYTESIZE; tensorizer: num_readers).
            "READERS": "16",
            "CHUNK_BYTES": str(16 << 20),
            # Empty for AWS; an endpoint URL for another S3 service (path-style addressing is used then).
            "S3_ENDPOINT": "",
            "AWS_DEFAULT_REGION": "us-east-1",
        },
    }


def script() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "modelload-benchmark-contenders", "namespace": NAMESPACE},
        "data": {"contenders.py": (HERE / "contenders.py").read_text()},
    }


def job(contender: str) -> dict[str, Any]:
    measure = (
        f'python /bench/contenders.py {contender} --source "${SOURCE[contender]}" --readers "$READERS" '
        '--chunk "$CHUNK_BYTES" ${S3_ENDPOINT:+--s3-endpoint "$S3_ENDPOINT"}'
    )
    if contender == "sidecar":
        measure += " --sidecar-command modelload --segment /run/modelload/model.seg"
        command = measure
        image = SIDECAR_IMAGE
    else:
        command = f"{INSTALL[contender]} && {measure}"
        image = PYTHON_IMAGE
    container: dict[str, Any] = {
        "name": contender,
        "image": image,
        "command": ["/bin/sh", "-c", f"set -e; {command}"],
        "envFrom": [
            {"configMapRef": {"name": "modelload-benchmark-settings"}},
            # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; leave the Secret out to use the node's or the
            # service account's credentials (IRSA, Pod Identity).
            {"secretRef": {"name": "modelload-benchmark-s3", "optional": True}},
        ],
        "resources": {
            # The other contenders hold the whole model in private memory; the sidecar holds it in the segment (the
            # emptyDir below, counted against the pod's memory). Raise both to your model's size + 2 GiB.
            "requests": {"cpu": "4", "memory": "20Gi"},
            "limits": {"memory": "20Gi"},
        },
        "volumeMounts": [{"name": "contenders", "mountPath": "/bench", "readOnly": True}],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "contenders", "configMap": {"name": "modelload-benchmark-contenders"}}
    ]
    if contender == "sidecar":
        container["volumeMounts"].append({"name": "segment", "mountPath": "/run/modelload"})
        volumes.append({"name": "segment", "emptyDir": {"medium": "Memory", "sizeLimit": "18Gi"}})
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": f"modelload-benchmark-{contender}",
            "namespace": NAMESPACE,
            "labels": {LABEL: contender},
        },
        "spec": {
            # One load per pod, ROUNDS pods one after another: each is a fresh process on a fresh node
            # cache, as a pod's start is.
            "completions": ROUNDS,
            "parallelism": 1,
            "backoffLimit": 1,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": {LABEL: contender}},
                "spec": {
                    "restartPolicy": "Never",
                    # The three Jobs run side by side, each on a node of its own, so they never share a NIC.
                    "affinity": {
                        "podAntiAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "labelSelector": {
                                        "matchExpressions": [
                                            {"key": LABEL, "operator": "NotIn", "values": [contender]},
                                            {"key": LABEL, "operator": "Exists"},
                                        ]
                                    },
                                    "topologyKey": "kubernetes.io/hostname",
                                }
                            ]
                        }
                    },
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def render() -> str:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    docs = [namespace, settings(), script(), *(job(c) for c in ("sidecar", "tensorizer", "runai"))]
    header = "# Generated by `python benchmarks/cluster.py --write`: do not edit (see manifests/benchmarks/README.md).\n"
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true")
    action.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        MANIFEST.parent.mkdir(parents=True, exist_ok=True)
        MANIFEST.write_text(text)
        print(f"wrote {MANIFEST.relative_to(ROOT)}")
        return 0
    if not MANIFEST.exists() or MANIFEST.read_text() != text:
        print(f"{MANIFEST.relative_to(ROOT)} is out of date: run python benchmarks/cluster.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
