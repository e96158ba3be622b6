"""Plots and tables from the raw results of ``run.py``: one command, so what is shown is what was measured.

    python benchmarks/report.py [RESULTS.jsonl]     # default docs/bench-results.jsonl

Writes ``docs/bench-*.png`` (matplotlib) and rewrites the generated block of ``README.md`` and of
``docs/benchmarks.md`` (between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``). Figures are medians over
rounds; a ratio is the median of the ratios taken within each round (both contenders measured minutes apart
at most), which a shared machine's swings affect far less than the figures themselves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOCS = ROOT / "docs"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
TENSOR_COUNT = ("<!-- tensor-count:begin -->", "<!-- tensor-count:end -->")
GIB, MIB = 1 << 30, 1 << 20

ORIGINS = {
    "file": "local file (tmpfs)",
    "file-verify": "local file (tmpfs), tensorizer file, hashes verified",
    "http": "HTTP, nginx on loopback",
    "s3": "S3, nginx stand-in on loopback",
    "s3like-http": "HTTP, S3-like origin",
    "s3like-s3": "S3, S3-like origin",
    "s3rver": "S3, s3rver (real S3 server)",
}
ORDER = ["sidecar", "tensorizer", "runai", "st-load", "st-open", "torch-load", "curl"]
NAMES = {
    "sidecar": "**modelload sidecar**",
    "tensorizer": "tensorizer",
    "runai": "Run:ai Model Streamer",
    "st-load": "safetensors `load_file` + copy",
    "st-open": "safetensors `safe_open`",
    "torch-load": "`torch.load`",
    "curl": "curl into tmpfs (floor)",
}


def load(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    meta: dict[str, Any] = {}
    records = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("meta"):
            meta = record
        else:
            records.append(record)
    return meta, records


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Case:
    """The rounds of one label in one section/origin/x."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.ok = [r for r in records if "gib_s" in r]
        self.errors = [r["error"] for r in records if "error" in r]
        self.skipped = next((r["skipped"] for r in records if "skipped" in r), "")
        self.label = records[0].get("label", "")
        self.contender = records[0].get("contender", "")

    @property
    def gib_s(self) -> float:
        return _median([r["gib_s"] for r in self.ok])

    @property
    def cpu(self) -> float:
        return _median([r["cpu_s_per_gib"] for r in self.ok])

    @property
    def rss(self) -> float:
        return _median([r["peak_rss"] for r in self.ok])

    def by_round(self, key: str = "gib_s") -> dict[int, float]:
        return {r["round"]: r[key] for r in self.ok}


def ratio(a: Case, b: Case, key: str = "gib_s") -> float:
    """Median over rounds of a/b, each pair from the same round."""
    ra, rb = a.by_round(key), b.by_round(key)
    return _median([ra[n] / rb[n] for n in ra if n in rb and rb[n] > 0])


