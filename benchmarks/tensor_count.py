"""What tensor count costs: MoE-shaped directories (thousands of small tensors, many shards) against the
same bytes as big tensors, in one run, from each kind of origin.

Mixtures of experts carry 20,000 to 100,000+ tensors of a few KiB to a few MiB in 100+ shards. A loader
whose cost follows the tensor count rather than the bytes pays that on every pod start. For each point
(``--counts``, each with a proportionate number of shards) this builds a safetensors directory of
``count`` tensors of 4-16 KiB (float16, MoE-style names) plus two of 32 MiB, and its *big twin*: the same
bytes as 32 MiB tensors in 4 shards. Both load with a real ``modelload sidecar`` from each origin:

- ``file``: the local directory;
- ``http``: nginx over loopback (the HTTP directory is found through ``model.safetensors.index.json``);
- ``s3like``: the S3-like origin of ``origins.s3_like`` (per-response rate cap, round-trip delay) over its
  path-style S3 stand-in, the files named (``--files``: the stand-in cannot list);
- ``s3rver``: a real S3 server (SigV4, listing).

Per load: the sidecar's CPU-seconds per GiB (user + system of its process over the load, from its own
``/status`` clock), the requests the server answered (nginx's access log; s3rver's request log), when the
manifest was published (seconds after the engine started), the sidecar's peak RSS besides the segment
(``RssAnon + RssFile``), and, in a fresh process while the segment is still there, the CPU of ``attach()`` +
``state_dict()`` (imports not counted). The goals it checks (printed at the end, and in the report):

- CPU per GiB with small tensors at most 1.5 x the big twin's, from the same origin in the same round;
- requests per load at most 4 per file + 2 per chunk of weights (``ceil(weight bytes / chunk size)``), not
  counting the 404s of an HTTP directory's probes (it has no listing: each well-known small-file name it
  may hold is asked for once, a fixed cost whatever the model; they are reported apart);
- sidecar RSS besides the segment under 128 MiB at 100k tensors;
- ``attach()`` + ``state_dict()`` under 1 CPU-second at 100k tensors.

Raw results go to ``benchmarks/results/tensor-count-TIMESTAMP.jsonl`` (a ``meta`` line, then one line per
load); ``--publish`` copies them to ``docs/tensor-count.jsonl`` and runs ``report.py``, which writes the table.

    python benchmarks/tensor_count.py [--counts 1000,10000,50000,100000] [--origins file,http,s3like,s3rver]
                                      [--runs 1] [--readers 8] [--chunk-mib 32] [--publish]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from contenders import ProcSampler, wait_complete  # noqa: E402
from origins import S3RVER_KEY, S3RVER_SECRET, Unavailable, s3_like, s3rver, upload  # noqa: E402
from scratch import scratch  # noqa: E402

from tests.support.nginx import NginxServer  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
SHARDS = {1000: 4, 10000: 40, 50000: 100, 100000: 160}
"""Shards per tensor count, as MoE checkpoints split them (about 625 tensors a shard)."""
BIG_TENSOR = 32 * MIB
INDEX = "model.safetensors.index.json"

GOAL_CPU_RATIO = 1.5
GOAL_RSS = 128 * MIB
GOAL_ATTACH_CPU = 1.0
GOAL_AT = 100_000
"""The tensor count at which the RSS and attach goals are checked."""


@dataclass(frozen=True)
class Model:
    """A model directory on disk: its files, weight bytes and tensor count."""

    folder: Path
    files: tuple[str, ...]
    weight_files: int
    nbytes: int
    tensors: int


def shards_for(count: int) -> int:
    return SHARDS.get(count, max(1, round(count / 625)))


def make_moe(folder: Path, count: int, *, seed: int = 0, large: int = BIG_TENSOR) -> Model:
    """``count`` float16 tensors of 4-16 KiB (two of them ``large`` bytes, 32 MiB by default) in
    ``shards_for(count)`` safetensors shards, with ``model.safetensors.index.json`` and ``config.json``,
    written by the real ``safetensors``."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 64 * MIB, dtype=np.uint8).view(np.float16)
    elements = rng.integers(2048, 8193, count)
    elements[0] = elements[-1] = large // 2  # the embeddings and the output layer
    names = [_moe_name(i, count) for i in range(count)]
    return _write(folder, names, elements, pool, rng, shards=shards_for(count))


