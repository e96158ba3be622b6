"""modelload's sidecar against what a user would use instead, on origins that behave like theirs.

``make bench`` runs this, then ``report.py``. Every measurement is ``contenders.py`` in a fresh process (one
contender, one load); within a round every contender of a case runs once, in an order that rotates from
round to round, so the swings of a shared machine hit all alike. Ratios are taken within a round.

Sections (``--sections``):

- ``table``: each origin (local file; the same with hashes verified, ``file-verify``: the sidecar and tensorizer
  both checking the tensorizer file's stored hashes; nginx over loopback as HTTP and as an S3 stand-in; the
  S3-like origin as HTTP and S3, see ``origins.s3_like``; s3rver, a real S3 server) x each contender that can
  read it:
  the sidecar, tensorizer (several ``num_readers``, the best is kept), Run:ai Model Streamer, safetensors
  (``load_file`` + copy, ``safe_open``), ``torch.load``, and ``curl`` into tmpfs (the floor of landing bytes in
  new memory). A contender that cannot read an origin gets a line saying why.
- ``readers``: readers 1 → 64 on the S3-like origin over S3: where each contender stops scaling.
- ``size``: model size 0.25 → 8 GiB on the local file (sizes the free memory cannot hold are skipped, with
  the reason recorded).
- ``chunk``: range size 4 → 64 MiB on the S3-like origin over S3.
- ``hugepages``: the sidecar loading from nginx on loopback into a segment on 4 KiB pages (a tmpfs, as an
  ``emptyDir`` with ``medium: Memory``), on a tmpfs mounted ``huge=always`` and on hugetlbfs (2 MiB pages, as
  ``medium: HugePages-2Mi``), each with the landing path it chooses and, where the volume takes it, the other
  one, with curl as the floor: CPU-seconds per GiB on huge pages against 4 KiB pages, same origin, same rounds.
  The volumes are mounted for the run (root); where they cannot be, the section is skipped with the reason.

Raw results go to ``benchmarks/results/bench-TIMESTAMP.jsonl`` (one JSON object a line: a ``meta`` line with
the machine and versions, then one per measurement or skip); ``--publish`` also copies them to
``docs/bench-results.jsonl``, which ``report.py`` turns into the plots and tables.

    python benchmarks/run.py [--size 1] [--runs 3] [--sections table,readers,size,chunk] [--publish]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from harness import make_model, make_safetensors  # noqa: E402
from hugepages_cases import huge_page_cases, huge_page_rounds, huge_page_volumes  # noqa: E402
from origins import S3RVER_KEY, S3RVER_SECRET, Origin, Unavailable, s3_like, s3rver, upload  # noqa: E402
from peer_goals import peer_goals  # noqa: E402
from scratch import scratch  # noqa: E402

from tests.support.nginx import NginxServer  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
CONTENDERS = HERE / "contenders.py"
ST, TZ, PT = "st/model.safetensors", "model.tensors", "model.pt"
NO_HTTP = "no HTTP(S) source"
FILES_ONLY = "reads local files only"


@dataclass
class Case:
    """One contender's configuration on one origin: what ``contenders.py`` gets, or why it cannot run."""

    contender: str
    label: str
    argv: list[str] = field(default_factory=list)
    readers: int = 8
    chunk: int = 32 * MIB
    skip: str = ""


@dataclass
class Models:
    folder: Path
    size: int  # the safetensors file's bytes (what curl fetches)

    def path(self, name: str) -> Path:
        return self.folder / name


