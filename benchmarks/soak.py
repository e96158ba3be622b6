"""Fault soak: the real sidecar engine against nginx through the fault proxy, many runs per fault.

Not a CI test: a script to run by hand (minutes), which prints a table of outcomes per fault::

    .venv/bin/python benchmarks/soak.py                 # 20 runs of every fault
    .venv/bin/python benchmarks/soak.py --runs 5 --only reset,stall

Every run loads a small model (tensorizer and safetensors alternate) through a
:class:`~tests.support.fault_proxy.FaultProxy` in front of nginx, then reads the segment back and sorts
the run into one outcome:

- ``exact``: the load completed and every tensor equals one version of the file, byte for byte;
- ``error``: the load failed with a project error (a branch of ``modelload.loader.errors``) and a message,
  and every tensor it had published was exact;
- ``hang``: no end within the run's deadline (the soak stops the engine; a real sidecar would wait on);
- ``torn``: a tensor published READY whose bytes match no version of the file;
- ``mixed``: a completed load whose tensors come from two versions of the file;
- ``other``: an exception outside the project's error tree (a traceback for the user).

The first two are what the project promises; the rest are defects. Faults:

- reset, truncate, 500, 503, stall: one of them on a random quarter of the requests (seeded per run);
- trickle: a quarter of the responses arrive at about 200 kB/s (slow, never silent);
- slow range: one data range arrives at a few bytes per second, never silent long enough for the stall
  timeout;
- change (new ETag) / change (same ETag) / change (no validators): the file is replaced by a same-size
  second version after a random number of data requests; the ETag changes, stays (mtime preserved, as nginx
  derives it from mtime and size), or the server sends neither ETag nor Last-Modified;
- kill + restart: ``modelload sidecar`` is SIGKILLed mid-load and started again on the same segment path, in
  a roomy volume and in a volume sized like the operator sizes it (the segment plus a little headroom);
- full volume: the segment's volume (a tmpfs mounted for the run; needs root) is smaller than the model.

Engine settings are the fault tests' (3 readers, 64 KiB chunks, 0.3 s stall timeout, a 1 s window for the
minimum rate, 4 attempts within 20 s) so a run takes a second; the kill cases run ``modelload sidecar`` with
its defaults but 1 MiB chunks. With 4 attempts and a fault on a quarter of the requests, some runs of the
transient faults exhaust their attempts on one range: those end as ``error`` (a clear one) by design.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modelload.loader.errors import ModelloadError
from modelload.loader.segment import SegmentReader, WriterState
from modelload.loader.segment.layout import TensorState
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine, LoadStopped
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import HttpSettings, RetryPolicy, SourceSettings
from tests.sidecar import models
from tests.support import fault_proxy as fp
from tests.support.nginx import NginxServer
from tests.support.processes import stop_process

RETRY = RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0)
HTTP = HttpSettings(connect_timeout=2.0, stall_timeout=0.3, slow_window=1.0)
"""The defaults scaled down a hundredfold (stall 30 s, slow window 30 s), as the fault tests do."""
SETTINGS = SourceSettings(http=HTTP, retry=RETRY)
DEADLINE = 10.0
"""Seconds a run may take before it counts as a hang (a clean run takes well under one)."""


# --- faults the proxy does not have -----------------------------------------------------------------------


@dataclass(frozen=True)
class Trickle:
    """Send the body ``piece`` bytes at a time, ``interval`` seconds apart (slow, never silent)."""

    piece: int
    interval: float


@dataclass(frozen=True)
class NoValidators:
    """Drop ETag and Last-Modified from the answer: a server that sends no validators."""


class SoakProxy(fp.FaultProxy):
    """The fault proxy, plus :class:`Trickle`, :class:`NoValidators`, and a hook on the n-th data request."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.on_request: tuple[int, Callable[[], None]] | None = None
        self.halted = threading.Event()
        """Set at a run's deadline: trickles stop sending and connections close, to free stuck readers."""
        self._data_requests = 0

    def reset(self) -> None:
        self.clear()
        with self._lock:
            self.on_request = None
            self._data_requests = 0
            self.requests.clear()
        self.halted.clear()

    def halt(self) -> None:
        self.halted.set()
        self.drop_connections()

    def _choose(self, method: str, path: str) -> Any:
        hook = None
        with self._lock:
            self._data_requests += 1
            if self.on_request is not None and self._data_requests == self.on_request[0]:
                hook = self.on_request[1]
        if hook is not None:
            hook()
        return super()._choose(method, path)

    def _send_with_fault(  # type: ignore[override]
        self,
        client: socket.socket,
        fault: Any,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        body: bytes,
        method: str,
    ) -> bool:
        if isinstance(fault, NoValidators):
            headers = [(k, v) for k, v in headers if k.lower() not in ("etag", "last-modified")]
            fault = None
        if isinstance(fault, Trickle):
            client.sendall(fp._head(status, reason, headers))
            try:
                for start in range(0, len(body), fault.piece):
                    if self.halted.is_set():
                        return False
                    client.sendall(body[start : start + fault.piece])
                    time.sleep(fault.interval)
            except OSError:
                return False
            return True
        return fp.FaultProxy._send_with_fault(client, fault, status, reason, headers, body, method)


