"""Run vLLM in a child process, as a pod would run ``vllm serve``, and watch its log while it starts.

vLLM starts its engine in spawned processes; a child per engine keeps each test's vLLM (its plugins, its
environment, its failure) apart from the test process and from the other tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("_generate.py")
PROMPTS = [[1, 2, 3, 4], [17, 300, 42], [900, 5, 6, 7, 8, 9]]
MAX_TOKENS = 12


class Engine:
    """One ``LLM`` in a child process: ``lines`` is its log so far; :meth:`result` its greedy tokens."""

    def __init__(
        self,
        model: Path,
        *,
        load_format: str,
        extra: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        spec = {
            "model": str(model),
            "load_format": load_format,
            "extra": dict(extra or {}),
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
        }
        environ = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, str(RUNNER), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environ,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, pattern: str, *, timeout: float = 180.0) -> str:
        """The first log line matching ``pattern``; fails when the engine exits or the time passes first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.lines)
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"vLLM exited before logging {pattern!r}:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"vLLM logged no {pattern!r} in {timeout:g} s:\n{self.tail()}")
                self._changed.wait(min(remaining, 1.0))

    def finish(self, *, timeout: float = 240.0) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"vLLM did not finish in {timeout:g} s (a hang):\n{self.tail()}") from None
        self._reader.join(10)
        return code

    def result(self, *, timeout: float = 240.0) -> list[list[int]]:
        code = self.finish(timeout=timeout)
        found = [line for line in self.lines if line.startswith("RESULT ")]
        assert code == 0 and found, f"vLLM failed (exit {code}):\n{self.tail()}"
        tokens: list[list[int]] = json.loads(found[-1].removeprefix("RESULT "))
        return tokens

    def matching(self, pattern: str) -> list[str]:
        regex = re.compile(pattern)
        return [line for line in self.lines if regex.search(line)]

    def tail(self, count: int = 60) -> str:
        return "\n".join(self.lines[-count:])