def make_big(folder: Path, nbytes: int, *, seed: int = 1) -> Model:
    """The same bytes as 32 MiB float16 tensors (the last one smaller) in 4 shards."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 64 * MIB, dtype=np.uint8).view(np.float16)
    sizes = [BIG_TENSOR // 2] * (nbytes // BIG_TENSOR)
    if nbytes % BIG_TENSOR:
        sizes.append(nbytes % BIG_TENSOR // 2)
    names = [f"model.layers.{i}.weight" for i in range(len(sizes))]
    return _write(folder, names, np.asarray(sizes), pool, rng, shards=min(4, len(sizes)))


def _moe_name(i: int, count: int) -> str:
    if i == 0:
        return "model.embed_tokens.weight"
    if i == count - 1:
        return "lm_head.weight"
    layer, rest = divmod(i - 1, 3 * 128 + 2)
    if rest >= 3 * 128:
        return f"model.layers.{layer}.{('input', 'post_attention')[rest - 3 * 128]}_layernorm.weight"
    expert, which = divmod(rest, 3)
    return f"model.layers.{layer}.mlp.experts.{expert}.{('gate', 'up', 'down')[which]}_proj.weight"


def _write(folder: Path, names: list[str], elements: Any, pool: Any, rng: Any, *, shards: int) -> Model:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    files = []
    nbytes = 0
    for number in range(shards):
        tensors = {}
        for i in range(number * per, min(len(names), (number + 1) * per)):
            k = int(elements[i])
            start = int(rng.integers(0, len(pool) - k))
            tensors[names[i]] = pool[start : start + k]
            nbytes += 2 * k
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        files.append(name)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": nbytes}, "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    return Model(folder, (*files, INDEX, "config.json"), len(files), nbytes, len(names))


# --- origins, each with a request counter ---------------------------------------------------------------


@dataclass
class Served:
    """An origin serving the benchmark's folder: the sidecar's source for a model, and its request count."""

    name: str
    count_requests: Any
    source_for: Any
    extra_argv: Any = None


def _count_lines(path: Path, pattern: str | None = None) -> tuple[int, int]:
    """Requests logged at ``path`` (lines, or lines matching ``pattern``), and how many of them were 404s:
    an HTTP directory has no listing, so the well-known names it may hold are probed, and the absent ones
    answer 404 (a fixed cost of the directory, whatever the model)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return 0, 0
    lines = text.splitlines() if pattern is None else re.findall(pattern, text)
    return len(lines), sum(1 for line in lines if '" 404 ' in line)


@contextlib.contextmanager
def origin(kind: str, root: Path, work: Path) -> Iterator[Served]:
    """``kind``'s origin over ``root`` (every model folder under it)."""
    if kind == "file":
        yield Served("file", lambda: (None, None), lambda model: str(model.folder))
    elif kind == "http":
        log = work / "nginx-access.log"
        server = NginxServer(root, bucket="bench", workers=2, access_log=log)
        try:
            yield Served("http", lambda: _count_lines(log), lambda model: server.url(model.folder.name) + "/")
        finally:
            server.stop()
    elif kind == "s3like":
        log = work / "s3like-access.log"
        with s3_like(root, access_log=log) as served:

            def argv(model: Model) -> list[str]:
                return ["--s3-endpoint", served.s3_endpoint, "--s3-addressing", "path",
                        "--files", ",".join(model.files)]  # fmt: skip

            yield Served(
                "s3like",
                lambda: _count_lines(log),
                lambda model: served.s3_uri(model.folder.name) + "/",
                argv,
            )
    elif kind == "s3rver":
        log, data = work / "s3rver.log", work / "s3rver-data"
        # Each tensor count's models are uploaded afresh and dropped after: kept, the copies of every count
        # so far (3.6 GiB by the last) sat in this machine's memory beside the loads measured.
        shutil.rmtree(data, ignore_errors=True)
        with s3rver(data, log=log) as served:
            uploaded: set[str] = set()

            def source(model: Model) -> str:
                if model.folder.name not in uploaded:
                    upload(served, {f"{model.folder.name}/{f}": model.folder / f for f in model.files})
                    uploaded.add(model.folder.name)
                return served.s3_uri(model.folder.name) + "/"

            def argv(model: Model) -> list[str]:
                return ["--s3-endpoint", served.s3_endpoint, "--s3-addressing", "path"]

            yield Served("s3rver", lambda: _count_lines(log, r"info\S*: .*ms"), source, argv)
        shutil.rmtree(data, ignore_errors=True)
    else:
        raise SystemExit(f"unknown origin {kind!r} (file, http, s3like, s3rver)")


