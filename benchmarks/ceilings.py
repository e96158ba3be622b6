"""modelload's sidecar against the raw sources and against tensorizer, in one run, on one model.

The sidecar against what bounds it (``run.py`` compares it with the other loaders). For each source (a
local file, HTTP from nginx, S3 from nginx posing as a path-style S3 endpoint):

- the raw ceiling: N threads reading the whole object in chunk-sized ranges into reused buffers, with the
  same concurrency as the sidecar (and ``cat``/``curl`` as a single-stream reference);
- the sidecar: ``modelload sidecar`` from process start until every tensor is READY in a fresh segment, with
  and without hash verification; its time to the manifest and to the first tensor; its peak memory besides
  the segment;
- tensorizer 2.12's ``TensorDeserializer`` loading the same file to CPU memory, best of 1, 4 and 8 readers;
- the same tensors as safetensors, once as one file and once as a Hugging Face directory of ``--shards``
  files: the sidecar's throughput across shards against the single file, in the same rounds.

The machines are shared and noisy: each figure is the median of ``--runs`` runs, contenders alternate within
a round, and what matters are the ratios printed at the end.

    python benchmarks/ceilings.py [--size 2] [--readers 8] [--chunk-size 32MiB] [--runs 3] [--sources file,http,s3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from harness import (  # noqa: E402
    Figures,
    command_ceiling,
    make_model,
    make_safetensors,
    raw_ceiling,
    sidecar,
    tensorizer_load,
)
from scratch import scratch  # noqa: E402

from modelload.loader.sizes import parse_size  # noqa: E402
from tests.support.nginx import NginxServer  # noqa: E402

Contender = Callable[[], Figures]


def contenders(
    kind: str, model: Path, nginx: NginxServer, work: Path, args: argparse.Namespace
) -> dict[str, Contender]:
    chunk = parse_size(args.chunk_size, setting="--chunk-size")
    segment = work / "bench.seg"
    nbytes = model.stat().st_size
    if kind == "file":
        uri, endpoint, single = str(model), "", ["cat", str(model)]
        tensorizer_uri = str(model)
    elif kind == "http":
        uri, endpoint, single = (
            nginx.url(model.name),
            "",
            ["curl", "-s", "-o", "/dev/null", nginx.url(model.name)],
        )
        tensorizer_uri = uri
    else:
        uri, endpoint, single = f"s3://{nginx.bucket}/{model.name}", nginx.s3_endpoint, []
        tensorizer_uri = uri
    found: dict[str, Contender] = {
        "raw, reused buffer": lambda: raw_ceiling(
            uri, threads=args.readers, chunk=chunk, s3_endpoint=endpoint
        ),
        "raw, fresh file": lambda: raw_ceiling(
            uri, threads=args.readers, chunk=chunk, s3_endpoint=endpoint, fresh=work / "fresh.bin"
        ),
    }
    if single:
        found[f"{single[0]} (1 stream)"] = lambda: command_ceiling(single, nbytes)
    for verify in (False, True):
        label = "sidecar" + (" +verify" if verify else "")
        found[label] = lambda verify=verify: sidecar(
            uri, segment, readers=args.readers, chunk=args.chunk_size, verify=verify, s3_endpoint=endpoint
        )
    for label, folder in (
        ("sidecar st 1 file", "st-single"),
        (f"sidecar st {args.shards} shards", "st-sharded"),
    ):
        files = sorted(p.name for p in (work / folder).iterdir())
        if kind == "file":
            where, names = str(work / folder), None
        elif kind == "http":
            where, names = nginx.url(f"{folder}/"), None
        else:  # nginx poses as S3 for reads only, so the directory is named rather than listed
            where, names = f"s3://{nginx.bucket}/{folder}/", files
        found[label] = lambda where=where, names=names: sidecar(
            where, segment, readers=args.readers, chunk=args.chunk_size, verify=False, s3_endpoint=endpoint,
            files=names,
        )  # fmt: skip
    if not args.no_tensorizer:
        for readers in (1, 4, 8):
            found[f"tensorizer {readers}r"] = lambda readers=readers: tensorizer_load(
                tensorizer_uri, readers=readers, s3_endpoint=endpoint
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=2.0, help="model size in GiB")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--chunk-size", default="32MiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sources", default="file,http,s3")
    parser.add_argument("--no-tensorizer", action="store_true")
    parser.add_argument("--shards", type=int, default=6, help="shards of the directory case")
    args = parser.parse_args(argv)

    with scratch("modelload-bench-") as work:
        model = work / "model.tensors"
        tensor_bytes = make_model(model, int(args.size * 2**30))
        make_safetensors(work / "st-single", int(args.size * 2**30), shards=1)
        make_safetensors(work / "st-sharded", int(args.size * 2**30), shards=args.shards)
        print(
            f"model: {model.stat().st_size / 2**30:.2f} GiB tensorizer file, {tensor_bytes / 2**30:.2f} GiB of bf16 tensors, in {work}"
        )
        print(
            f"readers {args.readers}, chunks {args.chunk_size}, median of {args.runs} runs, page cache warm\n"
        )
        nginx = NginxServer(work, bucket="bench", workers=2)
        try:
            for kind in args.sources.split(","):
                report(kind, run_rounds(contenders(kind, model, nginx, work, args), args.runs))
        finally:
            nginx.stop()
    return 0


def run_rounds(found: dict[str, Contender], runs: int) -> dict[str, list[Figures]]:
    results: dict[str, list[Figures]] = defaultdict(list)
    for _ in range(runs):
        for label, measure in found.items():
            try:
                results[label].append(measure())
            except Exception as exc:  # a contender that cannot read this source is reported, not fatal
                print(f"  {label}: failed: {str(exc).strip().splitlines()[-1][:200]}")
    return results


def report(kind: str, results: dict[str, list[Figures]]) -> None:
    print(f"[{kind}]")
    medians: dict[str, float] = {}
    for label, figures in results.items():
        if not figures:
            continue
        rate = statistics.median(f.gib_per_s for f in figures)
        medians[label] = rate
        line = f"  {label:<22} {rate:6.2f} GiB/s"
        middle = sorted(figures, key=lambda f: f.gib_per_s)[len(figures) // 2]
        if middle.first_tensor_s is not None:
            line += f"  manifest {middle.manifest_s:5.2f} s  first tensor {middle.first_tensor_s:5.2f} s  all {middle.seconds:5.2f} s"
        if middle.peak_rss_bytes:
            line += f"  peak RSS {middle.peak_rss_bytes / 2**20:6.0f} MiB"
        if middle.extra:
            line += f"  ({middle.extra})"
        print(line)
    best_tensorizer = max(
        (k for k in medians if k.startswith("tensorizer")), key=lambda k: medians[k], default=None
    )
    for label in ("sidecar", "sidecar +verify"):
        if label not in medians:
            continue
        ratios = [
            f"{round_ratio(results, label, baseline):.2f} x {baseline}"
            for baseline in ("raw, reused buffer", "raw, fresh file", best_tensorizer)
            if baseline in medians
        ]
        print(f"  => {label} (engine): {', '.join(ratios)}")
    sharded = next((k for k in medians if k.startswith("sidecar st ") and k.endswith(" shards")), None)
    if sharded is not None and "sidecar st 1 file" in medians:
        print(
            f"  => {sharded} (engine): {round_ratio(results, sharded, 'sidecar st 1 file', engine=True):.2f} x 1 file"
        )
    print()


def round_ratio(
    results: dict[str, list[Figures]], label: str, baseline: str, *, engine: bool = False
) -> float:
    """The median over rounds of label/baseline, each pair measured in the same round: on a shared machine
    the swings from minute to minute are larger than the differences being measured. ``engine`` takes the
    baseline's engine rate too (two sidecars)."""
    pairs = zip(results[label], results[baseline], strict=False)
    return statistics.median(engine_rate(a) / (engine_rate(b) if engine else b.gib_per_s) for a, b in pairs)


def engine_rate(figures: Figures) -> float:
    """The sidecar's rate from its engine's start (imports and process start excluded, as for the contenders)."""
    if figures.extra.startswith("engine "):
        return float(figures.extra.split()[1])
    return figures.gib_per_s


if __name__ == "__main__":
    sys.exit(main())
