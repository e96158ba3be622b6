"""Sidecars as each other's sources, against every sidecar reading the origin, on a shaped topology.

N sidecars (1, 2, 4, 8) start together, each in a network namespace of its own behind a ``--pod-rate``
link, and load one safetensors model from nginx in an origin namespace behind a slower ``--origin-rate``
link (``tc tbf``; ``netem`` adds ``--delay`` where the kernel has it). For each N, once with peers (a static
list of every other sidecar) and once without, the figures are:

- origin bytes: body bytes in nginx's access log, as a multiple of the model's size;
- load window: from the first sidecar's load start to the last one's finish (their /status), which leaves
  out the Python start of N processes on this machine's few cores;
- launch to all ready: from starting the N processes until every segment is COMPLETE.

Then one sidecar alone, with peers on and off, over ``--single-rounds`` rounds in the same run (the order
swapped every round, so a drift of the machine's load falls on both alike): the median of the per-round
ratios of the load windows, with peers over without, is the cost of turning peers on for a single pod.

Then **one bad peer**: for each mode of ``--bad-peers`` (the fake peer of the hostile-peer suite,
``tests/support/fake_peer.py``: a squatter, a stalled or trickling server, 429 forever, wrong bytes, no
token...), ``--bad-count`` sidecars (8) start together with the fake in their peer list, and, in the same
run and alternating the order, without it. Reported per mode: the load window with the bad peer over the
window without (goal: at most 1.25), and the origin bytes with it as a multiple of the model (goal: at most
1.5), with the load average. ``--bad-only`` runs only these rounds.

Needs root (namespaces), nginx and iproute2. Writes ``--out`` (JSON) and an SVG plot beside it;
``--single-only`` runs the single-pod rounds alone and writes no plot.

    sudo .venv/bin/python benchmarks/peer_fleet.py [--size-mib 64] [--origin-rate 100mbit] [--pod-rate 1gbit]
    sudo .venv/bin/python benchmarks/peer_fleet.py --bad-only --bad-peers squatter,stall --out bad.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from tests.peers.topology import Topology, can_make_namespaces  # noqa: E402
from tests.sidecar.models import safetensors_bytes  # noqa: E402
from tests.support.fake_peer import FakePeer  # noqa: E402

FLEET_GOAL = 1.5
"""The load window of N sidecars with peers, over one sidecar's alone, at most (a goal for this benchmark; the
tests check only what load cannot change: bytes, completion, content)."""
WINDOW_GOAL = 1.25
"""The load window of a fleet with one bad peer, over the same fleet's without it, at most."""
ORIGIN_GOAL = 1.5
"""The origin bytes of a fleet with one bad peer, as a multiple of the model, at most."""
BAD_PEERS = "squatter,stall,slow,busy,reset,wrong_bytes,no_token"


def _model(size_mib: int) -> bytes:
    generator = torch.Generator().manual_seed(0)
    return safetensors_bytes(
        {f"layers.{i}.weight": torch.randn(512, 512, generator=generator) for i in range(size_mib)}
    )


def _round(
    topology: Topology, count: int, *, peers: bool, size: int, extra_peers: tuple[str, ...] = ()
) -> dict[str, float]:
    topology.reset_log()
    hosts = topology.hosts[1 : count + 1]
    launched = time.monotonic()
    url = topology.url("model.safetensors")
    sidecars = [
        topology.start_sidecar(host, url, peers=hosts if peers else None, extra_peers=extra_peers)
        for host in hosts
    ]
    done = topology.wait_complete(sidecars, timeout=600)
    docs = [topology.status(s) for s in sidecars]
    window = max(float(d["finished_at"]) for d in docs) - min(float(d["started_at"]) for d in docs)  # type: ignore[arg-type]
    figures = {
        "n": count,
        "peers": peers,
        "origin_x": topology.origin_bytes() / size,
        "window_s": window,
        "launch_to_ready_s": done - launched,
    }
    topology.stop_sidecars()
    return figures


