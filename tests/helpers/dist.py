"""Run test bodies on N gloo ranks and collect what each returns.

Starting a rank costs seconds (importing torch and transformers), so ranks are started once per world size and
kept for the pytest session: a pool of N processes runs one test body after another (as torch's own distributed
tests do with a continuous process group), and a test runs many checks inside one body and returns their results;
the assertions happen in the pytest process. What a rank runs is in tests/helpers/rank_process.py; ranks are forked
by a forkserver that imported the libraries once (tests/helpers/rank_template.py), and each freezes what imports
left out of the garbage collector's view after a body that imported something (tests/helpers/heap.py).

[Note: what a pooled rank resets between test bodies]
Each body gets a fresh default process group (a new port; the group the code under test created from the
environment is destroyed after the body), pytest's environment variables and working directory at the time of
the call (as a newly spawned rank would see them), and the sys.path, torch seed, default dtype, grad mode and
thread count the rank started with, and accelerate's and transformers'
process-wide singletons (`PartialState`/`AcceleratorState`/`GradientState`, the Trainer's DeepSpeed config
reference) cleared. Module globals a body changes are not reset: such a test passes `fresh=True` and gets ranks
of its own.

[Note: how a hang is reported]
Every call has a deadline (`timeout`, scaled by ACCELERATE_ZERO_TEST_TIMEOUT_SCALE for slow machines). When it
passes, or when one rank failed and the others have not finished, each unfinished rank is asked (SIGUSR1 ->
faulthandler) to write the Python stack of every thread, and the AssertionError lists, per rank, its traceback or
its stack: "rank 1 waited in all_gather_into_tensor called from ...". The pool is then killed and started afresh
for the next test, so one failing test does not poison the next.
"""

from __future__ import annotations

import atexit
import io
import os
import queue
import random
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.helpers.rank_process import rank_loop


DEFAULT_TIMEOUT_SECONDS = 300.0
"""Default deadline of one `run_distributed` body (an idle machine runs the slowest in ~30 s; a machine whose 2
cores are shared by several suites ran it in ~120 s): a hang is reported after it, not after the CI limit."""
TIMEOUT_SCALE_ENV = "ACCELERATE_ZERO_TEST_TIMEOUT_SCALE"
FRESH_ENV = "ACCELERATE_ZERO_TEST_FRESH_RANKS"
"""Set to 1 to start new ranks for every call (the behaviour before the pool), e.g. to bisect a leak."""
_STACK_GRACE_SECONDS = 3.0
_PEER_REPORT_GRACE_SECONDS = 5.0
_STARTUP_SECONDS = 60.0
_SPAWNS = {"processes": 0, "calls": 0, "rank_bodies": 0}
"""Ranks started, `run_distributed` calls and rank-bodies run in this session (tests/conftest.py prints them);
without the pool every rank-body started a process."""


# Below Linux's ephemeral range (32768-60999 by default): a port the kernel hands to outgoing connections can be
# taken by any process on a busy machine between our check and a rank binding it, and a body that creates its
# process group several times binds the same port again after every destroy.
_PORT_RANGE = (15000, 32000)
_PORTS = random.SystemRandom()  # not the global generator: tests seed it, and their draws must not change


def free_port() -> int:
    """A port nobody listens on now, outside the range the kernel picks for outgoing connections."""
    for _ in range(200):
        port = _PORTS.randrange(*_PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # the range is crowded: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawned_rank_count() -> int:
    """How many rank processes this pytest process has started so far."""
    return _SPAWNS["processes"]


def pool_statistics() -> dict[str, int]:
    """Rank processes started, `run_distributed` calls, and rank-bodies run (the processes a pool-less run starts)."""
    return dict(_SPAWNS)


def timeout_scale() -> float:
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "1")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={raw!r} is not a number; set it to e.g. 3 on a busy machine") from None


def scaled_seconds(seconds: float) -> str:
    """`seconds` scaled for a slow machine (ACCELERATE_ZERO_TEST_TIMEOUT_SCALE), as a process-group timeout value for
    ACCELERATE_ZERO_PG_TIMEOUT: read it before a fixture clears the ACCELERATE_ZERO_* variables."""
    return str(round(seconds * timeout_scale()))


def plain_torchrun_environment() -> None:
    """Drops accelerate's variables (ACCELERATE_*, except the process-group timeout) from this rank's environment, so
    the code under test sees what plain `torchrun` gives it."""
    for name in [n for n in os.environ if n.startswith("ACCELERATE_") and n != "ACCELERATE_ZERO_PG_TIMEOUT"]:
        del os.environ[name]