# --- one load -------------------------------------------------------------------------------------------

ATTACH = """
import json, sys, time
import torch
from modelload.loader import attach
t0 = time.process_time()
model = attach(sys.argv[1], notify=False, register=False)
state = model.state_dict()
cpu = time.process_time() - t0
print(json.dumps({"attach_state_dict_cpu_s": cpu, "tensors": len(state)}))
"""


def load(
    model: Model, served: Served, segment: Path, *, readers: int, chunk: int, env: dict[str, str]
) -> dict[str, Any]:
    """One sidecar load of ``model`` from ``served``; the figures of the module docstring."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    argv = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar", "--source", served.source_for(model),
        "--segment", str(segment), "--readers", str(readers), "--chunk-size", str(chunk),
        "--host", "127.0.0.1", "--port", str(port), "--notify", "none",
    ]  # fmt: skip
    if served.extra_argv is not None:
        argv += served.extra_argv(model)
    before, absent_before = served.count_requests()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = ProcSampler(process.pid)
    try:
        try:
            status = wait_complete(port, process, timeout_s=1800)
        except (RuntimeError, TimeoutError) as exc:
            return {"error": str(exc).strip().splitlines()[-1][:300]}
        time.sleep(0.05)  # one more CPU sample after the finish
        peak = sampler.stop()
        attached = subprocess.run(
            [sys.executable, "-c", ATTACH, str(segment)], capture_output=True, text=True, env=env, check=False
        )
    finally:
        sampler.stop()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        segment.unlink(missing_ok=True)
        (segment.parent / "model").exists() and shutil.rmtree(segment.parent / "model", ignore_errors=True)
    started, finished = float(status["started_at"]), float(status["finished_at"])
    cpu = sampler.cpu_at(finished + 0.01) - sampler.cpu_at(started)
    after, absent_after = served.count_requests()
    figures: dict[str, Any] = {
        "seconds": finished - started,
        "nbytes": int(status["bytes_total"]),
        "cpu_s": cpu,
        "cpu_s_per_gib": cpu / (int(status["bytes_total"]) / GIB),
        "gib_s": int(status["bytes_total"]) / (finished - started) / GIB,
        "manifest_s": float(status["manifest_at"]) - started,
        "peak_rss": peak,
        "requests": None if before is None or after is None else after - before,
        "not_found": None if before is None or after is None else absent_after - absent_before,
    }
    if attached.returncode == 0:
        figures.update(json.loads(attached.stdout.strip().splitlines()[-1]))
    else:
        figures["attach_error"] = (attached.stderr.strip().splitlines() or ["?"])[-1][:300]
    return figures


def request_bound(model: Model, chunk: int) -> int:
    """The most requests a load of ``model`` may take: 4 per file, 2 per chunk of weights."""
    return 4 * len(model.files) + 2 * -(-model.nbytes // chunk)


# --- the run --------------------------------------------------------------------------------------------


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    return {
        "meta": True,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg()[0],
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,10000,50000,100000", help="tensor counts, comma-separated")
    parser.add_argument("--origins", default="file,http,s3like,s3rver")
    parser.add_argument("--runs", type=int, default=1, help="rounds of each point")
    parser.add_argument("--readers", type=int, default=8, help="readers on loopback origins")
    parser.add_argument("--remote-readers", type=int, default=16, help="readers on the S3-like origin")
    parser.add_argument("--chunk-mib", type=int, default=32, help="--chunk-size of the sidecar, MiB")
    parser.add_argument("--large-mib", type=int, default=32, help="the two large tensors of each model, MiB")
    parser.add_argument("--out", type=Path, default=None, help="the JSON lines file")
    parser.add_argument("--publish", action="store_true", help="copy the results to docs/ and report")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    chunk = args.chunk_mib * MIB
    out = args.out or HERE / "results" / f"tensor-count-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=S3RVER_KEY, AWS_SECRET_ACCESS_KEY=S3RVER_SECRET, AWS_DEFAULT_REGION="us-east-1",
               NO_PROXY="*", PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))  # fmt: skip
    failed = False
    with out.open("w") as results, scratch("modelload-tensor-count-") as work:
        results.write(json.dumps(metadata(args)) + "\n")
        root = work / "models"
        for count in counts:
            small = make_moe(root / f"moe-{count}", count, large=args.large_mib * MIB)
            big = make_big(root / f"big-{count}", small.nbytes)
            print(f"{count} tensors in {small.weight_files} shards, {small.nbytes / GIB:.2f} GiB "
                  f"(big twin: {big.tensors} tensors)", flush=True)  # fmt: skip
            for kind in args.origins.split(","):
                readers = args.remote_readers if kind == "s3like" else args.readers
                try:
                    with origin(kind, root, work) as served:
                        for number in range(args.runs):
                            for model, shape in ((small, "small"), (big, "big")):
                                figures = load(model, served, work / "model.seg", readers=readers, chunk=chunk,
                                               env=env)  # fmt: skip
                                record = {
                                    "origin": kind, "count": count, "shape": shape, "round": number,
                                    "tensors": model.tensors, "files": len(model.files),
                                    "request_bound": request_bound(model, chunk), "readers": readers,
                                    "chunk": chunk, "load_avg": os.getloadavg()[0], **figures,
                                }  # fmt: skip
                                results.write(json.dumps(record) + "\n")
                                results.flush()
                                failed |= "error" in figures
                                print("  " + _line(record), flush=True)
                except Unavailable as exc:
                    print(f"  [{kind}] skipped: {exc}", flush=True)
                    results.write(json.dumps({"origin": kind, "count": count, "skipped": str(exc)}) + "\n")
            shutil.rmtree(small.folder, ignore_errors=True)
            shutil.rmtree(big.folder, ignore_errors=True)
    records = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    print(goals(records))
    print(f"results: {out}")
    if args.publish:
        shutil.copyfile(out, ROOT / "docs" / "tensor-count.jsonl")
        subprocess.run([sys.executable, str(HERE / "report.py")], check=True)
    return 1 if failed else 0


def _line(record: dict[str, Any]) -> str:
    head = f"[{record['origin']} {record['count']} {record['shape']} r{record['round']}]"
    if "error" in record:
        return f"{head} failed: {record['error']}"
    requests = "-" if record["requests"] is None else f"{record['requests']}/{record['request_bound']}"
    if record.get("not_found"):
        requests += f" ({record['not_found']} 404)"
    attach = record.get("attach_state_dict_cpu_s")
    return (
        f"{head:<28} {record['cpu_s_per_gib']:6.2f} CPU-s/GiB {record['gib_s']:5.2f} GiB/s "
        f"requests {requests:>13} manifest {record['manifest_s']:5.2f} s RSS {record['peak_rss'] / MIB:5.0f} MiB "
        f"attach+state_dict {attach if attach is None else round(attach, 2)} CPU-s (load {record['load_avg']:.1f})"
    )


def goals(records: list[dict[str, Any]]) -> str:
    """Each goal of the module docstring against what the records measured."""
    lines = ["goals:"]
    ok = [r for r in records if "cpu_s" in r]
    for r in ok:
        if r["shape"] != "small":
            continue
        twin = next((b for b in ok if b["shape"] == "big" and
                     (b["origin"], b["count"], b["round"]) == (r["origin"], r["count"], r["round"])), None)  # fmt: skip
        parts = []
        if twin is not None:
            ratio = r["cpu_s_per_gib"] / twin["cpu_s_per_gib"]
            parts.append(f"CPU/GiB {ratio:.2f} x big ({_verdict(ratio <= GOAL_CPU_RATIO)})")
        if r["requests"] is not None:
            found = r["requests"] - (r.get("not_found") or 0)  # probes of absent names excluded
            parts.append(
                f"requests {found} <= {r['request_bound']} ({_verdict(found <= r['request_bound'])})"
            )
        if r["count"] >= GOAL_AT:
            parts.append(f"RSS {r['peak_rss'] / MIB:.0f} MiB ({_verdict(r['peak_rss'] < GOAL_RSS)})")
            cpu = r.get("attach_state_dict_cpu_s")
            if cpu is not None:
                parts.append(f"attach+state_dict {cpu:.2f} CPU-s ({_verdict(cpu < GOAL_ATTACH_CPU)})")
        lines.append(f"- {r['origin']} {r['count']} r{r['round']}: " + "; ".join(parts))
    return "\n".join(lines)


def _verdict(reached: bool) -> str:
    return "reached" if reached else "NOT reached"


if __name__ == "__main__":
    sys.exit(main())
