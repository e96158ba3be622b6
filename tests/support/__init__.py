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
"""
