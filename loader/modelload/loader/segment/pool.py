"""The threads that fill a segment: work items handed out in order, the first failure stops them all.

The sidecar's engine (its items are range chunks of remote files) and ``modelload stage`` (its items are the
tensors of local files) fill a segment the same way: N threads take the next item, land its bytes, and the
thread that completes a tensor finishes it (:class:`~modelload.loader.segment.TensorFinisher`). What differs
is only how an item's bytes arrive, which the caller's ``work`` function says.

Items are taken in order (item ``i`` starts before item ``i + 1``), so the tensors a load puts first are
ready first. The first exception sets ``stop``, so the other threads end after their current item, and is
raised in the calling thread once every thread has returned: a segment is never left with a thread still
writing into it. A caller's own ``stop`` event (SIGTERM in the sidecar) ends the work the same way, with
nothing raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["run_in_order"]


def run_in_order(
    count: int,
    work: Callable[[int], None],
    *,
    threads: int,
    stop: threading.Event | None = None,
    name: str = "filler",
) -> None:
    """Call ``work(i)`` for each ``i`` in ``range(count)``, in order, from ``threads`` threads (at most
    ``count``); raise the first exception once all have stopped.

    >>> done = []
    >>> run_in_order(5, done.append, threads=2)
    >>> sorted(done)
    [0, 1, 2, 3, 4]
    """
    stop = stop if stop is not None else threading.Event()
    lock = threading.Lock()
    taken = 0
    errors: list[BaseException] = []

    def loop() -> None:
        nonlocal taken
        try:
            while not stop.is_set():
                with lock:
                    if taken >= count:
                        return
                    item, taken = taken, taken + 1
                work(item)
        except BaseException as exc:
            with lock:
                errors.append(exc)
            stop.set()

    workers = [
        threading.Thread(target=loop, name=f"{name}-{k}", daemon=True) for k in range(min(threads, count))
    ]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join()
    except BaseException:  # an interrupt in the calling thread: stop the workers, and wait for them
        stop.set()
        for worker in workers:
            worker.join()
        raise
    if errors:
        raise errors[0]
