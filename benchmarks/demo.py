"""modelload's main job on an embedded default: a local S3 server, a model made here, the real sidecar.

``make demo`` runs this. Step by step:

1. build a small transformer (``demo_model.TinyLM``, random bf16 weights, a few hundred MB; nothing is
   downloaded) and compute its output on a fixed prompt, the reference;
2. start a local S3 server on 127.0.0.1 and upload the model as a Hugging Face-style directory: safetensors
   shards, ``model.safetensors.index.json`` and ``config.json``. The server is npm's s3rver (``make demo``
   installs it into ``.bench-tools/``): a real S3 server that stays fast under parallel ranged GETs. Where
   Node is missing, moto's server instead, which reads the whole object for every ranged GET, so the load is
   then moto's speed, not the sidecar's;
3. start ``modelload sidecar`` on the prefix ``s3://demo/tinylm/`` with a segment in /dev/shm, exactly as
   the operator's webhook would in a pod (flags and ``AWS_*`` environment): every shard into one segment,
   the config into the model directory beside it;
4. start a separate inference process that reads the config from the model directory, builds the model on
   the ``meta`` device, attaches to the segment and runs the forward pass block by block, each block as soon
   as its weights are in;
5. check its output against the reference, and print the timeline from both sides.

``benchmarks/run.py`` compares the sidecar with the loaders a user would use instead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the repository root, for tests.support

from demo_model import Config, build, prompt  # noqa: E402
from origins import S3RVER_KEY, S3RVER_SECRET, Unavailable, s3rver  # noqa: E402
from scratch import scratch  # noqa: E402

from tests.support.processes import stop_process  # noqa: E402

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": S3RVER_KEY,  # the account s3rver checks signatures against (moto takes any)
    "AWS_SECRET_ACCESS_KEY": S3RVER_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET, PREFIX = "demo", "tinylm/"
SHARDS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, *, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def running(args: list[str], *, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process, stopped with SIGTERM (then SIGKILL) when the block ends."""
    with log.open("wb") as out:
        process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            stop_process(process)


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="modelload's main job on an embedded default")
    parser.add_argument("--layers", type=int, default=Config.layers)
    parser.add_argument("--width", type=int, default=Config.width)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--chunk-size", default="16MiB")
    parser.add_argument("--keep", action="store_true", help="keep the work folder for a look afterwards")
    args = parser.parse_args(argv)
    config = Config(layers=args.layers, width=args.width, mlp=args.width * 11 // 4)
    torch.set_num_threads(2)

    with scratch("modelload-demo-", keep=args.keep) as work:
        return run(config, work, args)


def run(config: Config, work: Path, args: argparse.Namespace) -> int:
    step(
        f"building TinyLM: {config.layers} blocks, width {config.width}, "
        f"{config.parameters / 1e6:.0f} M parameters (bf16)"
    )
    model = build(config).to(torch.bfloat16)
    with torch.no_grad():
        expected = model(prompt(config))
    torch.save(expected, work / "expected.pt")

    files = hf_directory(model.state_dict(), config)
    del model
    total = sum(len(data) for data in files.values())
    step(f"a model directory: {SHARDS} safetensors shards, index and config, {total / 2**20:.0f} MiB")

    env = {**os.environ, **CREDENTIALS, "PYTHONUNBUFFERED": "1"}
    for variable in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        env.pop(variable, None)
    with s3_server(work, env) as (endpoint, server_name):
        step(f"{server_name} on {endpoint}")
        upload(endpoint, files)
        step(f"uploaded s3://{BUCKET}/{PREFIX} ({', '.join(sorted(files))})")
        del files
        return load_and_infer(config, work, args, env, endpoint, free_port(), server_name)


@contextlib.contextmanager
def s3_server(work: Path, env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """s3rver where Node and ``make demo``'s install of it are there, moto's server otherwise."""
    with contextlib.ExitStack() as stack:
        try:
            origin = stack.enter_context(s3rver(work / "s3rver", bucket=BUCKET))
        except Unavailable as exc:
            step(f"s3rver unavailable ({exc}): using moto's S3 server, whose ranged GETs are slow")
        else:
            yield origin.s3_endpoint, "s3rver (a real S3 server, Node)"
            return
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with running(moto, env=env, log=work / "moto.log") as server:
        wait_for(f"{endpoint}/", timeout=60, process=server)
        yield endpoint, "moto's S3 server"


def hf_directory(state: dict[str, torch.Tensor], config: Config) -> dict[str, bytes]:
    """The model as a Hugging Face checkpoint has it: shards of consecutive tensors, the index, the config."""
    from modelload.loader.formats.safetensors import serialize

    names = list(state)
    per_shard = -(-len(names) // SHARDS)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for number in range(SHARDS):
        group = names[number * per_shard : (number + 1) * per_shard]
        shard = f"model-{number + 1:05d}-of-{SHARDS:05d}.safetensors"
        files[shard] = serialize({name: state[name] for name in group}, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, shard))
    files["model.safetensors.index.json"] = json.dumps({"weight_map": weight_map}, indent=2).encode()
    files["config.json"] = json.dumps({"model_type": "tinylm", **config.__dict__}, indent=2).encode()
    return files


def upload(endpoint: str, files: dict[str, bytes]) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials())
    if BUCKET not in {bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=BUCKET)
    for name, data in files.items():
        client.upload_fileobj(
            io.BytesIO(data), BUCKET, PREFIX + name, Config=TransferConfig(multipart_chunksize=64 << 20)
        )


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def load_and_infer(
    config: Config,
    work: Path,
    args: argparse.Namespace,
    env: dict[str, str],
    endpoint: str,
    api_port: int,
    server_name: str,
) -> int:
    segment = work / "model.seg"
    sidecar = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar",
        "--source", f"s3://{BUCKET}/{PREFIX}",
        "--segment", str(segment),
        "--s3-endpoint", endpoint,
        "--readers", str(args.readers),
        "--chunk-size", args.chunk_size,
        "--host", "127.0.0.1",
        "--port", str(api_port),
    ]  # fmt: skip
    inference = [
        sys.executable, str(HERE / "demo_model.py"), "infer",
        "--segment", str(segment),
        "--expected", str(work / "expected.pt"),
    ]  # fmt: skip
    # The inference process starts first and waits for the segment, as an app container does when the pod
    # starts: its interpreter and torch are up before the first weight arrives, so the timeline shows what
    # the sidecar does rather than how long torch takes to import.
    step("starting the inference process, then the sidecar beside it")
    app = subprocess.Popen(inference, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert app.stderr is not None
    app.stderr.readline()  # "waiting for the segment": imports done
    started = time.time()
    with running(sidecar, env=env, log=work / "sidecar.log") as side:
        out, err = app.communicate(timeout=900)
        infer = subprocess.CompletedProcess(inference, app.returncode, out, err)
        status = read_status(api_port)
        if side.poll() is not None:
            print((work / "sidecar.log").read_text(), file=sys.stderr)
    if infer.returncode not in (0, 1) or not infer.stdout.strip():
        print(infer.stderr, file=sys.stderr)
        print((work / "sidecar.log").read_text()[-4000:], file=sys.stderr)
        step("the inference process failed")
        return 1
    result = json.loads(infer.stdout.strip().splitlines()[-1])
    report(started, status, result, server_name)
    return 0 if result["matches"] else 1


def read_status(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        return dict(json.load(response))


def report(started: float, status: dict[str, object], result: dict[str, object], server_name: str) -> None:
    def at(value: object) -> str:
        return f"{float(value) - started:7.2f} s" if isinstance(value, (int, float)) else "      -"

    size = int(status["bytes_total"])  # type: ignore[call-overload]
    load_seconds = float(status["finished_at"]) - float(status["started_at"])  # type: ignore[arg-type]
    steps = result["steps"]
    assert isinstance(steps, list)
    print()
    print("timeline (seconds after the sidecar was started)")
    rows = [
        ("sidecar: manifest published, an app can attach", status["manifest_at"]),
        (
            f"inference: attached ({result['tensors_ready_at_attach']}/{result['tensors']} tensors in)",
            result["attached_at"],
        ),
        ("sidecar: first tensor ready", status["first_tensor_at"]),
        ("inference: embedding and block 0 computed", result["first_block_done_at"]),
        (f"sidecar: all {status['tensors_total']} tensors ready", status["finished_at"]),
        ("inference: forward pass done", result["done_at"]),
    ]
    # in the order things happened: the two sides interleave, which is the point
    for label, when in sorted(
        rows, key=lambda row: float(row[1]) if isinstance(row[1], (int, float)) else 1e30
    ):
        print(f"  {label:<50} {at(when)}")
    print()
    print(
        f"  loaded {size / 2**20:.0f} MiB in {load_seconds:.2f} s: "
        f"{size / load_seconds / 2**20:.0f} MiB/s from {server_name.split(' (', maxsplit=1)[0]} "
        f"({status['retries']} retries)"
    )
    overlap = [name for name, when in steps if when < float(status["finished_at"])]  # type: ignore[arg-type]
    if overlap:
        print(f"  computed while the load was still running: {', '.join(overlap)}")
    else:
        # on a busy machine the load can beat the first block's compute; the tensors were still usable early
        print(
            "  computed while the load was still running: nothing (the load ended before the first block's "
            "compute did; the attach above shows the tensors usable before the load ended)"
        )
    verdict = (
        "bitwise equal to"
        if result["bitwise_equal"]
        else ("matches" if result["matches"] else "DIFFERS FROM")
    )
    print(f"  output {verdict} the reference (max |difference| {result['max_abs_difference']:.3g})")


if __name__ == "__main__":
    sys.exit(main())
