"""The wheels the GPU check installs on a machine without network access, and the check that they fit.

A GPU machine of the kind the check runs on has python3 with torch (CUDA), transformers, safetensors and
pytest, and reaches no package index. What modelload needs beyond that (pynacl, pyzmq, the sidecar's
FastAPI, uvicorn and ISA-L, pytest-asyncio, the transformers version the tests pin) travels beside the
check as wheels, downloaded here for the GPU machine's Python and platform, plus modelload itself as a wheel.

    python benchmarks/gpu/wheels.py --python 3.12 --dest .gpu-wheels     # make gpu-wheels GPU_PYTHON=3.12
    python benchmarks/gpu/wheels.py --digest                              # the source digest (check.sh)

The folder gets ``requirements.txt`` (what the check asks pip for, resolved with ``--no-index`` against
the folder and what the machine already has) and ``wheels.json`` (the Python and platforms it was made for,
the commit, a digest of the project's sources so the check can tell a stale project wheel, and every
wheel's size). Boto3 is left out on purpose: the check loads from local files, and botocore alone is 13 MB.

Standard library only: check.sh runs ``--digest`` on the GPU machine before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
SOURCES = ("loader", "sidecar", "operator")

# What the GPU machine's image already holds (as read on 2026-11-17: /work/.library/device/KINDS.md lists
# it): their wheels are not carried, and pip resolves them against the installed versions. torch and
# accelerate are never downloaded (accelerate requires torch, which would pull gigabytes of CUDA wheels).
IMAGE = {
    "accelerate", "annotated-doc", "anyio", "certifi", "charset-normalizer", "click", "filelock", "fsspec",
    "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna", "iniconfig", "jinja2", "markupsafe",
    "numpy", "packaging", "pluggy", "prometheus-client", "psutil", "pygments", "pytest", "pytest-timeout",
    "pyyaml", "regex", "requests", "rich", "safetensors", "setuptools", "shellingham", "six", "tokenizers",
    "torch", "tqdm", "typer", "typing-extensions", "urllib3", "wheel",
}  # fmt: skip
NEVER = {"torch", "accelerate"}


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements() -> tuple[list[str], list[str]]:
    """What the check needs beyond the image, from pyproject.toml: the base install, the sidecar and
    transformers extras (without their self-references), and the test plugins. Two lists: what is
    downloaded, and what the image must already satisfy (never downloaded: accelerate requires torch)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    dev = {_name(r): r for r in extras["dev"]}
    wanted = [*project["dependencies"], *extras["sidecar"], *extras["transformers"]]
    wanted += [dev["pytest-asyncio"], dev["pytest-timeout"], dev["transformers"]]
    chosen: dict[str, str] = {}
    installed_only = []
    for requirement in wanted:
        name = _name(requirement)
        if name == "modelload":
            continue
        if name in NEVER:
            installed_only.append(requirement)
            continue
        if name == "transformers" and "==" not in requirement and name in chosen:
            continue  # the dev pin (the version the tests ran against) wins over the extra's range
        chosen[name] = requirement
    return list(chosen.values()), installed_only


def source_digest(root: Path = ROOT) -> str:
    """A digest of what the project wheel is built from: every file under the package folders and
    pyproject.toml (caches left out), so a wheel from other sources is told apart."""
    digest = hashlib.sha256()
    files = [root / "pyproject.toml"]
    for top in SOURCES:
        files += [p for p in (root / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(files):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def download(dest: Path, python: str) -> None:
    wanted, installed_only = requirements()
    abi = "cp" + python.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", tmp,
               "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
               "--abi", "none", *(f"--platform={p}" for p in PLATFORMS), *wanted]  # fmt: skip
        subprocess.run(pip, check=True)
        for wheel in Path(tmp).glob("*.whl"):
            name = _name(wheel.name.split("-")[0])
            if name not in IMAGE or name == "transformers":
                shutil.copy2(wheel, dest / wheel.name)
    project = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
               "--wheel-dir", str(dest), str(ROOT)]  # fmt: skip
    subprocess.run(project, check=True)
    (dest / "requirements.txt").write_text("\n".join(["modelload", *wanted, *installed_only]) + "\n")


def _commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--", *SOURCES, "pyproject.toml")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the GPU machine's Python, X.Y (default: this one's)")  # fmt: skip
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--limit-mib", type=float, default=56.0,
                        help="refuse a folder larger than this (the device tool carries 64 MiB in all)")  # fmt: skip
    parser.add_argument("--digest", action="store_true", help="print the sources' digest and exit")
    args = parser.parse_args(argv)
    if args.digest:
        print(source_digest())
        return 0
    if not re.fullmatch(r"3\.\d+", args.python):
        parser.error(f"--python {args.python!r}: give the GPU machine's Python as X.Y, such as 3.12")
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    download(args.dest, args.python)
    wheels = {w.name: w.stat().st_size for w in sorted(args.dest.glob("*.whl"))}
    total = sum(wheels.values())
    manifest = {"python": args.python, "platforms": PLATFORMS, "commit": _commit(),
                "source_digest": source_digest(), "bytes": total, "wheels": wheels}  # fmt: skip
    (args.dest / "wheels.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for name, size in wheels.items():
        print(f"{size / (1 << 20):7.2f} MiB  {name}")
    print(f"{total / (1 << 20):7.2f} MiB in {len(wheels)} wheels for CPython {args.python} in {args.dest}")
    if total > args.limit_mib * (1 << 20):
        print(
            f"gpu-wheels: {total / (1 << 20):.1f} MiB is over --limit-mib {args.limit_mib:g}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
