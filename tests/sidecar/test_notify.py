"""Ready notifications: the contract's frames on a real pyzmq PUB socket, received by the loader's own
subscriber in this process, in another process, and as another user; sends that never wait."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from modelload.loader._api.notify import connect
from modelload.loader.errors import ConfigError
from modelload.sidecar.notify import MAX_REASON_BYTES, Notifier
from tests.support.subscriptions import PROBE, heard_on, receive, until_heard
from tests.support.waiting import wait_for

NOBODY = 65534


def subscribe(endpoint: str) -> Any:
    sub: Any = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def probe(notifier: Notifier) -> Callable[[], None]:
    return lambda: notifier.tensor_ready(index=PROBE, name="probe", nbytes=0)


def publish_until_heard(notifier: Notifier, sub: Any) -> None:
    """PUB drops what is sent before a subscription lands: send probes until one arrives, then drain."""
    until_heard(probe(notifier), heard_on(sub))


def test_each_event_is_published_as_the_contracts_frames(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/notify.sock"
    with Notifier(endpoint) as notifier:
        sub = subscribe(endpoint)
        publish_until_heard(notifier, sub)
        notifier.tensor_ready(index=7, name="layer7.weight", nbytes=4096)
        notifier.tensor_ready(index=0x01020304, name="big", nbytes=1)
        notifier.load_finished(seconds=1.0, nbytes=4097)
        notifier.load_failed(kind="hash_mismatch", reason="tensor é: hash mismatch")
        received = receive(sub, 4)
        sub.close(linger=0)
    assert received == [
        [b"ready", b"\x07\x00\x00\x00"],
        [b"ready", b"\x04\x03\x02\x01"],
        [b"done", b""],
        [b"failed", "tensor é: hash mismatch".encode()],
    ]


def test_a_long_failure_reason_is_cut_on_a_character_boundary(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/notify.sock"
    with Notifier(endpoint) as notifier:
        sub = subscribe(endpoint)
        publish_until_heard(notifier, sub)
        notifier.load_failed(kind="format", reason="é" * MAX_REASON_BYTES)
        topic, reason = receive(sub, 1)[0]
        sub.close(linger=0)
    assert topic == b"failed"
    assert len(reason) == MAX_REASON_BYTES  # 2048 two-byte characters fit exactly
    assert reason.decode() == "é" * (MAX_REASON_BYTES // 2)


def test_the_loaders_subscriber_wakes_on_a_ready_message(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/notify.sock"
    with Notifier(endpoint) as notifier:
        subscriber = connect(endpoint)
        assert subscriber is not None
        until_heard(probe(notifier), subscriber.wait)
        threading.Timer(0.1, lambda: notifier.tensor_ready(index=3, name="t3", nbytes=16)).start()
        assert subscriber.wait(10.0), "a message wakes the subscriber before its timeout"
        subscriber.close()


CHILD = """
import json, sys, time, zmq
from modelload.loader._api.notify import connect

endpoint, PROBE = sys.argv[1], bytes.fromhex(sys.argv[2])
subscriber = connect(endpoint)                      # the loader's own subscriber
raw = zmq.Context.instance().socket(zmq.SUB)        # and a raw one, to see the frames
raw.setsockopt(zmq.SUBSCRIBE, b"")
raw.setsockopt(zmq.RCVTIMEO, 10000)
raw.connect(endpoint)
print("subscribed", flush=True)
raw_heard = sub_heard = False
while not (raw_heard and sub_heard):                # the parent probes until both subscriptions hear
    if not raw_heard and raw.poll(50):
        raw_heard = bool(raw.recv_multipart())
    sub_heard = sub_heard or subscriber.wait(0.05)
print("heard", flush=True)
started = time.monotonic()
subscriber.wait(20.0)
woke = time.monotonic() - started
frames = []
while True:
    topic, payload = raw.recv_multipart()
    if payload == PROBE:
        continue
    frames.append([topic.decode(), payload.hex()])
    if topic in (b"done", b"failed"):
        break
