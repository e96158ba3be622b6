"""The keeper and the app's ``connect()``, across processes, with memfd blocks standing in for GPU memory.

Everything but the driver calls runs as in a pod: a real segment, the keeper attached to it as a consumer,
a Unix socket, descriptors passed with SCM_RIGHTS, apps in processes of their own that restart. The same
code with CUDA memory is in test_cuda_handoff.py (marked ``gpu``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from modelload.loader import attach
from modelload.loader.errors import (
    ConfigError,
    DeviceError,
    HandoffProtocolError,
    KeeperUnavailableError,
    LoadFailedError,
    ModuleMismatchError,
)
from modelload.loader.handoff import client, connect, protocol, status
from modelload.loader.handoff.keeper import Keeper, _answers
from modelload.loader.segment import MemoryMode
from modelload.loader.segment.consumers import ConsumerTable
from tests.handoff.helpers import digest, held, model_tensors, probe, publish, write_segment
from tests.handoff.memfd import MemfdMapper, MemfdMemory
from tests.support.hugepages import HUGE_PAGE, hugetlbfs, hugetlbfs_volume
from tests.support.waiting import wait_for

__all__ = ["hugetlbfs", "hugetlbfs_volume"]  # fixtures, used by name

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


@contextmanager
def keeper_of(segment: Path, socket_path: Path, *, block_size: int = MiB) -> Iterator[Keeper]:
    """A keeper serving ``segment`` on ``socket_path``, loading in a thread as ``modelload keeper`` does."""
    keeper = Keeper(MemfdMemory(), socket_path=socket_path, block_size=block_size)
    keeper.start()

    def load() -> None:
        try:
            with attach(segment, notify=False, timeout=30) as model:
                keeper.load(model)
        except Exception as exc:  # the keeper answers apps with the reason; the test reads it from there
            keeper.fail(str(exc))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        yield keeper
    finally:
        keeper.close()
        thread.join(timeout=30)


def app(socket_path: Path, *, hold: bool = False) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tests.handoff.app", str(socket_path), *(["--hold"] if hold else [])]
    return subprocess.Popen(
        argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def first_line(process: subprocess.Popen[str]) -> dict:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(timeout=30)
        raise AssertionError(process.stderr.read() if process.stderr else "the app printed nothing")
    return json.loads(line)


# --- the weights, across processes ---------------------------------------------------------------------


def test_an_app_that_restarts_maps_the_same_memory_again_without_a_copy(
    shm_dir: Path, sock_dir: Path
) -> None:
    tensors = model_tensors()
    write_segment(shm_dir / "m.seg", tensors)
    sock = sock_dir / "keeper.sock"
    with keeper_of(shm_dir / "m.seg", sock) as keeper:
        first = app(sock, hold=True)
        seen = first_line(first)
        assert seen["digests"] == {name: digest(t) for name, t in tensors.items()}
        assert seen["writable"] is False
        wait_for(lambda: status(sock)["apps"] == 1, timeout=30, what="the keeper to count the app")
        first.send_signal(signal.SIGKILL)  # an OOM kill: no goodbye
        first.wait(timeout=30)
        wait_for(lambda: status(sock)["apps"] == 0, timeout=30, what="the keeper to see the app gone")
        second = app(sock)
        again = first_line(second)
        assert second.wait(timeout=30) == 0
        assert again["digests"] == seen["digests"]
        assert again["inodes"] == seen["inodes"]  # the same memory, not a new copy
        assert keeper.progress.tensors_ready == len(tensors)  # loaded once


def test_weights_an_app_mapped_stay_valid_after_the_keeper_is_killed(shm_dir: Path, sock_dir: Path) -> None:
    tensors = model_tensors()
    write_segment(shm_dir / "m.seg", tensors)
    sock = sock_dir / "keeper.sock"
    code = (
        "import sys, threading; from modelload.loader import attach; "
        "from modelload.loader.handoff.keeper import Keeper; from tests.handoff.memfd import MemfdMemory; "
        "k = Keeper(MemfdMemory(), socket_path=sys.argv[2], block_size=1 << 20); k.start(); "
        "k.load(attach(sys.argv[1], notify=False)); print('ready', flush=True); threading.Event().wait()"
    )
    keeper = subprocess.Popen(
        [sys.executable, "-c", code, str(shm_dir / "m.seg"), str(sock)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert keeper.stdout is not None and keeper.stdout.readline().strip() == "ready"
        weights = connect(sock, timeout=30, mapper=MemfdMapper())
        views = weights.state_dict()
    finally:
        keeper.kill()
        keeper.wait(timeout=30)
    assert not _answers(sock)
    assert {name: digest(t) for name, t in views.items()} == {name: digest(t) for name, t in tensors.items()}


def test_many_blocks_travel_in_several_descriptor_messages(shm_dir: Path, sock_dir: Path) -> None:
    tensors = {f"t{i}": torch.full((40_000,), float(i)) for i in range(protocol.MAX_FDS_PER_MESSAGE + 6)}
    write_segment(shm_dir / "m.seg", tensors)
    with keeper_of(shm_dir / "m.seg", sock_dir / "k.sock", block_size=160_000) as keeper:
        with connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper()) as weights:
            for name, expected in tensors.items():
                assert torch.equal(weights.tensor(name), expected), name
        assert len(keeper.memory.blocks) == len(tensors) > protocol.MAX_FDS_PER_MESSAGE


def test_load_into_module_fills_a_meta_module_with_the_keepers_tensors_ties_kept(
    shm_dir: Path, sock_dir: Path
) -> None:
    reference = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False))
    reference[1].weight = reference[0].weight
    state = {"0.weight": reference[0].weight.detach().clone()}
    write_segment(shm_dir / "m.seg", state)
    with (
        keeper_of(shm_dir / "m.seg", sock_dir / "k.sock"),
        connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper()) as weights,
    ):
        with torch.device("meta"):
            net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False))
        net[1].weight = net[0].weight
        weights.load_into_module(net)
        assert net[1].weight is net[0].weight
        assert net[0].weight.data_ptr() == weights.tensor("0.weight").data_ptr()  # no copy
        tokens = torch.tensor([1, 5, 7])
        with torch.no_grad():
            assert torch.equal(net(tokens), reference(tokens))
        with pytest.raises(ModuleMismatchError, match="missing key"):
            weights.load_into_module(torch.nn.Linear(8, 8))


# --- while loading, and when the load fails ----------------------------------------------------------------


def test_an_app_connecting_during_the_load_is_told_the_progress_until_the_manifest(
    shm_dir: Path, sock_dir: Path
) -> None:
    tensors = model_tensors()
    writer = write_segment(shm_dir / "m.seg", tensors, ready=2)
    with keeper_of(shm_dir / "m.seg", sock_dir / "k.sock"), socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(sock_dir / "k.sock"))
        raw.settimeout(30)
        protocol.send(raw, {"op": "open", "versions": [1]})
        loading = protocol.expect(protocol.receive(raw), "loading").message
        assert loading["state"] in ("starting", "loading")
        wait_for(
            lambda: loading_count(raw) == 2, timeout=30, what="the keeper to report the two published tensors"
        )
        publish(writer, tensors, range(2, len(tensors)))
        writer.mark_complete()
        while (received := protocol.expect(protocol.receive(raw), "loading", "manifest")).op == "loading":
            pass
        manifest = protocol.Manifest.parse(received.message)
        assert [t.name for t in manifest.tensors] == list(tensors)
        assert manifest.metadata["source"] == "file:///model"


def loading_count(raw: socket.socket) -> int:
    message = protocol.expect(protocol.receive(raw), "loading").message
    return int(message["tensors_ready"])


def test_a_failed_load_reaches_the_app_with_its_reason(shm_dir: Path, sock_dir: Path) -> None:
    writer = write_segment(shm_dir / "m.seg", model_tensors(), ready=1)
    with keeper_of(shm_dir / "m.seg", sock_dir / "k.sock"):
        writer.mark_failed("the origin answered 403 Forbidden")
        with pytest.raises(LoadFailedError, match="403 Forbidden"):
            connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper())
        assert status(sock_dir / "k.sock")["state"] == "failed"


def test_an_app_waiting_when_the_keeper_stops_is_told_so(shm_dir: Path, sock_dir: Path) -> None:
    writer = write_segment(shm_dir / "m.seg", model_tensors(), ready=1)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper())
        except BaseException as exc:
            outcome.append(exc)

    with keeper_of(shm_dir / "m.seg", sock_dir / "k.sock") as keeper:
        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_for(lambda: len(keeper._connections) == 1, timeout=30, what="the app to connect")
        writer.mark_failed("the test is over")  # ends the keeper's load thread (after the stop)
    waiter.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], KeeperUnavailableError), outcome


# --- refusals and errors -----------------------------------------------------------------------------------


def test_an_app_offering_no_common_version_is_refused_with_the_keepers_versions(
    shm_dir: Path, sock_dir: Path
) -> None:
    write_segment(shm_dir / "m.seg", model_tensors())
    with keeper_of(shm_dir / "m.seg", sock_dir / "k.sock"), socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(sock_dir / "k.sock"))
        raw.settimeout(30)
        protocol.send(raw, {"op": "open", "versions": [99]})
        answer = protocol.expect(protocol.receive(raw), "error").message
        assert answer["code"] == "version" and answer["versions"] == list(protocol.VERSIONS)
        assert "[99]" in answer["message"]


def test_no_keeper_is_a_clear_error_once_the_timeout_passes(sock_dir: Path) -> None:
    with pytest.raises(KeeperUnavailableError, match=r"no keeper answered at .*k\.sock within 0\.2 s"):
        connect(sock_dir / "k.sock", timeout=0.2, mapper=MemfdMapper())


def test_a_keeper_that_goes_silent_is_reported_rather_than_waited_for(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "SILENCE_TIMEOUT", 0.3)
    with socket.socket(socket.AF_UNIX) as mute:
        mute.bind(str(sock_dir / "k.sock"))
        mute.listen()
        with pytest.raises(KeeperUnavailableError, match=r"stopped answering for 0\.3 s"):
            connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper())


MANIFEST = {
    "op": "manifest", "version": 1, "device": {"uuid": "memfd-stand-in"}, "blocks": [65536, 65536],
    "tensors": [["a", "float32", [4], 0, 0, 16], ["b", "float32", [4], 1, 0, 16]], "metadata": {},
}  # fmt: skip


@pytest.mark.parametrize(
    ("manifest", "fds", "error", "match"),
    [
        (MANIFEST | {"tensors": [["a", "float32", [4], 0, 0, 16], ["b", "float32", [4], 0, 8, 16]]},
         {"first": 0, "count": 2}, HandoffProtocolError, "overlap"),
        (MANIFEST, {"first": 5, "count": 2}, HandoffProtocolError, "announced 2 descriptors from 5"),
        (MANIFEST | {"device": {"uuid": "GPU-other"}}, {"first": 0, "count": 2}, DeviceError, "GPU-other"),
    ],
    ids=["overlapping tensors", "descriptors out of order", "another GPU"],
)  # fmt: skip
def test_a_refused_hand_off_leaves_no_descriptor_of_the_keepers_behind(
    sock_dir: Path, manifest: dict, fds: dict, error: type[Exception], match: str
) -> None:
    blocks = [probe("keeper-block") for _ in range(2)]
    for fd in blocks:
        os.ftruncate(fd, 65536)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(sock_dir / "k.sock"))
        server.listen()

        def serve() -> None:
            conn, _ = server.accept()
            with conn, contextlib.suppress(OSError):  # the app hangs up on what it refuses
                protocol.receive(conn)
                protocol.send(conn, manifest)
                protocol.send(conn, {"op": "fds", **fds}, blocks)
                protocol.receive(conn)

        thread = threading.Thread(target=serve)
        thread.start()
        with pytest.raises(error, match=match):
            connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper())
        thread.join(timeout=30)
    assert held("keeper-block") == len(blocks)  # the keeper's own two: none of those the app received
    for fd in blocks:
        os.close(fd)


def test_a_keeper_on_another_gpu_is_refused_by_the_mapper_with_the_reason(
    shm_dir: Path, sock_dir: Path
) -> None:
    class OtherGpu(MemfdMemory):
        device: ClassVar[dict[str, str]] = {"uuid": "GPU-elsewhere", "name": "not this one"}

    write_segment(shm_dir / "m.seg", model_tensors())
    keeper = Keeper(OtherGpu(), socket_path=sock_dir / "k.sock", block_size=MiB)
    keeper.start()
    try:
        with attach(shm_dir / "m.seg", notify=False) as model:
            keeper.load(model)
        with pytest.raises(DeviceError, match="GPU-elsewhere is not visible"):
            connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper())
        wait_for(
            lambda: status(sock_dir / "k.sock")["apps"] == 0,
            timeout=30,
            what="the keeper to end the refused lease",
        )
    finally:
        keeper.close()


def test_a_second_keeper_on_a_live_socket_is_refused_and_a_dead_ones_socket_replaced(
    shm_dir: Path, sock_dir: Path
) -> None:
    write_segment(shm_dir / "m.seg", model_tensors())
    sock = sock_dir / "k.sock"
    with (
        keeper_of(shm_dir / "m.seg", sock),
        pytest.raises(ConfigError, match="another keeper already answers"),
    ):
        Keeper(MemfdMemory(), socket_path=sock, block_size=MiB).start()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # bound, never listening: what a killed keeper leaves
    stale.close()
    keeper = Keeper(MemfdMemory(), socket_path=sock, block_size=MiB)
    keeper.start()
    keeper.close()


# --- memory modes -------------------------------------------------------------------------------------------


def test_in_memory_mode_release_the_keeper_consumes_every_tensor_it_copied(
    shm_dir: Path, sock_dir: Path
) -> None:
    tensors = model_tensors()
    writer = write_segment(shm_dir / "m.seg", tensors, mode=MemoryMode.RELEASE)
    with keeper_of(shm_dir / "m.seg", sock_dir / "k.sock") as keeper:
        assert keeper.wait(timeout=30) == "ready"
        table = ConsumerTable.open(
            shm_dir / "m.seg", load_id=writer.load_id, tensor_count=len(tensors), write=False
        )
        try:
            marks = [list(table.consumed_bits(e.slot)) for e in table.entries()]
        finally:
            table.close()
        assert marks == [[(1 << len(tensors)) - 1]]
        with connect(sock_dir / "k.sock", timeout=30, mapper=MemfdMapper()) as weights:
            assert all(torch.equal(weights.tensor(n), t) for n, t in tensors.items())


def test_the_keeper_stages_copies_from_4_kib_pages_and_pins_a_hugetlbfs_segment_whole(
    shm_dir: Path, sock_dir: Path, hugetlbfs: Path
) -> None:
    """As ``state_dict(device=...)``: pinning 4 KiB pages costs more than the copy (an H200 pinned 4.26 GiB
    of them at 1.3 GiB/s, and copied through staging buffers at 21 GiB/s), huge pages are pinned once."""
    tensors = model_tensors()
    for folder, pins in ((shm_dir, False), (hugetlbfs, True)):
        write_segment(folder / "m.seg", tensors, page_size=HUGE_PAGE if pins else 4096)
        with keeper_of(folder / "m.seg", sock_dir / f"k{int(pins)}.sock") as keeper:
            assert keeper.wait(timeout=30) == "ready"
            copier = keeper.memory.last_copier
            assert (copier.pin_in_place, len(copier.pinned)) == (pins, int(pins)), folder
            with connect(sock_dir / f"k{int(pins)}.sock", timeout=30, mapper=MemfdMapper()) as weights:
                assert all(torch.equal(weights.tensor(n), t) for n, t in tensors.items())


def test_a_failed_load_gives_back_the_keepers_pin_and_queued_copies(sock_dir: Path, hugetlbfs: Path) -> None:
    """The keeper goes on answering apps after a failed load: what its copier holds (the whole hugetlbfs
    segment pinned, the copies queued) must not stay with it."""
    writer = write_segment(hugetlbfs / "m.seg", model_tensors(), ready=1, page_size=HUGE_PAGE)
    with keeper_of(hugetlbfs / "m.seg", sock_dir / "k.sock") as keeper:
        wait_for(lambda: keeper.progress.tensors_ready == 1, timeout=30, what="the first tensor copied")
        writer.mark_failed("the origin answered 403 Forbidden")
        assert keeper.wait(timeout=30) == "failed"
        copier = keeper.memory.last_copier
        assert len(copier.pinned) == 1 and copier.finished