# --- the model and how a run is judged --------------------------------------------------------------------


@dataclass
class Versions:
    """Two same-size versions of one model file, and each tensor's bytes in each."""

    files: list[bytes]
    tensors: list[dict[str, bytes]]


def make_versions(fmt: str, *, layers: int, width: int) -> Versions:
    files, tensors = [], []
    for seed in (1, 2):
        state = models.state_dict(layers=layers, width=width, seed=seed)
        data = models.tensorizer_bytes(state) if fmt == "tensorizer" else models.safetensors_bytes(state)
        files.append(data)
        tensors.append({name: models.as_bytes(t) for name, t in state.items()})
    if len(files[0]) != len(files[1]):
        raise RuntimeError("the two versions differ in size; the change faults need same-size files")
    return Versions(files, tensors)


@dataclass
class Result:
    outcome: str
    seconds: float
    detail: str = ""


def judge(segment: Path, versions: Versions, error: BaseException | None, seconds: float) -> Result:
    """Sort a finished run into an outcome (see the module docstring) by reading its segment back."""
    seen: set[int] = set()
    torn: list[str] = []
    complete = False
    if segment.exists():
        with contextlib.suppress(ModelloadError), SegmentReader.open(segment) as reader:
            complete = reader.writer_state == WriterState.COMPLETE
            for slot in reader.slots:
                if reader.state(slot.index) != TensorState.READY:
                    continue
                got = bytes(reader.view(slot.index))
                matches = {v for v, tensors in enumerate(versions.tensors) if tensors.get(slot.name) == got}
                if not matches:
                    torn.append(slot.name)
                elif len(matches) == 1:
                    seen |= matches
    if torn:
        return Result("torn", seconds, f"{len(torn)} READY tensor(s) match no version, e.g. {torn[0]}")
    if isinstance(error, LoadStopped):
        return Result("hang", seconds, "stopped at the deadline")
    if error is not None:
        kind = type(error).__name__
        if not isinstance(error, ModelloadError) or not str(error):
            return Result("other", seconds, f"{kind}: {error}")
        if "unexpectedly" in str(error):
            return Result("other", seconds, f"{kind} (unexpected): {str(error)[:120]}")
        return Result("error", seconds, kind)
    if not complete:
        return Result("other", seconds, "no error, yet the segment is not COMPLETE")
    if len(seen) > 1:
        return Result("mixed", seconds, "tensors from both versions in one COMPLETE segment")
    return Result("exact", seconds)


# --- in-process runs ---------------------------------------------------------------------------------------


def load(url: str, segment: Path, versions: Versions, proxy: SoakProxy) -> Result:
    """Run the engine once with a watchdog that stops it at :data:`DEADLINE`.

    The engine's stop takes effect between chunks, so the watchdog also closes the proxy's connections: a
    reader stuck in a trickling range would otherwise hold the run for as long as the range takes.
    """
    engine = Engine(
        LoadSettings(source=url, segment=segment, readers=3, chunk_size=64 << 10, notify=None),
        sources=SETTINGS,
        observer=LoadTracker(),
    )

    def halt() -> None:
        engine.stop()
        proxy.halt()

    watchdog = threading.Timer(DEADLINE, halt)
    watchdog.start()
    started = time.monotonic()
    error: BaseException | None = None
    try:
        engine.run()
    except BaseException as exc:
        error = exc
    finally:
        watchdog.cancel()
    return judge(segment, versions, error, time.monotonic() - started)


@dataclass
class Bench:
    nginx: NginxServer
    proxy: SoakProxy
    shm: Path
    versions: dict[str, Versions]
    results: dict[str, list[Result]] = field(default_factory=dict)

    def file(self, fmt: str, run: int) -> tuple[str, Versions]:
        """Publish version 1 of the ``fmt`` model under a fresh name; its URL through the proxy."""
        name = f"soak-{run}.{fmt}"
        (self.nginx.root / name).write_bytes(self.versions[fmt].files[0])
        return name, self.versions[fmt]


