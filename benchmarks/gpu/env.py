"""What the GPU check ran on, as one JSON object: the GPU, its driver, torch, Python, CPUs, memory, load.

    python benchmarks/gpu/env.py OUT.json

Standard library (and torch when it imports): it runs first, before anything is installed, so a check whose
install fails still says which machine it was.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "timed out"
    return (done.stdout or done.stderr).strip()


def _meminfo() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable", "Hugepagesize"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        return {"torch": f"not importable: {exc}"}
    info: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory": props.total_memory, "capability": f"{props.major}.{props.minor}",
                 "gpus": torch.cuda.device_count()}  # fmt: skip
    else:
        info["gpu"] = None
    return info


def main() -> None:
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "memory": _meminfo(),
        "dev_shm_free": shm.free if shm else None,
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
                            "pcie.link.width.current,clocks.sm,clocks.mem", "--format=csv,noheader"]),
        "commit": os.environ.get("MODELLOAD_COMMIT", "unknown"),
        **_torch(),
    }  # fmt: skip
    text = json.dumps(info, indent=1)
    Path(sys.argv[1]).write_text(text + "\n")
    print(text)
    print(
        f"{info.get('gpu') or 'no CUDA GPU'}; torch {info.get('torch')} (CUDA {info.get('torch_cuda')}); "
        f"Python {info['python']}; {info['cpus']} CPUs; load {info['loadavg'][0]:.1f}"
    )


if __name__ == "__main__":
    main()
