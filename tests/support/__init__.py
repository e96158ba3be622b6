"""Shared test servers on loopback, for every area's integration tests.

- ``nginx``: a real nginx serving a folder with Range, ETag and If-Match, a path-style S3 stand-in, and a
  port that ignores Range (:mod:`tests.support.nginx`).
- ``moto_s3``: moto's S3 server in a child process, with helpers for buckets, public objects, bucket
  policies and enforced IAM authentication (:mod:`tests.support.moto_s3`).
- ``fault_proxy``: a scriptable proxy that resets, truncates, stalls, throttles, ignores Range or changes
  ETags per request, and records every request (:mod:`tests.support.fault_proxy`).
- ``processes``: stopping a child process, gracefully then by force (:mod:`tests.support.processes`).
- ``fixtures``: the pytest fixtures over these (:mod:`tests.support.fixtures`): import them into your
  area's conftest.py.

And what tests do with them:

- ``waiting``: :func:`~tests.support.waiting.wait_for` (and ``wait_for_async``), the one way a test waits:
  on something observable, with a deadline, never a sleep before an assert.
- ``sidecars``: the ``sidecars`` fixture (sidecars in this process, stopped after the test),
  ``wait_for_phase``, and ``BackgroundLoad`` (the engine loading in a thread).
- ``subscriptions``: probing a pyzmq subscription until it reaches its publisher.
- ``clock``: ``FakeClock``, for the components that take ``clock=``.
- ``tmpfs``: small tmpfs volumes of their own (root needed; fails under ``make test`` without it).
"""