def transient(faults: list[Any], probability: float = 0.25) -> Callable[[Bench, int], Result]:
    def case(bench: Bench, run: int) -> Result:
        fmt = ("tensorizer", "safetensors")[run % 2]
        name, versions = bench.file(fmt, run)
        bench.proxy.randomly(faults, probability=probability, seed=run)
        return load(bench.proxy.url(name), bench.shm / f"{run}.seg", versions, bench.proxy)

    return case


def slow_range(bench: Bench, run: int) -> Result:
    fmt = ("tensorizer", "safetensors")[run % 2]
    name, versions = bench.file(fmt, run)
    # The stat and the index read pass; one data range then arrives at ~80 bytes a second.
    bench.proxy.push(fp.Stall(after=0, seconds=0.0), fp.Stall(after=0, seconds=0.0), Trickle(8, 0.1))
    return load(bench.proxy.url(name), bench.shm / f"{run}.seg", versions, bench.proxy)


def change(mode: str) -> Callable[[Bench, int], Result]:
    def case(bench: Bench, run: int) -> Result:
        fmt = ("tensorizer", "safetensors")[run % 2]
        name, versions = bench.file(fmt, run)
        path = bench.nginx.root / name
        before = path.stat()

        def replace() -> None:
            temp = path.with_suffix(".new")
            temp.write_bytes(versions.files[1])
            shift = 0 if mode == "same-etag" else 5
            os.utime(temp, ns=(before.st_atime_ns, before.st_mtime_ns + shift * 1_000_000_000))
            temp.replace(path)

        if mode == "no-validators":
            bench.proxy.always(NoValidators(), method=None)
        bench.proxy.on_request = (random.Random(run).randint(3, 20), replace)
        return load(bench.proxy.url(name), bench.shm / f"{run}.seg", versions, bench.proxy)

    return case


# --- the sidecar as a process: kill and restart ------------------------------------------------------------