class Recorder:
    """Appends one JSON line per result, and echoes a short line to the terminal."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = path.open("w")

    def write(self, record: dict[str, Any]) -> None:
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()

    def close(self) -> None:
        self._out.close()


def measure(case: Case, env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, str(CONTENDERS), case.contender, *case.argv]
    argv += ["--readers", str(case.readers), "--chunk", str(case.chunk)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=900)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return {"error": (tail[-1] if tail else f"exit {done.returncode}")[:300]}
    return dict(json.loads(lines[-1]))


def run_rounds(
    recorder: Recorder,
    section: str,
    origin: str,
    cases: list[Case],
    runs: int,
    env: dict[str, str],
    **tags: Any,
) -> None:
    """``runs`` rounds over ``cases`` (rotating the order); skips are recorded once."""
    for case in cases:
        if case.skip:
            recorder.write({"section": section, "origin": origin, "label": case.label,
                            "contender": case.contender, "skipped": case.skip, **tags})  # fmt: skip
    live = [c for c in cases if not c.skip]
    for number in range(runs):
        shift = number % max(1, len(live))
        for case in live[shift:] + live[:shift]:
            result = measure(case, env)
            record = {"section": section, "origin": origin, "label": case.label, "contender": case.contender,
                      "round": number, "readers": case.readers, "chunk": case.chunk,
                      "load_avg": os.getloadavg()[0], **tags, **result}  # fmt: skip
            recorder.write(record)
            shown = (
                f"{result['gib_s']:6.2f} GiB/s {result['cpu_s_per_gib']:5.2f} CPU-s/GiB "
                f"{result['peak_rss'] / MIB:6.0f} MiB"
                if "gib_s" in result
                else f"failed: {result['error']}"
            )
            print(f"  [{section} {origin}{_tags(tags)} r{number}] {case.label:<22} {shown}", flush=True)


def _tags(tags: dict[str, Any]) -> str:
    return "".join(f" {k}={v}" for k, v in tags.items())


def table_cases(origin: str, where: Any, models: Models, args: argparse.Namespace) -> list[Case]:
    """The contenders of the main table on one origin."""
    loopback = origin in ("file", "file-verify", "http", "s3", "s3rver")
    readers = args.readers if loopback else args.remote_readers
    chunk = 32 * MIB if loopback else 16 * MIB
    tz_readers = (1, 4) if loopback else (16, 32)
    cases: list[Case] = []

    def add(contender: str, label: str, argv: list[str], skip: str = "", **kw: Any) -> None:
        kw.setdefault("readers", readers)
        kw.setdefault("chunk", chunk)
        cases.append(Case(contender, label, argv, skip=skip, **kw))

    if origin == "file-verify":
        # Both check every tensor against the hashes the tensorizer file stores (tensorizer: CRC32 and
        # SHA-256; the sidecar: one of them, its fastest), so the same file is read by both.
        add("sidecar", "sidecar --verify", ["--source", str(models.path(TZ)), "--verify"])
        for r in tz_readers:
            add("tensorizer", f"tensorizer {r}r", ["--source", str(models.path(TZ)), "--verify"], readers=r)
        add("curl", "curl -> tmpfs",
            ["--source", f"file://{models.path(TZ)}", "--size", str(models.path(TZ).stat().st_size)])  # fmt: skip
        return cases
    if origin == "file":
        add("sidecar", "sidecar", ["--source", str(models.path(ST))])
        for r in tz_readers:
            add("tensorizer", f"tensorizer {r}r", ["--source", str(models.path(TZ))], readers=r)
        add("runai", "runai", ["--source", str(models.path(ST))])
        add("st-load", "safetensors load_file+copy", ["--source", str(models.path(ST))])
        add("st-open", "safetensors safe_open", ["--source", str(models.path(ST))])
        add("torch-load", "torch.load", ["--source", str(models.path(PT))])
        add("curl", "curl -> tmpfs", ["--source", f"file://{models.path(ST)}", "--size", str(models.size)])
        return cases
    s3 = origin in ("s3", "s3like-s3", "s3rver")
    if s3:
        endpoint = ["--s3-endpoint", where.s3_endpoint]
        add("sidecar", "sidecar", ["--source", where.s3_uri(ST), *endpoint])
        for r in tz_readers:
            add("tensorizer", f"tensorizer {r}r", ["--source", where.s3_uri(TZ), *endpoint], readers=r)
        add("runai", "runai", ["--source", where.s3_uri(ST), *endpoint])
        curl_url = where.presigned(ST) if origin == "s3rver" else where.url(f"{where.bucket}/{ST}")
    else:
        add("sidecar", "sidecar", ["--source", where.url(ST)])
        for r in tz_readers:
            add("tensorizer", f"tensorizer {r}r", ["--source", where.url(TZ)], readers=r)
        add("runai", "runai", [], skip=NO_HTTP)
        curl_url = where.url(ST)
    for contender, label in (
        ("st-load", "safetensors load_file+copy"),
        ("st-open", "safetensors safe_open"),
        ("torch-load", "torch.load"),
    ):
        add(contender, label, [], skip=FILES_ONLY)
    add("curl", "curl -> tmpfs", ["--source", curl_url, "--size", str(models.size)])
    return cases


@dataclass(frozen=True)
class Served:
    """An origin as the cases see it: URLs, the S3 endpoint and bucket, presigned URLs for curl."""

    origin: Origin

    def url(self, name: str) -> str:
        return self.origin.url(name)

    @property
    def s3_endpoint(self) -> str:
        return self.origin.s3_endpoint

    @property
    def bucket(self) -> str:
        return self.origin.bucket

    def s3_uri(self, name: str) -> str:
        return self.origin.s3_uri(name)

    def presigned(self, name: str) -> str:
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3", endpoint_url=self.s3_endpoint, region_name="us-east-1", aws_access_key_id=S3RVER_KEY,
            aws_secret_access_key=S3RVER_SECRET, config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip
        return str(client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": name}))


def make_models(folder: Path, size_gib: float) -> Models:
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = int(size_gib * GIB)
    make_model(folder / TZ, nbytes)
    make_safetensors(folder / "st", nbytes, shards=1)
    (folder / "st" / "config.json").unlink(missing_ok=True)
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(folder / ST)), folder / PT)
    return Models(folder, (folder / ST).stat().st_size)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def origin_context(kind: str, models: Models, work: Path) -> Iterator[Served | None]:
    if kind in ("file", "file-verify"):
        yield None
    elif kind in ("http", "s3"):
        server = NginxServer(models.folder, bucket="bench", workers=2)
        try:
            yield Served(Origin(f"http://127.0.0.1:{server.port}", "bench", "nginx on loopback"))
        finally:
            server.stop()
    elif kind.startswith("s3like"):
        with s3_like(models.folder) as origin:
            yield Served(origin)
    elif kind == "s3rver":
        with s3rver(work / "s3rver") as origin:
            upload(origin, {ST: models.path(ST), TZ: models.path(TZ)})
            yield Served(origin)
    else:
        raise SystemExit(f"unknown origin {kind!r}")


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str] = {"python": platform.python_version()}
    for package in ("modelload", "torch", "tensorizer", "runai-model-streamer", "runai-model-streamer-s3",
                    "safetensors", "boto3"):  # fmt: skip
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "not installed"
    for tool, argv in (("nginx", ["nginx", "-v"]), ("curl", ["curl", "--version"]), ("node", ["node", "-v"])):
        with contextlib.suppress(OSError):
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            first = (done.stdout or done.stderr).strip().splitlines()[0]
            numbers = [w.split("/")[-1].lstrip("v") for w in first.split()]
            versions[tool] = next((n for n in numbers if n[:1].isdigit()), first[:40])
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor(),
    )  # fmt: skip
    return {
        "meta": True,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu,
            "mem_gib": round(_mem_total() / GIB, 1),
            "kernel": platform.release(),
            "load_avg": os.getloadavg()[0],
        },
        "versions": versions,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="model size of the table, GiB")
    parser.add_argument("--runs", type=int, default=3, help="rounds of the table")
    parser.add_argument("--curve-runs", type=int, default=1, help="rounds of each curve point")
    parser.add_argument("--readers", type=int, default=8, help="readers on loopback origins")
    parser.add_argument("--remote-readers", type=int, default=16, help="readers on the S3-like origin")
    parser.add_argument("--origins", default="file,file-verify,http,s3,s3like-http,s3like-s3,s3rver")
    parser.add_argument("--sections", default="table,readers,size,chunk,hugepages")
    parser.add_argument(
        "--curve-size", type=float, default=1.0, help="model size of the readers/chunk curves"
    )
    parser.add_argument("--sizes", default="0.25,1,4,8", help="GiB, the size curve")
    parser.add_argument("--readers-curve", default="1,4,16,64")
    parser.add_argument("--chunks-mib", default="4,16,64")
    parser.add_argument("--out", type=Path, default=None, help="the JSON lines file")
    parser.add_argument("--publish", action="store_true", help="copy the results to docs/ and report")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    out = args.out or HERE / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    recorder = Recorder(out)
    recorder.write(metadata(args))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RUNAI_"))}
    env.update(AWS_ACCESS_KEY_ID=S3RVER_KEY, AWS_SECRET_ACCESS_KEY=S3RVER_SECRET, AWS_DEFAULT_REGION="us-east-1",
               NO_PROXY="*", PYTHONPATH=str(ROOT))  # fmt: skip
    started = time.monotonic()
    try:
        with scratch("modelload-bench-") as work:
            if "table" in sections:
                models = make_models(work / "table", args.size)
                print(f"table: {models.size / GIB:.2f} GiB of safetensors (and the same as tensorizer, .pt)")
                for kind in args.origins.split(","):
                    try:
                        with origin_context(kind, models, work) as served:
                            if served is not None:
                                recorder.write(
                                    {"origin_info": kind, "description": served.origin.description}
                                )
                            run_rounds(recorder, "table", kind, table_cases(kind, served, models, args),
                                       args.runs, env, size=models.size)  # fmt: skip
                    except Unavailable as exc:
                        print(f"  [{kind}] skipped: {exc}")
                        recorder.write({"section": "table", "origin": kind, "skipped": str(exc)})
                shutil.rmtree(work / "table", ignore_errors=True)
            if sections & {"readers", "chunk"}:
                curves(recorder, work, args, env, sections)
            if "size" in sections:
                size_curve(recorder, work, args, env)
            if "hugepages" in sections:
                huge_pages(recorder, work, args, env)
    finally:
        recorder.close()
    print(f"results: {out} ({(time.monotonic() - started) / 60:.1f} min)")
    goals = peer_goals([json.loads(line) for line in out.read_text().splitlines() if line.strip()])
    if goals:
        print("goals against the peers:", *goals, sep="\n")
    if args.publish:
        publish(out, sections)
        subprocess.run([sys.executable, str(HERE / "report.py")], check=True)
    return 0


ALL_SECTIONS = ("table", "readers", "size", "chunk", "hugepages")


def publish(out: Path, sections: set[str], published: Path = ROOT / "docs" / "bench-results.jsonl") -> None:
    """Copy the results to docs/bench-results.jsonl. A run of some sections only keeps the published records
    of the others, so one section can be measured again alone; the main meta line (the machine, the versions)
    is this run's only when it measured a section of the main table or curves."""
    if set(ALL_SECTIONS) <= sections or not published.exists():
        shutil.copyfile(out, published)
        return
    main = bool(sections & {"table", "readers", "size", "chunk"})

    def ours(record: dict[str, Any]) -> bool:
        if record.get("meta"):
            return main
        return record.get("section", record.get("section_meta")) in sections

    old = [json.loads(line) for line in published.read_text().splitlines() if line.strip()]
    new = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    merged = [r for r in old if not ours(r)] + [r for r in new if ours(r)]
    published.write_text("".join(json.dumps(r) + "\n" for r in merged))