print(json.dumps({"woke_after": woke, "frames": frames}), flush=True)
"""


def test_a_subscriber_in_another_process_receives_every_message(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/notify.sock"
    with Notifier(endpoint) as notifier:
        argv = [sys.executable, "-c", CHILD, endpoint, PROBE.to_bytes(4, "little").hex()]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            out = child.stdout
            assert out is not None
            assert out.readline().strip() == "subscribed"

            def child_heard(seconds: float) -> bool:
                return bool(select.select([out], [], [], seconds)[0]) and out.readline().strip() == "heard"

            until_heard(probe(notifier), child_heard)  # both subscriptions reach the publisher
            for i in range(3):
                notifier.tensor_ready(index=i, name=f"t{i}", nbytes=16)
            notifier.load_finished(seconds=0.1, nbytes=48)
            result = json.loads(child.stdout.readline())
        finally:
            child.wait(10)
    assert result["woke_after"] < 10.0
    assert result["frames"] == [
        ["ready", struct.pack("<I", 0).hex()],
        ["ready", struct.pack("<I", 1).hex()],
        ["ready", struct.pack("<I", 2).hex()],
        ["done", ""],
    ]


def _subscribe_as_nobody(endpoint: str, path: str, results: Any) -> None:
    """Runs in a forked child: drop to another uid, as an app container running as another user."""
    try:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)  # needs write permission on the socket file
            connected = True
        except PermissionError:
            connected = False
        finally:
            probe.close()
        subscriber = connect(endpoint)
        assert subscriber is not None
        raw: Any = zmq.Context.instance().socket(zmq.SUB)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.setsockopt(zmq.RCVTIMEO, 5000)
        raw.connect(endpoint)
        results.put(("subscribed", connected))
        results.put(("message", raw.recv_multipart()))
    except Exception as exc:
        results.put(("error", repr(exc)))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_user_in_the_pod_can_subscribe(shm_dir: Path) -> None:
    shm_dir.chmod(0o777)  # the emptyDir's own mode
    endpoint = f"ipc://{shm_dir}/notify.sock"
    with Notifier(endpoint) as notifier:
        mode = stat.S_IMODE((shm_dir / "notify.sock").stat().st_mode)
        assert mode == 0o666
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        child = context.Process(
            target=_subscribe_as_nobody, args=(endpoint, str(shm_dir / "notify.sock"), results)
        )
        child.start()
        try:
            kind, connected = results.get(timeout=10)
            assert (kind, connected) == ("subscribed", True)

            def heard() -> Any:
                notifier.load_finished(seconds=0.1, nbytes=1)
                with contextlib.suppress(queue.Empty):
                    return results.get(timeout=0.1)
                return None

            message = wait_for(heard, timeout=5, what="a message at the other user's subscriber", interval=0)
            assert message == ("message", [b"done", b""])
        finally:
            child.join(10)


def test_the_socket_file_is_open_to_the_pod_and_removed_on_close(shm_dir: Path) -> None:
    path = shm_dir / "notify.sock"
    notifier = Notifier(f"ipc://{path}")
    info = path.stat()
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o666
    notifier.close()
    assert not path.exists()
    notifier.close()  # idempotent
    notifier.tensor_ready(index=0, name="t", nbytes=1)  # after close: ignored, no error


def test_a_stale_socket_file_of_a_previous_sidecar_is_replaced(shm_dir: Path) -> None:
    path = shm_dir / "notify.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays behind, as after a crash; the emptyDir outlives the container
    with Notifier(f"ipc://{path}") as notifier:
        sub = subscribe(f"ipc://{path}")
        publish_until_heard(notifier, sub)
        notifier.load_finished(seconds=1, nbytes=1)
        assert receive(sub, 1) == [[b"done", b""]]
        sub.close(linger=0)


def test_closing_leaves_a_newer_sidecars_socket_in_place(shm_dir: Path) -> None:
    path = shm_dir / "notify.sock"
    old = Notifier(f"ipc://{path}")
    path.unlink()  # a newer sidecar replaced the file while the old one was still shutting down
    newer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    newer.bind(str(path))
    old.close()
    assert path.exists()
    newer.close()


def test_messages_from_many_reader_threads_all_arrive(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/notify.sock"
    with Notifier(endpoint) as notifier:
        sub = subscribe(endpoint)
        publish_until_heard(notifier, sub)

        def reader(first: int) -> None:
            for i in range(first, first + 500):
                notifier.tensor_ready(index=i, name=f"t{i}", nbytes=1)

        threads = [threading.Thread(target=reader, args=(k * 500,)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        indices = sorted(struct.unpack("<I", frames[1])[0] for frames in receive(sub, 4000))
        sub.close(linger=0)
    assert indices == list(range(4000))


def test_sends_never_wait_for_a_subscriber_that_does_not_read(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/notify.sock"
    with Notifier(endpoint, send_hwm=10) as notifier:
        sub = subscribe(endpoint)
        publish_until_heard(notifier, sub)
        # Far past every queue on the way: the surplus is dropped. A send that waited for the subscriber
        # would hang here until the test's timeout.
        for i in range(100_000):
            notifier.tensor_ready(index=i, name="t", nbytes=1)
        sub.close(linger=0)


def test_an_endpoint_that_cannot_be_bound_is_a_config_error_naming_it(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/missing/notify.sock"
    with pytest.raises(ConfigError, match=r"cannot publish notifications on ipc://.*missing/notify.sock"):
        Notifier(endpoint)


def test_a_tcp_endpoint_works_too() -> None:
    with Notifier("tcp://127.0.0.1:*") as notifier:
        endpoint = notifier._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        sub = subscribe(endpoint)
        publish_until_heard(notifier, sub)
        notifier.tensor_ready(index=1, name="t", nbytes=1)
        assert sub.recv_multipart() == [b"ready", b"\x01\x00\x00\x00"]
        sub.close(linger=0)
