"""Load attempts: after a transient failure that outlasted one attempt's retries, the whole load again.

Inside one attempt every request (the look-up, the index read, every range) is retried by the sources
layer's :class:`~modelload.sidecar.sources.RetryPolicy`: a few tries without progress, 600 s at most for a
range. A store that stays unreachable longer (an outage, a throttled bucket, a proxy down for maintenance)
fails the attempt with a *transient* error (``ModelloadError.transient``: the same load may well succeed
later, unchanged). The sidecar then starts the whole load again after a delay that doubles from
:attr:`AttemptPolicy.first_delay` up to :attr:`AttemptPolicy.max_delay`, with jitter, for as long as the
failures stay transient; it says so in ``/status`` (``phase: retrying``, the reason, the attempt and when the
next one starts), in the metrics (``modelload_phase``, ``modelload_load_attempts_total``) and in its log.

A permanent failure (not found, access denied, a wrong or missing key, a corrupt file, a full volume) is
not retried: the sidecar stays up, failed, with the reason, until the pod is replaced (docs/sidecar.md,
"How a load ends").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["AttemptPolicy"]


@dataclass(frozen=True)
class AttemptPolicy:
    """When the sidecar starts a load again after a transient failure.

    ``first_delay``: seconds before the second attempt. Default 5 s. ``max_delay``: the cap of the doubling
    delay. Default 300 s: an outage of hours costs one attempt (a look-up) every five minutes. ``jitter``:
    the fraction of each delay that is randomised, so the pods of a Deployment that failed together do not
    come back together.
    """

    first_delay: float = 5.0
    max_delay: float = 300.0
    jitter: float = 0.2

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failed attempts (1 for the first)."""
        base = min(self.max_delay, self.first_delay * 2.0 ** min(max(failures - 1, 0), 30))
        return base * (1.0 - self.jitter * random.random())
