"""Waiting through pyzmq notifications: a real PUB socket over ipc:// wakes the waiter, and a missed or
missing message still ends with the right answer because the segment's state table is the truth."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import torch
import zmq

from modelload.loader import attach
from modelload.loader._api.notify import connect
from modelload.loader.dtypes import by_name
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout
from tests.support.subscriptions import until_heard


def _writer(path: Path, count: int, endpoint: str) -> SegmentWriter:
    specs = [TensorSpec(f"t{i}", by_name("float32"), (16,)) for i in range(count)]
    return SegmentWriter.create(path, plan_layout(specs, metadata={"notify": endpoint}))


def test_a_published_ready_event_wakes_the_waiting_model(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/notify.sock"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(endpoint)
    writer = _writer(shm_dir / "model.seg", 3, endpoint)
    model = attach(shm_dir / "model.seg", timeout=10)  # the endpoint comes from the segment's metadata
    assert model._subscriber is not None and model._subscriber.endpoint == endpoint
    until_heard(lambda: publisher.send_multipart([b"probe", b""]), model._subscriber.wait)

    def produce() -> None:
        for i in range(3):
            time.sleep(0.02)
            writer.slot(i)[:] = torch.full((16,), float(i)).numpy().tobytes()
            writer.mark_ready(i)
            publisher.send_multipart([b"ready", struct.pack("<I", i)])
        writer.mark_complete()
        publisher.send_multipart([b"done", b""])

    thread = threading.Thread(target=produce)
    thread.start()
    state = model.state_dict()
    thread.join()
    assert [t[0].item() for t in state.values()] == [0.0, 1.0, 2.0]
    model.close()
    writer.close()
    publisher.close(linger=0)


def test_a_silent_publisher_still_ends_with_every_tensor(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/quiet.sock"  # nobody binds it: every wait runs out and the table is read
    writer = _writer(shm_dir / "model.seg", 2, endpoint)
    model = attach(shm_dir / "model.seg", timeout=10)
    threading.Timer(0.1, lambda: [writer.mark_ready(i) for i in range(2)]).start()
    model.wait()
    assert model.progress().tensors_ready == 2
    model.close()
    writer.close()


def test_the_subscriber_drains_bursts_and_returns_after_its_timeout(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/burst.sock"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(endpoint)
    subscriber = connect(endpoint)
    assert subscriber is not None
    until_heard(lambda: publisher.send_multipart([b"probe", b""]), subscriber.wait)
    for i in range(1000):
        publisher.send_multipart([b"ready", struct.pack("<I", i)])
    wakes = 0
    while subscriber.wait(0.2):  # each wake drains every message already queued
        wakes += 1
        assert wakes < 20, "the subscriber woke once per message instead of draining the burst"
    assert wakes >= 1  # and once the burst is drained, a wait runs out its timeout (False)
    subscriber.close()
    publisher.close(linger=0)
