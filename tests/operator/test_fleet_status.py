"""``status.fleet``: the operator sums the serving pods' peer stats, read from their real sidecars.

Real ``modelload sidecar`` processes serve ``/peer/v1/stats`` on loopback ports with the token from the
Secret the operator made; the pods (in KMock, moved by a stand-in kubelet) carry ``podIP: 127.0.0.1`` and
their sidecar's ``MODELLOAD_PEER_PORT``. Besides them: a sidecar holding another token (401), a port where
nothing listens, and one that accepts and never answers. None of them may disturb the figures of the others,
the ModelLoad's phase, or leak the token.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelload.operator.pods import classify
from tests.operator.conftest import (
    MODELLOADS,
    NAMESPACE,
    create_modelload,
    current,
    handled,
    model_bytes,
    posted_events,
    request_bodies,
    resolved,
    wait_for,
)
from tests.operator.test_pod_status import Kubelet, injected_pod, sidecar_status
from tests.support.peer_client import peer_stats
from tests.support.ports import free_port

pytestmark = [pytest.mark.usefixtures("no_aws_env"), pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
RUNNING = {"state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, "ready": True}


@dataclasses.dataclass
class RealSidecar:
    process: subprocess.Popen[bytes]
    api_port: int
    peer_port: int
    log: Path

    def stats(self, token: str) -> dict[str, Any]:
        return peer_stats(f"http://127.0.0.1:{self.peer_port}", token)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/readyz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False


class Sidecars:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.running: list[RealSidecar] = []

    def start(self, source: str, *, token_file: Path, peers: list[int] | None = None) -> RealSidecar:
        api_port, peer_port = free_port(), free_port()
        n = len(self.running)
        urls = ",".join(f"http://127.0.0.1:{p}" for p in peers or [peer_port])
        argv = [
            sys.executable, "-m", "modelload.loader.cli.main", "sidecar", "--source", source,
            "--segment", str(self.folder / f"s{n}.seg"), "--notify", "none", "--host", "127.0.0.1",
            "--port", str(api_port), "--peers", urls, "--peer-port", str(peer_port),
            "--peer-token-file", str(token_file), "--chunk-size", "1MiB",
        ]  # fmt: skip
        log = self.folder / f"s{n}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        sidecar = RealSidecar(process, api_port, peer_port, log)
        self.running.append(sidecar)
        return sidecar

    async def ready(self, sidecar: RealSidecar) -> None:
        async def loaded() -> bool:
            if sidecar.process.poll() is not None:
                raise AssertionError(f"the sidecar exited: {sidecar.log.read_text()[-2000:]}")
            return await asyncio.to_thread(sidecar.ready)

        try:
            await wait_for(loaded, timeout=60, what="the sidecar loaded")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {sidecar.log.read_text()[-2000:]}") from None

    def stop(self) -> None:
        for sidecar in self.running:
            if sidecar.process.poll() is None:
                sidecar.process.send_signal(signal.SIGTERM)
        for sidecar in self.running:
            try:
                sidecar.process.wait(20)
            except subprocess.TimeoutExpired:
                sidecar.process.kill()
                sidecar.process.wait(5)


@pytest.fixture
def sidecars(shm_dir: Path) -> Iterator[Sidecars]:
    fleet = Sidecars(shm_dir)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield int(sock.getsockname()[1])


@pytest.fixture
async def operator(start_operator: Any) -> Any:
    """The operator, reading fleets every 0.3 s."""
    return await start_operator(fleet_interval=0.3)


def fleet_status(kube: Any, name: str = "tiny") -> dict[str, Any]:
    obj = current(kube, MODELLOADS, NAMESPACE, name) or {}
    return dict((obj.get("status") or {}).get("fleet") or {})


async def fleet_becomes(kube: Any, expected: dict[str, Any]) -> dict[str, Any]:
    def matches() -> dict[str, Any] | None:
        now = fleet_status(kube)
        return now if now and all(now.get(k) == v for k, v in expected.items()) else None

    try:
        return await wait_for(matches, timeout=20, what=f"status.fleet to include {expected}")
    except AssertionError:
        raise AssertionError(f"status.fleet is {fleet_status(kube)}, expected {expected}") from None


def peered_pod(name: str, port: int) -> dict[str, Any]:
    pod = injected_pod(name)
    pod["spec"]["initContainers"][0]["env"] = [
        {"name": "MODELLOAD_PEER_DNS", "value": "tiny-peers.serving.svc"},
        {"name": "MODELLOAD_PEER_PORT", "value": str(port)},
    ]
    return pod


async def test_the_status_sums_the_serving_pods_peer_stats_and_keeps_the_token_out_of_everything(
    kube: Any,
    operator: Any,
    api: Any,
    nginx: Any,
    tmp_path: Path,
    sidecars: Sidecars,
    silent_port: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    model = tmp_path / "model.safetensors"
    model.write_bytes(model_bytes(tensors=8, rows=8192))  # 4 MiB in 8 tensors
    url = nginx.put("fleet/model.safetensors", model.read_bytes())  # the operator reads it over HTTP
    await create_modelload(api, "tiny", {"source": url, "peers": True})
    await resolved(kube, "tiny")
    secret = await wait_for(lambda: current(kube, "v1/secrets", NAMESPACE, "tiny-peers"), what="the Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    token_file, other_token = tmp_path / "token", tmp_path / "other-token"
    token_file.write_text(token + "\n")
    other_token.write_text("a-token-of-another-modelload-0123456789\n")

    source = f"file://{model}"
    first = sidecars.start(source, token_file=token_file)
    stranger = sidecars.start(source, token_file=other_token)  # its pod refuses the operator's token
    await sidecars.ready(first)
    second = sidecars.start(source, token_file=token_file, peers=[first.peer_port])
    await sidecars.ready(second)
    await sidecars.ready(stranger)

    kubelet = Kubelet(api)
    pods = {
        "first": first.peer_port,
        "second": second.peer_port,
        "stranger": stranger.peer_port,
        "gone": free_port(),  # nothing listens
        "silent": silent_port,  # accepts, never answers
    }
    for name, port in pods.items():
        await kubelet.create(peered_pod(name, port))
        await kubelet.status(name, {"phase": "Running", "podIP": "127.0.0.1", **sidecar_status(**RUNNING)})

    fleet = await fleet_becomes(kube, {"pods": 5, "reporting": 2})
    one, two = first.stats(token), second.stats(token)
    assert two["peer_bytes"] >= 4 << 20, two  # the second sidecar took the model from the first
    assert fleet["originBytes"] == one["origin_bytes"] + two["origin_bytes"] >= 4 << 20
    assert fleet["peerBytes"] == one["peer_bytes"] + two["peer_bytes"]
    assert fleet["servedBytes"] == one["uploaded_bytes"] == two["peer_bytes"]
    assert fleet["mismatches"] == 0
    assert fleet["updated"]

    # The figure is the live fleet's: a pod that left stops counting.
    await kubelet.delete("second")
    fleet = await fleet_becomes(kube, {"pods": 4, "reporting": 1, "peerBytes": one["peer_bytes"]})
    assert fleet["originBytes"] == one["origin_bytes"]

    # No token to ask with (the Secret is gone): every pod is counted, none reports, nothing breaks.
    core = __import__("kubernetes").client.CoreV1Api(api)
    await asyncio.to_thread(core.delete_namespaced_secret, "tiny-peers", NAMESPACE, _preload_content=False)
    await fleet_becomes(kube, {"pods": 4, "reporting": 0, "originBytes": 0})

    obj = current(kube, MODELLOADS, NAMESPACE, "tiny") or {}
    assert obj["status"]["phase"] == "Ready"  # silent pods are not the ModelLoad's failure
    events = posted_events(kube)
    assert not [e for e in events if "peer" in json.dumps(e).lower()], events
    logs = caplog.text
    assert "stranger: refused the peer token (HTTP 401)" in logs
    assert "silent: no answer in 2 s" in logs
    assert "gone: unreachable" in logs
    assert "cannot read the peer token of ModelLoad serving/tiny" in logs
    for where, text in (("status", json.dumps(obj)), ("API requests", request_bodies(kube)), ("logs", logs)):
        assert token not in text, f"the peer token is in the {where}"
    with contextlib.suppress(FileNotFoundError):
        for sidecar in sidecars.running:
            assert token not in sidecar.log.read_text()


async def test_a_model_without_peers_gets_no_fleet_figures_and_no_connection(
    kube: Any,
    operator: Any,
    api: Any,
    nginx: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from modelload.operator.fleet import FleetPoller

    caplog.set_level(logging.INFO, logger="kopf")
    polls: list[float] = []
    poll = FleetPoller.poll

    async def counted(self: FleetPoller, *args: Any) -> None:
        await poll(self, *args)
        polls.append(asyncio.get_running_loop().time())

    monkeypatch.setattr(FleetPoller, "poll", counted)
    url = nginx.put("fleet/plain.safetensors", model_bytes())
    await create_modelload(api, "tiny", {"source": url})
    await resolved(kube, "tiny")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = int(listener.getsockname()[1])
        kubelet = Kubelet(api)
        pod = peered_pod("p1", port)  # even a sidecar wired for peers: the ModelLoad says no
        await kubelet.create(pod)
        await wait_for(lambda: handled(caplog, "pod_changed", "p1"), what="the new pod handled")
        await kubelet.status("p1", {"phase": "Running", "podIP": "127.0.0.1", **sidecar_status(**RUNNING)})
        await wait_for(lambda: handled(caplog, "pod_changed", "p1") >= 2, what="the serving pod handled")
        seen = len(polls)
        await wait_for(lambda: len(polls) >= seen + 3, what="three fleet polls since the pod serves")
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert fleet_status(kube) == {}


def test_a_peered_pods_address_is_its_ip_and_its_sidecars_peer_port() -> None:
    pod = peered_pod("p1", 9000)
    pod["status"] = {"phase": "Running", "podIP": "10.1.2.3", **sidecar_status(**RUNNING)}
    load = classify(pod)
    assert load is not None and load.serving and (load.pod, load.address) == ("p1", "10.1.2.3:9000")
    pod["status"]["podIP"] = "fd00::7"
    pod["spec"]["initContainers"][0]["env"].pop()  # no port set: the default one
    assert (load := classify(pod)) is not None and load.address == "[fd00::7]:8480"
    del pod["status"]["podIP"]
    assert (load := classify(pod)) is not None and load.address is None
    plain = injected_pod("p2")
    plain["status"] = {"phase": "Running", "podIP": "10.1.2.4", **sidecar_status(**RUNNING)}
    assert (load := classify(plain)) is not None and load.address is None and not load.serving


async def test_of_two_modelloads_of_one_label_the_one_that_answers_pods_is_polled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pods of a label shared by two ModelLoads are the oldest one's (the webhook's rule): its fleet is
    read, where a shared label used to be skipped as ambiguous."""
    from modelload.operator.fleet import FleetPoller

    asked: list[str] = []

    async def one(self: FleetPoller, session: Any, selector: Any, name: str, pods: list[Any]) -> None:
        asked.append(name)

    monkeypatch.setattr(FleetPoller, "_one", one)
    older = ("first", 1 << 20, True, [], ("2026-01-01T00:00:00Z", "first"), 1)
    newer = ("second", 1 << 20, False, [], ("2026-02-01T00:00:00Z", "second"), 1)
    poller = FleetPoller(kube=None, interval=60)  # type: ignore[arg-type]
    await poller.poll({("ns", "llama"): [newer, older]}, {})
    assert asked == ["first"]
    asked.clear()
    oldest = ("second", None, True, [], ("2025-12-01T00:00:00Z", "second"), 1)
    await poller.poll({("ns", "llama"): [oldest, older]}, {})
    assert asked == ["second"], "the older of the two answers, peered or not"
    asked.clear()
    unpeered = ("first", None, False, [], ("2026-01-01T00:00:00Z", "first"), 1)
    await poller.poll({("ns", "llama"): [newer, unpeered]}, {})
    assert asked == [], "the answering ModelLoad has no peers: nothing to read"