def sidecar(url: str, segment: Path) -> subprocess.Popen[bytes]:
    command = [
        str(Path(sys.executable).with_name("modelload")),
        *("sidecar", "--source", url, "--segment", str(segment), "--port", "0"),
        *("--readers", "3", "--chunk-size", "1MiB", "--notify", "none", "--log-level", "warning"),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_state(segment: Path, until: Callable[[SegmentReader], bool], timeout: float) -> SegmentReader | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(ModelloadError, OSError):
            reader = SegmentReader.open(segment)
            if until(reader):
                return reader
            reader.close()
        time.sleep(0.02)
    return None


@contextlib.contextmanager
def tmpfs(size: int) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="modelload-soak-vol-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def kill_restart(tight: bool) -> Callable[[Bench, int], Result]:
    def case(bench: Bench, run: int) -> Result:
        fmt = ("tensorizer", "safetensors")[run % 2]
        versions = bench.versions[f"{fmt}-big"]
        name = f"soak-kill-{run}.{fmt}"
        (bench.nginx.root / name).write_bytes(versions.files[0])
        bench.proxy.always(fp.Stall(after=0, seconds=0.15))  # a load of a few seconds, to kill it inside
        size = int(len(versions.files[0]) * 1.3) + (0 if tight else 64 << 20)
        started = time.monotonic()
        with tmpfs(size) as volume:
            segment = volume / "model.seg"
            first = sidecar(bench.proxy.url(name), segment)
            try:
                reader = wait_state(segment, lambda r: r.tensors_ready >= 3, timeout=DEADLINE)
                if reader is not None:
                    reader.close()
                first.send_signal(signal.SIGKILL)
            finally:
                first.wait()
            bench.proxy.clear()
            second = sidecar(bench.proxy.url(name), segment)
            try:
                done = wait_state(
                    segment,
                    lambda r: (
                        r.writer_state in (WriterState.COMPLETE, WriterState.FAILED)
                        and r.writer_pid == second.pid
                    ),
                    timeout=DEADLINE,
                )
                exited = second.poll()
                if done is None:
                    # The restart never took the segment over: what it said is the outcome. The old
                    # segment stays LOADING under a dead writer; its readers wait for its heartbeat to age.
                    said = [line for line in _stop(second).splitlines() if line.strip()]
                    last = _gist(said[-1]) if said else ""
                    how = "exited" if exited is not None else "stayed up"
                    if said and any(w in last.lower() for w in ("fail", "error", "space")):
                        return Result("error", time.monotonic() - started, f"restart {how}: {last}")
                    return Result("hang", time.monotonic() - started, f"restart {how}, silent")
                state = done.writer_state
                reason = done.error
                done.close()
                error = None if state == WriterState.COMPLETE else ModelloadError(reason or "failed")
                return judge(segment, versions, error, time.monotonic() - started)
            finally:
                _stop(second)

    return case


def _gist(line: str) -> str:
    """A log line without its time stamp and temporary paths, so equal failures count as one."""
    line = re.sub(r"^\S+ \S+ (ERROR|WARNING|INFO) ", "", line)
    return re.sub(r"/tmp/\S+", "<volume>", line)[:140]


def _stop(process: subprocess.Popen[bytes]) -> str:
    stop_process(process)
    return process.stderr.read().decode(errors="replace") if process.stderr else ""


def full_volume(bench: Bench, run: int) -> Result:
    fmt = ("tensorizer", "safetensors")[run % 2]
    name, versions = bench.file(fmt, run)
    with tmpfs(len(versions.files[0]) // 2) as volume:
        return load(bench.proxy.url(name), volume / "model.seg", versions, bench.proxy)


CASES: dict[str, Callable[[Bench, int], Result]] = {
    "reset": transient([fp.Reset(after=7_000)]),
    "truncate": transient([fp.Truncate(after=3_000)]),
    "500": transient([fp.server_error()]),
    "503 SlowDown": transient([fp.slow_down(retry_after=0.02)]),
    "stall": transient([fp.Stall(after=2_000, seconds=1.0)]),
    "trickle": transient([Trickle(16 << 10, 0.08)]),
    "slow range": slow_range,
    "change (new ETag)": change("new-etag"),
    "change (same ETag)": change("same-etag"),
    "change (no validators)": change("no-validators"),
    "kill + restart": kill_restart(tight=False),
    "kill + restart (tight volume)": kill_restart(tight=True),
    "full volume": full_volume,
}

OUTCOMES = ("exact", "error", "hang", "torn", "mixed", "other")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per fault (default 20)")
    parser.add_argument("--only", default="", help="comma-separated fault names (default: all)")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the engine's retry warnings: thousands of lines; the table tells
    chosen = [c.strip() for c in args.only.split(",") if c.strip()] or list(CASES)
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; known: {', '.join(CASES)}")
    if os.geteuid() != 0:
        chosen = [c for c in chosen if not c.startswith(("kill", "full"))]
        print("not root: the cases that mount a tmpfs (kill + restart, full volume) are skipped")
    versions = {fmt: make_versions(fmt, layers=4, width=256) for fmt in ("tensorizer", "safetensors")}
    versions |= {f"{f}-big": make_versions(f, layers=6, width=512) for f in ("tensorizer", "safetensors")}
    root = Path(tempfile.mkdtemp(prefix="modelload-soak-"))
    shm = Path(tempfile.mkdtemp(prefix="modelload-soak-", dir="/dev/shm"))
    nginx = NginxServer(root)
    proxy = SoakProxy(nginx.port)
    bench = Bench(nginx, proxy, shm, versions)
    try:
        for name in chosen:
            results = bench.results.setdefault(name, [])
            for run in range(args.runs):
                proxy.reset()
                results.append(CASES[name](bench, run))
                for stale in shm.iterdir():
                    with contextlib.suppress(OSError):
                        stale.unlink() if stale.is_file() else shutil.rmtree(stale)
            print(_row(name, results), flush=True)
    finally:
        proxy.close()
        nginx.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print()
    print(_table(bench.results))
    return 0


def _row(name: str, results: list[Result]) -> str:
    counts = Counter(r.outcome for r in results)
    details = Counter(r.detail for r in results if r.detail)
    mean = sum(r.seconds for r in results) / max(1, len(results))
    cells = " | ".join(str(counts.get(o, 0)) for o in OUTCOMES)
    shown = "; ".join(f"{d} x{n}" for d, n in details.most_common(3))
    return f"| {name} | {len(results)} | {cells} | {mean:.1f} | {shown} |"


def _table(results: dict[str, list[Result]]) -> str:
    head = "| fault | runs | " + " | ".join(OUTCOMES) + " | mean s | what the non-exact runs said |"
    rule = "|---|---|" + "---|" * len(OUTCOMES) + "---|---|"
    return "\n".join([head, rule, *(_row(name, r) for name, r in results.items())])


if __name__ == "__main__":
    sys.exit(main())
