"""Fault suite soak: every transient fault against the index read and against a data range, over HTTP and S3,
many runs each; every run must end COMPLETE and byte-exact.

Not a CI test (the test suite runs each case once: ``tests/sidecar/test_fault_suite.py``); a script to run
by hand, about two minutes for the default 20 runs of each of the 24 cases::

    .venv/bin/python benchmarks/fault_suite.py              # 20 runs of every case
    .venv/bin/python benchmarks/fault_suite.py --runs 50 --only reset,stall --origins s3

The faults (reset, truncation, HTTP 500, HTTP 503, S3 SlowDown with Retry-After, a stall longer than the
stall timeout) and what counts as a pass are in ``tests/support/fault_cases.py``: the real engine loads a
small model (safetensors over HTTP from nginx, tensorizer over S3 from moto, each behind the fault proxy),
the proxy breaks the index read (the first request, the look-up too) or the first data range (the second), and the run
passes when the load completed, every tensor equals the file byte for byte, and the broken request was
retried. The script prints one line per case (runs, passes, retries, the median and slowest run) and the
load average, and exits 1 if any run did not pass.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sidecar import models
from tests.support.fault_cases import FAULTS, ORIGINS, TARGETS, Outcome, run_case, source_settings
from tests.support.fault_proxy import FaultProxy
from tests.support.moto_s3 import TEST_CREDENTIALS, MotoS3Server
from tests.support.nginx import start_nginx


@contextmanager
def _origin(name: str, data: bytes, stack: ExitStack) -> Iterator[tuple[str, FaultProxy]]:
    """The model behind a fault proxy: ``(url, proxy)``."""
    if name == "http":
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fault-suite-nginx-")))
        nginx = stack.enter_context(start_nginx(root))
        nginx.put("fault-suite.bin", data)
        proxy = stack.enter_context(FaultProxy(nginx.port))
        yield proxy.url("fault-suite.bin"), proxy
        return
    os.environ.update(TEST_CREDENTIALS.env())
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    moto = MotoS3Server()
    stack.callback(moto.stop)
    url = moto.put("fault-suite", "model.bin", data)
    proxy = stack.enter_context(FaultProxy(moto.port))
    yield url, proxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of every case (default 20)")
    parser.add_argument("--only", help="comma-separated faults (default: all of " + ", ".join(FAULTS) + ")")
    parser.add_argument("--origins", default=",".join(ORIGINS), help="http, s3 or both (default both)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the retries are counted; their warnings would drown the table
    logging.getLogger("modelload").setLevel(logging.ERROR)
    faults = args.only.split(",") if args.only else list(FAULTS)
    tensors = models.state_dict(seed=90, layers=2)
    expected = {name: models.as_bytes(tensor) for name, tensor in tensors.items()}
    failures = 0
    print(
        f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs"
    )
    print("| origin | target | fault | runs | complete and byte-exact | retries | median s | max s |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fault-suite-", dir="/dev/shm") as shm:
        segment = Path(shm) / "model.seg"
        for origin in args.origins.split(","):
            fmt = "safetensors" if origin == "http" else "tensorizer"
            data = (
                models.safetensors_bytes(tensors)
                if fmt == "safetensors"
                else models.tensorizer_bytes(tensors)
            )
            with ExitStack() as stack, _origin(origin, data, stack) as (url, proxy):
                sources = source_settings(origin, proxy)
                for target in TARGETS:
                    for fault in faults:
                        outcomes: list[Outcome] = [
                            run_case(
                                url=url,
                                fault=FAULTS[fault](target),
                                target=target,
                                proxy=proxy,
                                sources=sources,
                                segment=segment,
                                expected=expected,
                            )
                            for _ in range(args.runs)
                        ]
                        passed = sum(o.ok for o in outcomes)
                        failures += len(outcomes) - passed
                        seconds = [o.seconds for o in outcomes]
                        print(
                            f"| {origin} ({fmt}) | {target} | {fault} | {len(outcomes)} | {passed} |"
                            f" {sum(o.retries for o in outcomes)} | {statistics.median(seconds):.2f} |"
                            f" {max(seconds):.2f} |",
                            flush=True,
                        )
                        for outcome in outcomes:
                            if not outcome.ok:
                                print(f"    not passed: {outcome}", flush=True)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("every run COMPLETE and byte-exact" if failures == 0 else f"{failures} runs did not pass")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
