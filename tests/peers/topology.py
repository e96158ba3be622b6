"""Hosts on one machine: network namespaces on a bridge, links shaped with tc, nginx as the origin.

Each host is a namespace with one veth into a switch namespace that holds the bridge, so nothing is added to
the machine's own network but one veth for the test process itself (to read the peers' counters). The
origin's link is capped well below the pods' (``tbf`` for the rate, ``netem`` for the delay, on each host's
egress), as a real object store's link is below a cluster's fabric. nginx runs in the origin namespace and
logs the body bytes of every answer: the origin's own count of what it sent.

Everything is made by :class:`Topology` and torn down by :meth:`Topology.close`, also after a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from modelload.loader.segment import SegmentReader, WriterState
from tests.conftest import find_executable
from tests.support.peer_client import peer_stats
from tests.support.waiting import wait_for

__all__ = ["Host", "Sidecar", "Topology", "can_make_namespaces"]

IP = "/usr/sbin/ip" if Path("/usr/sbin/ip").exists() else "ip"
TC = "/usr/sbin/tc" if Path("/usr/sbin/tc").exists() else "tc"
MODELLOAD = str(Path(sys.executable).parent / "modelload")
PEER_PORT = 8480


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def can_make_namespaces() -> str | None:
    """None when this process can make namespaces, veths and qdiscs; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the peer tests as root)"
    if find_executable("nginx") is None:
        return "nginx is not installed"
    name = f"mlprobe{os.getpid()}"
    try:
        made = _run(IP, "netns", "add", name, check=False)
    except FileNotFoundError:
        return "iproute2 (ip) is not installed"
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        ok = _run(IP, "netns", "exec", name, TC, "qdisc", "show", check=False)
        if ok.returncode != 0:
            return f"tc does not work in a namespace: {ok.stderr.strip()}"
    finally:
        _run(IP, "netns", "del", name, check=False)
    return None


@dataclass
class Host:
    name: str
    ip: str


@dataclass
class Sidecar:
    """A real ``modelload sidecar`` process in a host namespace."""

    host: Host
    segment: Path
    process: subprocess.Popen[bytes]
    log: Path
    started: float
    api_port: int = 8479

    @property
    def peer_url(self) -> str:
        return f"http://{self.host.ip}:{PEER_PORT}"

    def complete(self) -> bool:
        try:
            with SegmentReader.open(self.segment) as reader:
                state = reader.writer_state
        except Exception:
            return False
        if state == WriterState.FAILED:
            raise AssertionError(f"{self.host.name}'s load failed: {self.log.read_text()[-3000:]}")
        return state == WriterState.COMPLETE

    def finished_ns(self) -> int:
        with SegmentReader.open(self.segment) as reader:
            return reader.finished_ns

    def stats(self, token: str) -> dict[str, int]:
        return peer_stats(self.peer_url, token)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