# ---- in pytest ------------------------------------------------------------------------------------------------------


@dataclass
class _Pool:
    """`world_size` rank processes, each with its own task queue and a shared result queue."""

    world_size: int
    processes: list[Any] = field(default_factory=list)
    tasks: list[Any] = field(default_factory=list)
    results: Any = None
    stack_files: list[str] = field(default_factory=list)
    calls: int = 0

    def start(self) -> None:
        ctx = mp.get_context(_start_method())
        if ctx.get_start_method() == "forkserver":
            # Ranks fork from a process that imported the libraries once (tests/helpers/rank_template.py); this
            # takes effect when the first pool starts the forkserver, which ignores an ImportError (ranks then
            # import on their own).
            ctx.set_forkserver_preload(["tests.helpers.rank_template"])
        self.results = ctx.Queue()
        folder = tempfile.mkdtemp(prefix=f"accelerate_zero_ranks{self.world_size}_")
        for rank in range(self.world_size):
            tasks = ctx.Queue()
            stack_file = str(Path(folder) / f"rank{rank}.stacks")
            process = ctx.Process(
                target=rank_loop,
                args=(rank, self.world_size, tasks, self.results, stack_file),
                name=f"accelerate_zero_rank{rank}_of_{self.world_size}",
            )
            process.start()
            _SPAWNS["processes"] += 1
            self.processes.append(process)
            self.tasks.append(tasks)
            self.stack_files.append(stack_file)

    def stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """Asks `ranks` for the stack of every thread (faulthandler on SIGUSR1) and returns what they wrote."""
        sizes = {rank: Path(self.stack_files[rank]).stat().st_size for rank in ranks}
        asked = [rank for rank in ranks if self.processes[rank].is_alive()]
        for rank in asked:
            os.kill(self.processes[rank].pid, signal.SIGUSR1)
        # faulthandler writes from the signal handler, thread by thread: done when every file grew, then held still
        deadline, last = time.monotonic() + _STACK_GRACE_SECONDS, None
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = [Path(self.stack_files[rank]).stat().st_size for rank in asked]
            if now == last and all(size > sizes[rank] for size, rank in zip(now, asked, strict=True)):
                break
            last = now
        out = {}
        for rank in ranks:
            with open(self.stack_files[rank]) as file:
                file.seek(sizes[rank])
                out[rank] = file.read() or f"(no stack: exit code {self.processes[rank].exitcode})"
        return out

    def stop(self) -> None:
        """Lets the ranks leave their loop, then kills any that did not."""
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
        self.close()

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=10)
        self.processes.clear()
        if self.stack_files:
            shutil.rmtree(Path(self.stack_files[0]).parent, ignore_errors=True)


def _start_method() -> str:
    """How ranks start: "forkserver" on a machine without CUDA devices, "spawn" where there are some (a library's
    import may ask the CUDA runtime how many devices there are, and a process forked after that cannot use CUDA)."""
    return "spawn" if torch.cuda.is_available() else "forkserver"


_POOLS: dict[int, _Pool] = {}


def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.stop()
    _POOLS.clear()


atexit.register(_close_pools)


def _pool(world_size: int, fresh: bool) -> _Pool:
    if fresh or os.environ.get(FRESH_ENV) == "1":
        pool = _Pool(world_size)
        pool.start()
        return pool
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.processes):
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
        pool.start()
    return pool