def group(records: list[dict[str, Any]], section: str) -> dict[tuple[str, Any], dict[str, Case]]:
    """(origin, x) → label → Case; for tensorizer only its best variant (by median) is kept."""
    raw: dict[tuple[str, Any], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("section") == section and "label" in r:
            raw[(r["origin"], r.get("x"))][r["label"]].append(r)
    out: dict[tuple[str, Any], dict[str, Case]] = {}
    for key, labels in raw.items():
        cases = {label: Case(rs) for label, rs in labels.items()}
        best: dict[str, Case] = {}
        for case in cases.values():
            current = best.get(case.contender)
            if current is None or (case.ok and (not current.ok or case.gib_s > current.gib_s)):
                best[case.contender] = case
        out[key] = {c: best[c] for c in ORDER if c in best}
    return out


def skipped_origins(records: list[dict[str, Any]], section: str) -> dict[str, str]:
    return {
        r["origin"]: r["skipped"]
        for r in records
        if r.get("section") == section and "skipped" in r and "label" not in r
    }


def main_table(records: list[dict[str, Any]]) -> str:
    grouped = group(records, "table")
    lines = [
        "| origin | contender | GiB/s | sidecar / this (per round) | CPU-s per GiB | CPU / curl's | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for origin, title in ORIGINS.items():
        cases = grouped.get((origin, None))
        if cases is None:
            reason = skipped_origins(records, "table").get(origin)
            if reason:
                lines.append(f"| {title} | — | not measured: {reason} | | | | |")
            continue
        sidecar, curl = cases.get("sidecar"), cases.get("curl")
        for contender, case in cases.items():
            name = NAMES[contender]
            if contender == "tensorizer" and case.label:
                name += f" (num_readers {case.label.split()[-1].rstrip('r')})"
            if case.skipped or not case.ok:
                why = case.skipped or ("failed: " + (case.errors[0] if case.errors else "no result"))
                lines.append(f"| {title} | {name} | — ({why}) | | | | |")
                continue
            versus = "" if contender == "sidecar" or sidecar is None else f"{ratio(sidecar, case):.2f}x"
            over_curl = (
                "" if curl is None or contender == "curl" else f"{ratio(case, curl, 'cpu_s_per_gib'):.2f}x"
            )
            rate = f"**{case.gib_s:.2f}**" if contender == "sidecar" else f"{case.gib_s:.2f}"
            rss = f"{case.rss / MIB:.0f} MiB" + (" + segment" if contender == "sidecar" else "")
            lines.append(f"| {title} | {name} | {rate} | {versus} | {case.cpu:.2f} | {over_curl} | {rss} |")
    return "\n".join(lines)


HUGE_VOLUMES = {
    "tmpfs": "4 KiB pages (tmpfs, `medium: Memory`)",
    "tmpfs-huge": "tmpfs mounted `huge=always`",
    "hugetlbfs": "hugetlbfs, 2 MiB pages (`medium: HugePages-2Mi`)",
}
CHOSEN = {"tmpfs": "splice", "tmpfs-huge": "mapping", "hugetlbfs": "mapping"}
"""The landing path the sidecar's ``auto`` takes on each volume (``modelload.loader.segment.pages``)."""
HUGE_GOALS = (0.35, 0.5)
"""On huge pages from nginx: at most 0.35 CPU-s per GiB, and at most 0.5 x the same load on 4 KiB pages."""


HUGE_FLOOR = "mapping -> hugetlbfs"
"""The floor on hugetlbfs (``contenders.py mapping``: ranged GETs straight into a mapping, no checks)."""


def huge_cases(records: list[dict[str, Any]]) -> dict[str, Case]:
    """label ("hugetlbfs auto", "curl -> tmpfs", ...) → Case, for the hugepages section."""
    raw: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("section") == "hugepages" and "label" in r:
            raw[r["label"]].append(r)
    return {label: Case(rs) for label, rs in raw.items()}


def _origin_cpu(case: Case) -> str:
    """nginx's CPU-s per GiB over the case's loads (median), where the rounds recorded it."""
    values = [r["origin_cpu_s_per_gib"] for r in case.ok if "origin_cpu_s_per_gib" in r]
    return f"{_median(values):.2f}" if values else ""


def huge_pages_table(records: list[dict[str, Any]]) -> str:
    """The sidecar from nginx onto 4 KiB pages and onto huge pages, each landing path, in the same rounds."""
    cases = huge_cases(records)
    skipped = {
        r["volume"]: r["skipped"] for r in records if r.get("section") == "hugepages" and "skipped" in r
    }
    if not cases:
        return "(not measured" + (f": {'; '.join(skipped.values())})" if skipped else ")")
    base, curl = cases.get("tmpfs auto"), cases.get("curl -> tmpfs")
    lines = [
        "| segment on | landing | GiB/s | CPU-s per GiB | CPU / 4 KiB pages' (per round) | CPU / curl's | peak RSS "
        "| nginx's CPU-s per GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for volume, title in HUGE_VOLUMES.items():
        if volume in skipped:
            lines.append(f"| {title} | — | not measured: {skipped[volume]} | | | | | |")
            continue
        for label, case in sorted((k, v) for k, v in cases.items() if k.split()[0] == volume):
            landing = label.split()[1]
            how = f"**{CHOSEN[volume]}** (auto)" if landing == "auto" else f"{landing} (forced)"
            if not case.ok:
                lines.append(
                    f"| {title} | {how} | — (failed: {case.errors[0] if case.errors else '?'}) | | | | | |"
                )
                continue
            versus = "" if base is None or case is base else f"{ratio(case, base, 'cpu_s_per_gib'):.2f}x"
            over_curl = "" if curl is None or not curl.ok else f"{ratio(case, curl, 'cpu_s_per_gib'):.2f}x"
            rate = f"**{case.gib_s:.2f}**" if landing == "auto" else f"{case.gib_s:.2f}"
            rss = f"{case.rss / MIB:.0f} MiB + segment"
            origin = _origin_cpu(case)
            lines.append(
                f"| {title} | {how} | {rate} | {case.cpu:.2f} | {versus} | {over_curl} | {rss} | {origin} |"
            )
    if curl is not None and curl.ok:
        lines.append(
            f"| 4 KiB pages (tmpfs) | curl (floor) | {curl.gib_s:.2f} | {curl.cpu:.2f} | | | | {_origin_cpu(curl)} |"
        )
    floor = cases.get(HUGE_FLOOR)
    if floor is not None and floor.ok:
        title = HUGE_VOLUMES["hugetlbfs"]
        lines.append(
            f"| {title} | bare ranged GETs into the mapping (floor) | {floor.gib_s:.2f} | {floor.cpu:.2f} | | | "
            f"| {_origin_cpu(floor)} |"
        )
    return "\n".join(lines)


def huge_pages_caption(records: list[dict[str, Any]]) -> str:
    meta = next((r for r in records if r.get("section_meta") == "hugepages"), {})
    size = next((r["size"] for r in records if r.get("section") == "hugepages" and "size" in r), 0)
    return (
        f"**Huge pages** (measured {meta.get('date', '?')}, load average {meta.get('load_avg', 0):.1f} at the "
        f"start, median of {meta.get('runs', '?')} rounds): the sidecar loading a {size / GIB:.2f} GiB "
        "safetensors file from nginx on loopback into a segment on each kind of volume, with the landing path "
        "it chooses (auto) and the other one where the volume takes it; ratios are taken within rounds. Each "
        "case starts with its volume's pages just taken and given back, and odd rounds run in reverse; on "
        "loopback part of the TCP work lands on whichever side is awake, so nginx's CPU is shown beside."
    )


def huge_pages_goals(records: list[dict[str, Any]]) -> list[str]:
    cases = huge_cases(records)
    base = cases.get("tmpfs auto")
    lines = []
    for volume in ("tmpfs-huge", "hugetlbfs"):
        case = cases.get(f"{volume} auto")
        if case is None or not case.ok:
            continue
        cpu_goal, ratio_goal = HUGE_GOALS
        reached = "reached" if case.cpu <= cpu_goal else "not reached"
        line = f"- HTTP onto {HUGE_VOLUMES[volume]}: {case.cpu:.2f} CPU-s per GiB ({reached}; goal <= {cpu_goal})"
        if base is not None and base.ok:
            value = ratio(case, base, "cpu_s_per_gib")
            reached = "reached" if value <= ratio_goal else "not reached"
            line += f", {value:.2f}x the 4 KiB-page load's ({reached}; goal <= {ratio_goal})"
        floor = cases.get(HUGE_FLOOR)
        if volume == "hugetlbfs" and floor is not None and floor.ok:
            value = ratio(case, floor, "cpu_s_per_gib")
            line += f"; the bare mapping floor {floor.cpu:.2f} CPU-s per GiB (sidecar {value:.2f}x)"
        lines.append(line)
    return lines


def curve_table(records: list[dict[str, Any]], section: str, x_name: str) -> str:
    grouped = group(records, section)
    if not grouped:
        reason = skipped_origins(records, section).get("s3like-s3") or skipped_origins(records, section).get(
            "file"
        )
        return f"(not measured{': ' + reason if reason else ''})"
    contenders = [c for c in ORDER if any(c in cases for cases in grouped.values())]
    lines = [
        f"| {x_name} | " + " | ".join(NAMES[c] for c in contenders) + " |",
        "|---" * (len(contenders) + 1) + "|",
    ]
    for (_, x), cases in sorted(grouped.items(), key=lambda item: float(item[0][1])):
        cells = []
        for contender in contenders:
            case = cases.get(contender)
            cells.append("—" if case is None or not case.ok else f"{case.gib_s:.2f}")
        lines.append(f"| {x:g} | " + " | ".join(cells) + " |")
    for r in records:
        if r.get("section") == section and "skipped" in r and "x" in r:
            lines.append(f"| {r['x']:g} | not measured: {r['skipped']} |" + " |" * (len(contenders) - 1))
    return "\n".join(lines)


def _link_and_cap() -> tuple[float, float]:
    from origins import LINK_GBIT, RATE_MB_S

    return LINK_GBIT * 1e9 / 8 / GIB, RATE_MB_S * 1e6 / GIB


def targets(records: list[dict[str, Any]]) -> str:
    """The issue's figures against what this run measured, each with whether it was reached."""
    lines = []

    def verdict(value: float, goal: float, *, at_most: bool = False) -> str:
        if value != value:  # NaN: nothing to compare
            return "not measured"
        reached = value <= goal if at_most else value >= goal
        return f"{value:.2f} ({'reached' if reached else 'not reached'})"

    grouped = group(records, "table")
    remote = ("http", "s3", "s3like-http", "s3like-s3", "s3rver")
    for origin, title in ORIGINS.items():
        cases = grouped.get((origin, None), {})
        sidecar = cases.get("sidecar")
        if sidecar is None or not sidecar.ok or origin == "file-verify":  # its goal: peer_goals.py
            continue
        parts = []
        for contender, goal in (
            ("tensorizer", 2.5 if origin in remote else 1.0),
            ("runai", 3.5 if origin in remote else 0),
        ):
            case = cases.get(contender)
            if case is not None and case.ok and goal:
                parts.append(f"/ {NAMES[contender]} {verdict(ratio(sidecar, case), goal)} (goal >= {goal:g})")
        curl = cases.get("curl")
        if curl is not None and curl.ok:
            parts.append(
                f"CPU / curl's {verdict(ratio(sidecar, curl, 'cpu_s_per_gib'), 1.1, at_most=True)} (goal <= 1.1)"
            )
        lines.append(f"- {title}: sidecar " + "; ".join(parts))
    lines += huge_pages_goals(records)
    from peer_goals import peer_goals  # it builds on this module's grouping

    lines += peer_goals(records)
    curve = group(records, "readers")
    if curve:
        points = sorted(curve.items(), key=lambda item: float(item[0][1]))
        for contender in ORDER:
            xs = [
                (float(x), cases[contender].gib_s)
                for (_, x), cases in points
                if contender in cases and cases[contender].ok
            ]
            if len(xs) < 2:
                continue
            best = max(rate for _, rate in xs)
            stop = next(x for x, rate in xs if rate >= 0.9 * best)
            lines.append(f"- {NAMES[contender]} stops scaling at {stop:g} readers ({best:.2f} GiB/s at best)")
    return "\n".join(lines)


def setup(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    machine, versions = meta.get("machine", {}), meta.get("versions", {})
    args = meta.get("args", {})
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if k not in ("python",))
    described = {r["origin_info"]: r["description"] for r in records if "origin_info" in r}
    like = described.get("s3like-s3") or described.get("s3like-http") or "see docs/benchmarks.md"
    size = next((r["size"] for r in records if r.get("section") == "table" and "size" in r), 0)
    return (
        f"Measured {meta.get('date', '?')} at commit {meta.get('commit', '?')} on {machine.get('cpus')} CPUs "
        f"({machine.get('cpu')}), {machine.get('mem_gib')} GiB, kernel {machine.get('kernel')}, shared with "
        f"other work (load average {machine.get('load_avg', 0):.1f} at the start). Python {versions.get('python')}; "
        f"{shown}. Table: a {size / GIB:.2f} GiB model (TinyLlama-shaped bf16 tensors) as safetensors, "
        f"tensorizer and `.pt`, page cache warm, {args.get('runs')} rounds, {args.get('readers')} readers on "
        f"loopback and {args.get('remote_readers')} on the S3-like origin ({like}); Run:ai gets the same "
        f"concurrency and range size as the sidecar (`RUNAI_STREAMER_[OBJ_]CONCURRENCY`, "
        f"`RUNAI_STREAMER_CHUNK_BYTESIZE`: 32 MiB on loopback, 16 MiB on the S3-like origin)."
    )


def markdown(meta: dict[str, Any], records: list[dict[str, Any]], *, full: bool) -> str:
    parts = [setup(meta, records), "", main_table(records), ""]
    parts += [huge_pages_caption(records), "", huge_pages_table(records), ""]
    parts += [
        "![throughput](docs/bench-throughput.png)" if not full else "![throughput](bench-throughput.png)"
    ]
    if full:
        parts += [
            "", "![CPU per GiB](bench-cpu.png)", "",
            "**Against the goals** (ratios within rounds):", "", targets(records), "",
            "**Readers** (S3-like origin over S3, GiB/s):", "", curve_table(records, "readers", "readers"), "",
            "![readers](bench-readers.png)", "",
            "**Model size** (local file, GiB/s):", "", curve_table(records, "size", "GiB"), "",
            "![size](bench-size.png)", "",
            "**Range size** (S3-like origin over S3, GiB/s):", "", curve_table(records, "chunk", "MiB"), "",
            "![chunk](bench-chunk.png)",
        ]  # fmt: skip
    return "\n".join(parts)


def rewrite(path: Path, block: str, markers: tuple[str, str] = (BEGIN, END)) -> None:
    begin, end = markers
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} block to rewrite")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{block}\n{end}{tail}")


TC_ORIGINS = {
    "file": "local directory",
    "http": "nginx (HTTP)",
    "s3like": "S3-like origin (S3)",
    "s3rver": "s3rver (S3)",
}


def tensor_count_table(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """``tensor_count.py``'s results: per tensor count and origin, the MoE-shaped directory against its big
    twin (medians over rounds; the CPU ratio is the median of the ratios within rounds)."""
    rows: dict[tuple[int, str], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        if "cpu_s" in record:
            rows[(record["count"], record["origin"])][record["shape"]].append(record)
    lines = [
        f"Measured {meta.get('date', '?')} at commit {meta.get('commit', '?')} on {meta.get('cpus')} CPUs shared "
        f"with other work (load average {meta.get('load_avg', 0):.1f} at the start; each row gives its own). "
        "Small: 4-16 KiB float16 tensors (two of 32 MiB) in the shard counts below; big: the same bytes as "
        f"32 MiB tensors in 4 shards. `--chunk-size` {meta.get('args', {}).get('chunk_mib', 32)} MiB. Requests "
        "are counted at the server (an HTTP directory's 404 probes of absent small-file names apart); the "
        "bound is 4 per file + 2 per chunk of weights.",
        "",
        "| tensors / shards | origin | CPU-s/GiB small | big | small / big (goal <= 1.5) | requests (bound) "
        "| manifest after | sidecar RSS | attach + state_dict CPU-s | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (count, origin), shapes in sorted(
        rows.items(), key=lambda item: (item[0][0], list(TC_ORIGINS).index(item[0][1]))
    ):
        small, big = shapes.get("small", []), shapes.get("big", [])
        if not small:
            continue
        ratios = [
            s["cpu_s_per_gib"] / b["cpu_s_per_gib"] for s in small for b in big if s["round"] == b["round"]
        ]
        requests = _median(
            [s["requests"] - (s.get("not_found") or 0) for s in small if s["requests"] is not None]
        )
        absent = _median([s.get("not_found") or 0 for s in small if s["requests"] is not None])
        shown = "—" if requests != requests else f"{requests:.0f}" + (f" +{absent:.0f} 404" if absent else "")
        attach = _median([s["attach_state_dict_cpu_s"] for s in small if "attach_state_dict_cpu_s" in s])
        lines.append(
            f"| {count:,} / {small[0]['files'] - 2} | {TC_ORIGINS.get(origin, origin)} "
            f"| {_median([s['cpu_s_per_gib'] for s in small]):.2f} "
            f"| {_median([b['cpu_s_per_gib'] for b in big]):.2f} | {_median(ratios):.2f} "
            f"| {shown} ({small[0]['request_bound']}) | {_median([s['manifest_s'] for s in small]):.2f} s "
            f"| {_median([s['peak_rss'] for s in small]) / MIB:.0f} MiB | {attach:.2f} "
            f"| {_median([s['load_avg'] for s in small]):.1f} |"
        )
    return "\n".join(lines)


def plots(records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = group(records, "table")
    origins = [o for o in ORIGINS if (o, None) in grouped]
    contenders = [c for c in ORDER if any(c in grouped[(o, None)] for o in origins)]
    for key, ylabel, name in (("gib_s", "GiB/s (higher is better)", "throughput"),
                              ("cpu", "CPU-seconds per GiB (lower is better)", "cpu")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / max(1, len(contenders))
        for i, contender in enumerate(contenders):
            values = []
            for origin in origins:
                case = grouped[(origin, None)].get(contender)
                values.append(getattr(case, key) if case is not None and case.ok else 0.0)
            ax.bar(
                [j + i * width for j in range(len(origins))],
                values,
                width,
                label=NAMES[contender].replace("*", "").replace("`", ""),
            )
        ax.set_xticks([j + width * (len(contenders) - 1) / 2 for j in range(len(origins))])
        ax.set_xticklabels([ORIGINS[o] for o in origins], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, ncol=4)
        ax.set_title("a 0-bar is a contender that cannot read that origin", fontsize=8)
        fig.tight_layout()
        fig.savefig(DOCS / f"bench-{name}.png", dpi=90)
        plt.close(fig)
    for section, xlabel, log in (("readers", "readers (ranges in flight)", True),
                                 ("size", "model size, GiB", True), ("chunk", "range size, MiB", True)):  # fmt: skip
        curves = group(records, section)
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        points = sorted(curves.items(), key=lambda item: float(item[0][1]))
        for contender in ORDER:
            xs = [float(x) for (_, x), cases in points if contender in cases and cases[contender].ok]
            ys = [
                cases[contender].gib_s
                for (_, x), cases in points
                if contender in cases and cases[contender].ok
            ]
            if xs:
                ax.plot(xs, ys, marker="o", label=NAMES[contender].replace("*", "").replace("`", ""))
        if section == "readers":
            xs = [float(x) for (_, x), _ in points]
            link, cap = _link_and_cap()
            ax.plot(
                xs,
                [min(link, x * cap) for x in xs],
                "k--",
                label="min(link, readers x cap)",
            )
        if log:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GiB/s")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(DOCS / f"bench-{section}.png", dpi=90)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    parser = argparse.ArgumentParser(
        prog="report.py",
        description="Write docs/bench-*.png and the generated tables of README.md and docs/benchmarks.md "
        "from the raw results of benchmarks/run.py.",
    )
    parser.add_argument(
        "results",
        nargs="?",
        type=Path,
        default=DOCS / "bench-results.jsonl",
        help="the JSON lines file run.py wrote (default docs/bench-results.jsonl)",
    )
    path = parser.parse_args(argv).results
    if not path.is_file():
        print(
            f"report.py: no results file at {path}: run benchmarks/run.py (--out FILE) first", file=sys.stderr
        )
        return 2
    meta, records = load(path)
    plots(records)
    rewrite(ROOT / "README.md", markdown(meta, records, full=False))
    rewrite(DOCS / "benchmarks.md", markdown(meta, records, full=True))
    counts = DOCS / "tensor-count.jsonl"
    if counts.exists():
        table = tensor_count_table(*load(counts))
        rewrite(ROOT / "README.md", table, TENSOR_COUNT)
        rewrite(DOCS / "benchmarks.md", table, TENSOR_COUNT)
    print(f"wrote docs/bench-*.png, README.md and docs/benchmarks.md from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