@dataclass
class Topology:
    """A switch, an origin host with nginx over ``root``, and pod hosts, all in namespaces."""

    root: Path
    work: Path
    origin_rate: str = "100mbit"
    pod_rate: str = "1gbit"
    delay: str = "1ms"
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)
    sidecars: list[Sidecar] = field(default_factory=list)
    stall_timeout: int = 2
    """The sidecars' ``--peer-stall-timeout``: short, so that the fault tests see a bad peer dropped soon."""
    delayed: bool = False
    """Whether netem's delay is in place (the kernel has sch_netem)."""
    _nginx: subprocess.Popen[bytes] | None = None
    _started: int = 0
    _subnet: str = ""

    def __post_init__(self) -> None:
        self._subnet = f"10.{200 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:], 16)}"
        self.switch = f"ml{self.tag}sw"
        self.token = secrets.token_hex(16)
        self.token_file = self.work / "peer-token"
        self.token_file.write_text(self.token + "\n")
        self.access_log = self.work / "origin-access.log"
        try:
            _run(IP, "netns", "add", self.switch)
            _run(IP, "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run(IP, "-n", self.switch, "link", "set", "br0", "up")
            # The test process's own leg, unshaped: to read counters from the peers' ports.
            self._veth(None, 254, rate=None)
            self.origin = self.add_host("origin", rate=self.origin_rate)
            self._start_nginx()
        except BaseException:
            self.close()
            raise

    # --- hosts -------------------------------------------------------------------------------------------

    def _veth(self, namespace: str | None, number: int, *, rate: str | None) -> str:
        ip = f"{self._subnet}.{number}"
        inner, outer = f"ml{self.tag}h{number}", f"ml{self.tag}p{number}"
        _run(IP, "link", "add", inner, "type", "veth", "peer", "name", outer)
        _run(IP, "link", "set", outer, "netns", self.switch)
        _run(IP, "-n", self.switch, "link", "set", outer, "master", "br0", "up")
        where: tuple[str, ...] = ()
        if namespace is not None:
            _run(IP, "link", "set", inner, "netns", namespace)
            where = ("-n", namespace)
            _run(IP, *where, "link", "set", "lo", "up")
        _run(IP, *where, "addr", "add", f"{ip}/24", "dev", inner)
        _run(IP, *where, "link", "set", inner, "up")
        if rate is not None:
            tc = (IP, "netns", "exec", namespace, TC) if namespace else (TC,)
            # netem for the delay, with tbf under it for the rate; kernels without sch_netem (this CI's VMs)
            # get the rate alone: the ratios under test depend on the rates, not on 1 ms.
            netem = _run(
                *tc,
                "qdisc",
                "add",
                "dev",
                inner,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                self.delay,
                check=False,
            )
            self.delayed = netem.returncode == 0
            parent = ("parent", "1:1") if self.delayed else ("root",)
            _run(
                *tc, "qdisc", "add", "dev", inner, *parent, "handle", "10:", "tbf",
                "rate", rate, "burst", "256kb", "latency", "100ms",
            )  # fmt: skip
        return ip

    def add_host(self, name: str, *, rate: str | None = None) -> Host:
        number = len(self.hosts) + 1
        namespace = f"ml{self.tag}{name}"
        _run(IP, "netns", "add", namespace)
        host = Host(namespace, f"{self._subnet}.{number}")
        self.hosts.append(host)  # before anything else: close() deletes it whatever happens next
        self._veth(namespace, number, rate=rate or self.pod_rate)
        return host

    def shape(self, host: Host, rate: str) -> None:
        """Change ``host``'s egress rate (its uploads to peers, for a slow or stalling peer)."""
        number = host.ip.rsplit(".", 1)[1]
        _run(
            IP, "netns", "exec", host.name, TC, "qdisc", "change", "dev", f"ml{self.tag}h{number}",
            *(("parent", "1:1") if self.delayed else ("root",)), "handle", "10:", "tbf",
            "rate", rate, "burst", "256kb", "latency", "100ms",
        )  # fmt: skip

    def status(self, sidecar: Sidecar) -> dict[str, object]:
        """The sidecar's /status document (its status API, over the test's own leg)."""
        url = f"http://{sidecar.host.ip}:{sidecar.api_port}/status"
        with urllib.request.urlopen(url, timeout=5) as response:
            doc: dict[str, object] = json.loads(response.read())
        return doc

    # --- the origin --------------------------------------------------------------------------------------

    def _start_nginx(self) -> None:
        nginx = find_executable("nginx")
        assert nginx is not None
        state = self.work / "nginx"
        (state / "tmp").mkdir(parents=True)
        config = state / "nginx.conf"
        config.write_text(
            f"""
user root root;
worker_processes 2;
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format sent '$status $body_bytes_sent $http_range';
    access_log {self.access_log} sent;
    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 1000000;
    client_body_temp_path {state}/tmp;
    proxy_temp_path {state}/tmp;
    fastcgi_temp_path {state}/tmp;
    uwsgi_temp_path {state}/tmp;
    scgi_temp_path {state}/tmp;
    server {{
        listen {self.origin.ip}:80;
        root {self.root};
        location / {{ }}
        # An origin that fails every data range (it still answers a file's first bytes: its index).
        location /failing/ {{
            alias {self.root}/;
            if ($http_range !~ "^bytes=0-") {{ return 503; }}
        }}
    }}
}}
"""
        )
        self._nginx = subprocess.Popen(
            [IP, "netns", "exec", self.origin.name, nginx, "-c", str(config), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        nginx_process = self._nginx

        def answers() -> bool:
            if nginx_process.poll() is not None:
                raise RuntimeError(f"nginx exited in {self.origin.name}")
            return self.access_log.exists() and self._origin_answers()

        wait_for(answers, timeout=10, what=f"nginx answering in {self.origin.name}", interval=0.05)

    def _origin_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.origin.ip}/", timeout=1):
                return True
        except OSError as exc:
            return getattr(exc, "code", None) is not None  # an HTTP error is an answer

    def url(self, name: str) -> str:
        return f"http://{self.origin.ip}/{name}"

    def origin_bytes(self) -> int:
        """Body bytes nginx sent, from its access log (every answer of status 200 or 206)."""
        total = 0
        for line in self.access_log.read_text().splitlines():
            status, sent, *_ = line.split(" ")
            if status in ("200", "206"):
                total += int(sent)
        return total

    def reset_log(self) -> None:
        """Start the origin's count again (nginx appends to the same open file: truncate it)."""
        with open(self.access_log, "r+b") as log:
            log.truncate(0)

    def stop_origin(self) -> None:
        if self._nginx is not None and self._nginx.poll() is None:
            self._nginx.terminate()
            self._nginx.wait(10)

    # --- sidecars ----------------------------------------------------------------------------------------

    @property
    def test_ip(self) -> str:
        """The test process's own address on the bridge (where a fake peer it runs listens)."""
        return f"{self._subnet}.254"

    def start_sidecar(
        self,
        host: Host,
        source: str,
        *,
        peers: list[Host] | None,
        extra: tuple[str, ...] = (),
        extra_peers: tuple[str, ...] = (),
        stall_timeout: int | None = None,
    ) -> Sidecar:
        """Start ``modelload sidecar`` in ``host``, with a static peer list (None: peers off) and
        ``extra_peers`` (URLs, such as a fake peer's) in it; ``stall_timeout`` instead of the topology's."""
        self._started += 1
        folder = self.work / host.name / str(self._started)
        folder.mkdir(parents=True)
        segment = folder / "model.seg"
        args = [
            IP, "netns", "exec", host.name, MODELLOAD, "sidecar", "--source", source,
            "--segment", str(segment), "--notify", "none", "--readers", "8", "--chunk-size", "1MiB",
            "--host", host.ip, *extra,
        ]  # fmt: skip
        if peers is not None:
            urls = ",".join([*(f"http://{p.ip}:{PEER_PORT}" for p in peers if p is not host), *extra_peers])
            args += [
                "--peers",
                urls or f"http://{host.ip}:{PEER_PORT}",
                "--peer-token-file",
                str(self.token_file),
                "--peer-stall-timeout",
                str(stall_timeout or self.stall_timeout),
            ]

        log = folder / "sidecar.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        sidecar = Sidecar(host, segment, process, log, time.monotonic())
        self.sidecars.append(sidecar)
        return sidecar

    def wait_complete(self, sidecars: list[Sidecar], *, timeout: float) -> float:
        """Wait until every sidecar's segment is COMPLETE; the monotonic time when the last one was."""
        pending = list(sidecars)

        def all_complete() -> bool:
            pending[:] = [s for s in pending if not s.complete()]
            for s in pending:
                if s.process.poll() is not None:
                    raise AssertionError(f"{s.host.name}'s sidecar exited: {s.log.read_text()[-3000:]}")
            return not pending

        try:
            wait_for(all_complete, timeout=timeout, what=f"{len(sidecars)} sidecars complete", interval=0.05)
        except AssertionError as exc:
            logs = "\n".join(s.log.read_text()[-1500:] for s in pending)
            raise AssertionError(f"{exc}; {len(pending)} not complete:\n{logs}") from None
        return time.monotonic()

    def stop_sidecars(self) -> None:
        """Stop every sidecar (all signalled first, then waited for) and delete its segment (/dev/shm)."""
        for sidecar in self.sidecars:
            if sidecar.process.poll() is None:
                sidecar.process.send_signal(signal.SIGCONT)
                sidecar.process.terminate()
        for sidecar in self.sidecars:
            sidecar.stop()
            sidecar.segment.unlink(missing_ok=True)
        self.sidecars.clear()

    def close(self) -> None:
        self.stop_sidecars()
        self.stop_origin()
        for host in self.hosts:
            _run(IP, "netns", "del", host.name, check=False)
        self.hosts.clear()
        _run(IP, "link", "del", f"ml{self.tag}h254", check=False)
        _run(IP, "netns", "del", self.switch, check=False)
