"""Fresh interpreters a test module starts together, each read by the test that checks it.

A check that needs a fresh interpreter (what an import loads, what happens at interpreter exit) spends seconds of
one core importing torch before it checks anything. Such checks do not depend on each other and the suite runs on
2 cores, so a module starts all of its interpreters at once (a module-scoped fixture around `started_together`)
and each test waits for its own: the module takes about as long as its slowest interpreter, not their sum.
"""

from __future__ import annotations

import subprocess
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar


Key = TypeVar("Key", bound=Hashable)


class Started:
    """One interpreter started with its output captured; `finished` waits for it once."""

    def __init__(self, argv: list[str], **popen: Any) -> None:
        self.argv = argv
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        self._done: subprocess.CompletedProcess | None = None

    def finished(self, timeout: float = 300) -> subprocess.CompletedProcess:
        if self._done is None:
            stdout, stderr = self.process.communicate(timeout=timeout)
            self._done = subprocess.CompletedProcess(self.argv, self.process.returncode, stdout, stderr)
        return self._done

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


@contextmanager
def started_together(
    commands: dict[Key, list[str]], own: dict[Key, dict[str, Any]] | None = None, **popen: Any
) -> Iterator[dict[Key, Started]]:
    """Starts every command at once with the Popen keywords `popen` (cwd, env), updated by `own[key]` for the
    command `key`; stops those still running at the end."""
    started: dict[Key, Started] = {}
    try:
        for key, argv in commands.items():
            started[key] = Started(argv, **{**popen, **(own or {}).get(key, {})})
        yield started
    finally:
        for one in started.values():
            one.stop()