def _single(topology: Topology, rounds: int, *, size: int) -> dict[str, object]:
    """N = 1 with and without peers, alternating, ``rounds`` times; the median ratio of the load windows."""
    rows = []
    for i in range(rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        pair = {peers: _round(topology, 1, peers=peers, size=size) for peers in order}
        rows.append(
            {
                "with_s": pair[True]["window_s"],
                "without_s": pair[False]["window_s"],
                "launch_with_s": pair[True]["launch_to_ready_s"],
                "launch_without_s": pair[False]["launch_to_ready_s"],
            }
        )
        print(
            f"N=1 round {i + 1}: load window {pair[True]['window_s']:.2f} s with peers,"
            f" {pair[False]['window_s']:.2f} s without; launch to ready {pair[True]['launch_to_ready_s']:.2f} s"
            f" and {pair[False]['launch_to_ready_s']:.2f} s",
            flush=True,
        )
    ratios = [r["with_s"] / r["without_s"] for r in rows]
    return {
        "rounds": rows,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "median_launch_ratio": statistics.median(r["launch_with_s"] / r["launch_without_s"] for r in rows),
        "median_with_s": statistics.median(r["with_s"] for r in rows),
        "median_without_s": statistics.median(r["without_s"] for r in rows),
        "load_average": os.getloadavg()[0],
    }


def _bad(
    topology: Topology, modes: list[str], count: int, *, rounds: int, size: int
) -> list[dict[str, object]]:
    """Per mode, ``count`` sidecars with and without one bad peer in their list, ``rounds`` times, the order
    alternating; the median of the per-round window ratios and the largest origin multiple."""
    rows: list[dict[str, object]] = []
    model = topology.root / "model.safetensors"
    for mode in modes:
        fake = FakePeer(
            mode, origin_url=topology.url(model.name), path=model, token=topology.token, host=topology.test_ip
        )
        pairs: list[dict[bool, dict[str, float]]] = []
        with fake:
            for i in range(rounds):
                pair: dict[bool, dict[str, float]] = {}
                for bad in (True, False) if i % 2 == 0 else (False, True):
                    extra = (fake.url,) if bad else ()
                    pair[bad] = _round(topology, count, peers=True, size=size, extra_peers=extra)
                pairs.append(pair)
        ratios = [p[True]["window_s"] / p[False]["window_s"] for p in pairs]
        row: dict[str, object] = {
            "mode": mode,
            "windows_s": [p[True]["window_s"] for p in pairs],
            "windows_without_s": [p[False]["window_s"] for p in pairs],
            "window_ratio": statistics.median(ratios),
            "window_ratios": ratios,
            "origin_x": max(p[True]["origin_x"] for p in pairs),
            "origin_without_x": max(p[False]["origin_x"] for p in pairs),
            "load_average": os.getloadavg()[0],
        }
        rows.append(row)
        print(
            f"N={count} with one {mode} peer: load window {row['window_ratio']:.2f} x without (median of"
            f" {', '.join(f'{r:.2f}' for r in ratios)}; goal {WINDOW_GOAL}); origin at most"
            f" {row['origin_x']:.2f} x model (goal {ORIGIN_GOAL}), {row['origin_without_x']:.2f} x without;"
            f" load average {row['load_average']:.1f}",
            flush=True,
        )
    return rows


def _svg(results: list[dict[str, float]], path: Path, *, title: str) -> None:
    """Two small line charts (load window and origin bytes against N), with and without peers."""
    width, height, pad = 360, 240, 44
    panels = [("window_s", "load window (s)"), ("origin_x", "origin bytes (x model)")]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height + 30}" font-size="11">'
    ]
    parts.append(f'<text x="{width}" y="16" text-anchor="middle" font-size="13">{title}</text>')
    counts = sorted({int(r["n"]) for r in results})
    for p, (key, label) in enumerate(panels):
        x0 = p * width
        top = max(r[key] for r in results) * 1.1 or 1.0

        def point(n: int, value: float, x0: int = x0, top: float = top) -> tuple[float, float]:
            x = x0 + pad + (counts.index(n) / max(len(counts) - 1, 1)) * (width - 2 * pad)
            y = 30 + (height - pad) * (1 - value / top)
            return x, y

        parts.append(
            f'<line x1="{x0 + pad}" y1="{30 + height - pad}" x2="{x0 + width - pad}" y2="{30 + height - pad}" stroke="black"/>'
        )
        parts.append(
            f'<line x1="{x0 + pad}" y1="30" x2="{x0 + pad}" y2="{30 + height - pad}" stroke="black"/>'
        )
        parts.append(
            f'<text x="{x0 + width / 2}" y="{height + 25}" text-anchor="middle">N sidecars; {label}</text>'
        )
        for n in counts:
            x, _ = point(n, 0)
            parts.append(f'<text x="{x}" y="{30 + height - pad + 14}" text-anchor="middle">{n}</text>')
        parts.append(f'<text x="{x0 + pad - 4}" y="34" text-anchor="end">{top / 1.1:.1f}</text>')
        for peers, colour in ((True, "#1f77b4"), (False, "#d62728")):
            rows = sorted((r for r in results if r["peers"] == peers), key=lambda r: r["n"])
            points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (point(int(r["n"]), r[key]) for r in rows))
            parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
            name = "with peers" if peers else "without peers"
            parts.append(
                f'<text x="{x0 + pad + 8}" y="{44 + (0 if peers else 14)}" fill="{colour}">{name}</text>'
            )
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--origin-rate", default="100mbit")
    parser.add_argument("--pod-rate", default="1gbit")
    parser.add_argument("--delay", default="1ms")
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--single-rounds", type=int, default=6, help="rounds of N = 1 with and without peers")
    parser.add_argument("--single-only", action="store_true", help="only the N = 1 rounds; no plot")
    parser.add_argument("--bad-peers", default=BAD_PEERS, help="fake peer modes to run a fleet beside")
    parser.add_argument("--bad-count", type=int, default=8, help="sidecars in the fleet beside a bad peer")
    parser.add_argument(
        "--bad-rounds", type=int, default=3, help="rounds per bad-peer mode, with and without"
    )
    parser.add_argument("--bad-only", action="store_true", help="only the bad-peer rounds; no plot")
    parser.add_argument("--stall-timeout", type=int, default=2, help="the sidecars' --peer-stall-timeout")
    parser.add_argument("--out", type=Path, default=Path("peer-fleet.json"))
    args = parser.parse_args()
    # A stopped benchmark (a timeout, a kill) still removes its namespaces, sidecars and nginx: the finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    why = can_make_namespaces()
    if why is not None:
        print(f"benchmarks/peer_fleet.py: skipped: {why}", file=sys.stderr)
        return 0
    counts = [int(c) for c in args.counts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="ml-peers-bench-origin-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="ml-peers-bench-", dir="/dev/shm"))
    (root / "model.safetensors").write_bytes(_model(args.size_mib))
    size = (root / "model.safetensors").stat().st_size
    topology = Topology(
        root=root,
        work=work,
        origin_rate=args.origin_rate,
        pod_rate=args.pod_rate,
        delay=args.delay,
        stall_timeout=args.stall_timeout,
    )
    results = []
    single: dict[str, object] = {}
    bad: list[dict[str, object]] = []
    modes = [m for m in args.bad_peers.split(",") if m]
    fleet_rounds = not (args.single_only or args.bad_only)
    try:
        hosts = 1 if args.single_only else max([*counts, args.bad_count] if modes else counts)
        for _ in range(hosts):
            topology.add_host(f"pod{len(topology.hosts)}")
        for count in counts if fleet_rounds else []:
            for peers in (True, False):
                figures = _round(topology, count, peers=peers, size=size)
                results.append(figures)
                print(
                    f"N={count} {'peers   ' if peers else 'no peers'}: origin {figures['origin_x']:.2f} x model,"
                    f" load window {figures['window_s']:.2f} s, launch to all ready {figures['launch_to_ready_s']:.2f} s",
                    flush=True,
                )
        if args.single_rounds > 0 and not args.bad_only:
            single = _single(topology, args.single_rounds, size=size)
            print(
                f"N=1 over {args.single_rounds} alternating rounds: with peers / without ="
                f" {single['median_ratio']:.3f} (median; range {single['min_ratio']:.3f} to"
                f" {single['max_ratio']:.3f}), medians {single['median_with_s']:.2f} s and"
                f" {single['median_without_s']:.2f} s; launch to ready {single['median_launch_ratio']:.3f};"
                f" load average {single['load_average']:.2f}",
                flush=True,
            )
        if modes and not args.single_only:
            bad = _bad(topology, modes, args.bad_count, rounds=args.bad_rounds, size=size)
    finally:
        topology.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    setup = {
        "model_bytes": size,
        "origin_rate": args.origin_rate,
        "pod_rate": args.pod_rate,
        "delay": args.delay if topology.delayed else "none (no sch_netem)",
        "peer_stall_timeout_s": args.stall_timeout,
    }
    document = {"setup": setup, "results": results, "single": single, "bad_peer": bad}
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    if not fleet_rounds:
        return 0
    title = f"{size >> 20} MiB model, origin {args.origin_rate}, pods {args.pod_rate}"
    _svg(results, args.out.with_suffix(".svg"), title=title)
    alone = next(r["window_s"] for r in results if r["n"] == 1 and r["peers"])
    for r in results:
        if r["peers"] and r["n"] > 1:
            ratio = r["window_s"] / alone
            verdict = "meets" if ratio <= FLEET_GOAL else "misses"
            print(
                f"N={int(r['n'])} with peers: {ratio:.2f} x one sidecar's load window"
                f" ({verdict} the goal of {FLEET_GOAL} x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
