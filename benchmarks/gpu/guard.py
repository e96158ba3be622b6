"""Each case of the GPU benchmark under a time limit of its own, and the whole run under its budget.

The first GPU run showed why: one case that hung (a ring too small for the model it was to hold whole,
waited on for 600 s) cost every figure after it, and the run left an empty log because the step's time limit
killed it before it printed anything. Here a case that runs past its limit becomes a JSON line saying so,
with where every thread of the process was, and the run goes on with the next case; each case prints a
progress line when it starts and ends; a case the budget has no room for is skipped with a line saying so.

The limit is a ``SIGALRM`` raising :class:`CaseTimeout` in the main thread: it interrupts Python-level waits
(polling a segment, a subprocess, a sleep). A main thread stuck inside one C call is interrupted only when
the call returns; ``faulthandler`` then writes every thread's stack to standard error (the check's
``bench.log``) a little after the limit, whatever the main thread is doing. Standard library only.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CaseTimeout", "Guard", "deadline", "thread_stacks"]


class CaseTimeout(BaseException):
    """A case ran past its limit. A BaseException, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, label: str, seconds: float, stacks: str) -> None:
        super().__init__(f"{label}: still running after {seconds:.0f} s")
        self.stacks = stacks


def thread_stacks() -> str:
    """Every thread's stack, the main thread's first, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != threading.main_thread().ident)
    parts = []
    for ident, frame in frames:
        parts.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


@contextmanager
def deadline(seconds: float, *, label: str) -> Iterator[None]:
    """Raise :class:`CaseTimeout` in the main thread once ``seconds`` pass inside the block."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout(label, seconds, thread_stacks())

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    faulthandler.dump_traceback_later(seconds + 20, exit=False)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


@dataclass
class Guard:
    """Runs cases in order within ``budget`` seconds from ``started``, each within ``case_limit``."""

    emit: Callable[[dict[str, Any]], None]
    started: float
    budget: float
    case_limit: float
    after_timeout: Callable[[], None] = lambda: None
    """What to clean up after a case was cut short (the processes it started)."""
    stall: str | None = None
    """A case made to hang, for the test of this guard."""
    outcomes: dict[str, str] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def run(self, label: str, case: Callable[[], None], *, needs: float = 5.0) -> str:
        """Run ``case`` unless fewer than ``needs`` seconds of the budget are left. Returns ``ok``,
        ``timeout``, ``error`` or ``skipped``; every outcome but ``ok`` is also a JSON line."""
        left = self.left()
        if left < needs:
            return self._outcome(label, "skipped", {"reason": f"{max(left, 0):.0f} s of the budget left"})
        limit = min(self.case_limit, left)
        self._say(f"{label}: started (limit {limit:.0f} s)")
        began = time.monotonic()
        try:
            with deadline(limit, label=label):
                if self.stall == label:
                    time.sleep(24 * 3600)
                case()
        except CaseTimeout as exc:
            self.after_timeout()
            return self._outcome(label, "timeout", {"limit_s": limit, "traceback": exc.stacks})
        except Exception as exc:
            return self._outcome(
                label, "error", {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            )
        self._say(f"{label}: done in {time.monotonic() - began:.1f} s")
        self.outcomes[label] = "ok"
        return "ok"

    def _outcome(self, label: str, status: str, extra: dict[str, Any]) -> str:
        self.outcomes[label] = status
        self.emit({"section": "case", "case": label, "status": status, **extra})
        detail = (
            extra.get("reason")
            or extra.get("error")
            or f"cut at its limit of {extra.get('limit_s', 0):.0f} s"
        )
        self._say(f"{label}: {status.upper()} ({detail})")
        return status

    def _say(self, line: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {line}", flush=True)