def _collect(
    pool: _Pool, call_id: tuple, deadline: float, deadline_seconds: float
) -> tuple[dict[int, tuple[str, Any]], str | None]:
    """Waits for every rank's answer to `call_id`; returns them by rank and what went wrong, if anything."""
    received: dict[int, tuple[str, Any]] = {}
    problem = None
    while len(received) < pool.world_size:
        try:
            got_call, rank, status, value = pool.results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(pool.processes) if not p.is_alive() and r not in received]
            if dead:
                return received, f"rank(s) {dead} exited (exit codes {[pool.processes[r].exitcode for r in dead]})"
            if time.monotonic() > deadline:
                return (
                    received,
                    problem or f"deadline of {deadline_seconds:.0f} s passed ({TIMEOUT_SCALE_ENV} scales it)",
                )
            continue
        if got_call != call_id:
            continue  # a late answer from an earlier call (cannot happen after a restart, kept for safety)
        received[rank] = (status, value)
        if status == "error" and problem is None:
            # The others usually fail soon after (their peer left): wait briefly so the report has their tracebacks.
            problem = f"rank {rank} failed"
            deadline = min(deadline, time.monotonic() + _PEER_REPORT_GRACE_SECONDS)
    return received, problem


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None, fresh: bool = False
) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` on `world_size` gloo ranks; returns the results by rank.

    `fn` must be importable (a module-level function). The process group is created by the code under test
    (from RANK/WORLD_SIZE/MASTER_* in the environment) with a timeout, so a rank that fails makes the others
    fail instead of hanging. The ranks are shared with other tests (see the notes at the top of this module).

    Args:
        timeout: seconds this body may take on an idle machine (default `DEFAULT_TIMEOUT_SECONDS`), multiplied by
            ACCELERATE_ZERO_TEST_TIMEOUT_SCALE.
        fresh: run on ranks started for this call only, for a body that changes module globals.

    Raises:
        AssertionError: with every failing rank's traceback and the stack of every rank that had not finished.
    """
    pool = _pool(world_size, fresh)
    _SPAWNS["calls"] += 1
    _SPAWNS["rank_bodies"] += world_size
    # Starting the ranks (importing torch) is not the body's work: it gets its own allowance.
    startup = _STARTUP_SECONDS if pool.calls == 0 else 0.0
    pool.calls += 1
    call_id = (os.getpid(), id(pool), pool.calls)
    port = free_port()
    for tasks in pool.tasks:
        tasks.put((call_id, port, fn, args, dict(os.environ), os.getcwd()))
    deadline_seconds = (DEFAULT_TIMEOUT_SECONDS if timeout is None else timeout) * timeout_scale()
    deadline = time.monotonic() + deadline_seconds + startup * timeout_scale()
    received, problem = _collect(pool, call_id, deadline, deadline_seconds)
    failed = problem is not None or any(status == "error" for status, _ in received.values())
    if failed:
        waiting = [r for r in range(world_size) if r not in received]
        stacks = pool.stacks_of(waiting) if waiting else {}
        pool.close()
        if _POOLS.get(world_size) is pool:
            del _POOLS[world_size]
        details = [f"rank {r} raised:\n{received[r][1]}" for r in sorted(received) if received[r][0] == "error"]
        details += [f"rank {r} had not finished; its stacks (most recent call first):\n{stacks[r]}" for r in waiting]
        raise AssertionError(
            f"distributed run of {fn.__module__}.{fn.__qualname__} on {world_size} ranks failed: "
            f"{problem or 'a rank raised'}\n" + "\n".join(details)
        )
    if pool is not _POOLS.get(world_size):
        pool.stop()
    return [torch.load(io.BytesIO(received[rank][1]), weights_only=True) for rank in range(world_size)]


class SharedParts:
    """A module's expensive distributed checks, split into named parts that many tests read.

    `shared_parts(fn, world_size, *args)[rank][part]` runs `fn(rank, world_size, *args, part)` on the pool once,
    the first time any test reads `part`, and returns rank `rank`'s result. One part per body keeps every run
    within its own deadline (a module fixture running them all did not stay within the pytest timeout on a busy
    machine), and a test that reads one part does not wait for the others.
    """

    def __init__(self, fn: Callable[..., Any], world_size: int, args: tuple, timeouts: dict[str, float]) -> None:
        self.fn, self.world_size, self.args, self.timeouts = fn, world_size, args, timeouts
        self.results: dict[str, list[Any]] = {}

    def result(self, rank: int, part: str) -> Any:
        if part not in self.results:
            timeout = self.timeouts.get(part)
            self.results[part] = run_distributed(self.fn, self.world_size, *self.args, part, timeout=timeout)
        return self.results[part][rank]


class _RankParts:
    def __init__(self, shared: SharedParts, rank: int) -> None:
        self.shared, self.rank = shared, rank

    def __getitem__(self, part: str) -> Any:
        return self.shared.result(self.rank, part)


def shared_parts(
    fn: Callable[..., Any], world_size: int, *args: Any, timeouts: dict[str, float] | None = None
) -> list[_RankParts]:
    """One view per rank of `SharedParts(fn, world_size, args)`; `timeouts` maps a part to its deadline (seconds)."""
    shared = SharedParts(fn, world_size, args, timeouts or {})
    return [_RankParts(shared, rank) for rank in range(world_size)]