def huge_pages(recorder: Recorder, work: Path, args: argparse.Namespace, env: dict[str, str]) -> None:
    """The sidecar from nginx into segments on 4 KiB pages and on huge pages (``hugepages_cases``)."""
    recorder.write({"section_meta": "hugepages", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_avg": os.getloadavg()[0], "runs": args.runs})  # fmt: skip
    folder = work / "huge-model"
    folder.mkdir()
    make_safetensors(folder / "st", int(args.size * GIB), shards=1)
    size = (folder / ST).stat().st_size
    server = NginxServer(folder, bucket="bench", workers=2)
    try:
        with huge_page_volumes(work / "volumes", size) as (volumes, skipped):
            for kind, reason in skipped.items():
                print(f"  [hugepages {kind}] skipped: {reason}")
                recorder.write({"section": "hugepages", "origin": "http", "volume": kind, "skipped": reason})
            url = f"http://127.0.0.1:{server.port}/{ST}"
            cases = huge_page_cases(url, size, volumes, readers=args.readers)
            huge_page_rounds(cases, args.runs, measure=lambda fields: measure(Case(**fields), env),
                             write=recorder.write, origin_pid=server.pid, size=size)  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def curves(
    recorder: Recorder, work: Path, args: argparse.Namespace, env: dict[str, str], sections: set[str]
) -> None:
    models = make_models(work / "curves", args.curve_size)
    try:
        with s3_like(models.folder) as origin:
            served = Served(origin)
            endpoint = ["--s3-endpoint", served.s3_endpoint]
            if "readers" in sections:
                for readers in (int(r) for r in args.readers_curve.split(",")):
                    cases = [
                        Case("sidecar", "sidecar", ["--source", served.s3_uri(ST), *endpoint]),
                        Case("tensorizer", "tensorizer", ["--source", served.s3_uri(TZ), *endpoint]),
                        Case("runai", "runai", ["--source", served.s3_uri(ST), *endpoint]),
                        Case("curl", "curl -> tmpfs",
                             ["--source", served.url(f"{served.bucket}/{ST}"), "--size", str(models.size)]),
                    ]  # fmt: skip
                    for case in cases:
                        case.readers, case.chunk = readers, 16 * MIB
                    run_rounds(recorder, "readers", "s3like-s3", cases, args.curve_runs, env, x=readers,
                               size=models.size)  # fmt: skip
            if "chunk" in sections:
                for mib in (int(c) for c in args.chunks_mib.split(",")):
                    cases = [
                        Case("sidecar", "sidecar", ["--source", served.s3_uri(ST), *endpoint]),
                        Case("runai", "runai", ["--source", served.s3_uri(ST), *endpoint]),
                    ]
                    for case in cases:
                        case.readers, case.chunk = args.remote_readers, mib * MIB
                    run_rounds(recorder, "chunk", "s3like-s3", cases, args.curve_runs, env, x=mib,
                               size=models.size)  # fmt: skip
    except Unavailable as exc:
        print(f"  curves skipped: {exc}")
        recorder.write({"section": "readers", "origin": "s3like-s3", "skipped": str(exc)})
        recorder.write({"section": "chunk", "origin": "s3like-s3", "skipped": str(exc)})
    finally:
        shutil.rmtree(work / "curves", ignore_errors=True)


def size_curve(recorder: Recorder, work: Path, args: argparse.Namespace, env: dict[str, str]) -> None:
    for size in (float(s) for s in args.sizes.split(",")):
        # The two files, one load, and the page cache's copy of neither (they are in /dev/shm): 3x, plus a
        # margin for the other users of this machine.
        needed = int(3 * size * GIB) + 2 * GIB
        if mem_available() < needed:
            reason = f"{mem_available() / GIB:.1f} GiB available, {needed / GIB:.1f} GiB needed"
            print(f"  [size {size:g} GiB] skipped: {reason}")
            recorder.write({"section": "size", "origin": "file", "x": size, "skipped": reason})
            continue
        folder = work / f"size-{size:g}"
        folder.mkdir()
        make_model(folder / TZ, int(size * GIB))
        make_safetensors(folder / "st", int(size * GIB), shards=1)
        st_size = (folder / ST).stat().st_size
        cases = [
            Case("sidecar", "sidecar", ["--source", str(folder / ST)]),
            Case("tensorizer", "tensorizer", ["--source", str(folder / TZ)], readers=4),
            Case("runai", "runai", ["--source", str(folder / ST)]),
            Case("curl", "curl -> tmpfs", ["--source", f"file://{folder / ST}", "--size", str(st_size)]),
        ]
        run_rounds(recorder, "size", "file", cases, args.curve_runs, env, x=size, size=st_size)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
