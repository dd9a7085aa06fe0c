"""Runs a function on W fresh ranks (one `torchrun --standalone` group per call, a lone process at W = 1) and brings
back what each returned.

`on_ranks(2, steps.train, {"system": "az3", "steps": 20})` starts 2 processes under torch.distributed.run, each
running harness/rank.py: it joins a gloo process group, calls `steps.train(system="az3", steps=20)` and writes
the JSON-able result; the launcher reads every rank's, with the seconds the group took and the 1-minute load
average before and after. The function must be defined at the top level of a module under bench/ (a question
run as a script is imported by its file name, so its `if __name__ == "__main__"` block does not run on the ranks).

Every rank starts with `RANK_ENV` (one thread, freed buffers returned to the OS at once: [Note: how the benchmark
measures] in harness/readings.py). DeepSpeed runs from its own virtualenv (`deepspeed_python()`): it is compared,
never imported into this project's environment, and that rank's environment drops PYTHONPATH and VIRTUAL_ENV.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


BENCH_DIR = Path(__file__).resolve().parents[1]
RANK_SCRIPT = Path(__file__).with_name("rank.py")
RANK_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
DEFAULT_DS_VENV = Path(os.environ.get("DS_VENV", BENCH_DIR.parent / ".ds-venv"))
"""DeepSpeed's own virtualenv: `$DS_VENV`, else `.ds-venv` at the top of this checkout (ignored by git). Make it once:
`python3 -m venv .ds-venv && DS_BUILD_OPS=0 .ds-venv/bin/pip install deepspeed "torch==2.13.0" transformers`."""


class LaunchFailed(RuntimeError):
    """A group exited with an error, timed out, went over its RSS budget or left a rank's result missing; the message
    ends with its log."""

    def __init__(
        self, message: str, code: int | str | None = None, peak_rss_sum: int = 0, results: list[Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.peak_rss_sum = code, peak_rss_sum
        self.results = results or []
        """What each rank returned before the group failed (None for a rank that did not finish), in rank order."""


@dataclass(frozen=True)
class Finished:
    """How a command run by `run_command` ended."""

    code: int | str
    """Its exit code, or "timeout (N s)", or "over budget" (`rss_budget`)."""
    seconds: float
    peak_rss_sum: int
    """The largest resident memory of its whole process tree seen while it ran (0 when not watched)."""


@dataclass(frozen=True)
class Ranks:
    """What one group brought back."""

    results: list[Any]
    """What the function returned on each rank, in rank order."""
    seconds: float
    """Wall time of the whole group, process start-up included."""
    load: tuple[float, float]
    """The machine's 1-minute load average before and after the group."""
    log: Path
    peak_rss_sum: int = 0
    """The largest RSS summed over the group's processes, when `on_ranks` watched a budget (else 0)."""


def deepspeed_python(venv: Path = DEFAULT_DS_VENV) -> Path | None:
    """The Python of DeepSpeed's virtualenv, or None when it does not exist (callers skip DeepSpeed with a note)."""
    python = venv / "bin" / "python"
    return python if python.exists() else None


def interleaved(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, name) for every round, every other round in reverse order, so that drifting load hits all alike."""
    return [(r, name) for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def on_ranks(
    world_size: int,
    function: Callable[..., Any],
    kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    out_dir: Path | None = None,
    python: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    threads: int = 1,
    backend: str = "gloo",
    rss_budget: float | None = None,
) -> Ranks:
    """Runs `function(**kwargs)` on `world_size` fresh ranks and returns every rank's result.

    Args:
        world_size: processes in the group.
        function: a top-level function of a module under bench/; its result must be JSON-able.
        kwargs: its keyword arguments, JSON-able.
        name: the run's name in logs and file names (default: the function's name).
        out_dir: where the log and the per-rank results go (default: bench/out/<module>/).
        python: another interpreter (DeepSpeed's virtualenv): its ranks run without PYTHONPATH.
        env: variables added to `RANK_ENV` and this process's environment.
        timeout: seconds before the whole group is killed.
        threads: torch's intra-op threads on each rank.
        backend: the process group's backend, or "none" when the function makes its own.
        rss_budget: bytes; the whole group is killed as soon as the RSS summed over its processes exceeds it.

    Raises:
        LaunchFailed: a rank failed, the group timed out or went over `rss_budget`, or a result is missing.
    """
    module = sys.modules[function.__module__]
    stem = Path(module.__file__).stem
    name = name or function.__name__
    out_dir = out_dir or BENCH_DIR / "out" / stem
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix, log = out_dir / name, out_dir / f"{name}.log"
    for stale in [*out_dir.glob(f"{name}.rank*.json"), *out_dir.glob(f"{name}.rank*.error")]:
        stale.unlink()
    # One process needs no torchrun (one interpreter start-up less): rank.py runs alone on a free port.
    runner = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)] if world_size > 1 else []
    )
    command = [
        str(python or sys.executable), *runner, str(RANK_SCRIPT), "--module", "" if module.__name__ == "__main__"
        else module.__name__, "--file", str(module.__file__), "--function", function.__name__, "--kwargs",
        json.dumps(kwargs or {}), "--out", str(prefix), "--threads", str(threads), "--backend", backend,
    ]  # fmt: skip
    rank_env = _rank_env(python, {**(single_process_env(apply=False) if world_size == 1 else {}), **(env or {})})
    load_before = os.getloadavg()[0]
    done = run_command(command, log=log, env=rank_env, timeout=timeout, rss_budget=rss_budget)
    load_after = os.getloadavg()[0]
    paths = [Path(f"{prefix}.rank{rank}.json") for rank in range(world_size)]
    results = [json.loads(path.read_text()) if path.exists() else None for path in paths]
    if done.code != 0 or None in results:
        errors = sorted(out_dir.glob(f"{name}.rank*.error"))
        source = errors[0] if errors else log
        tail = "\n    ".join(source.read_text(errors="replace").splitlines()[-15:])
        message = f"{name}: {done.code} after {done.seconds:.0f} s; the end of {source}:\n    {tail}"
        raise LaunchFailed(message, done.code, done.peak_rss_sum, results)
    print(
        f"  {name}: done in {done.seconds:.0f}s (1-min load average {load_before:.1f} -> {load_after:.1f})", flush=True
    )
    return Ranks(results, done.seconds, (load_before, load_after), log, done.peak_rss_sum)


def _rank_env(python: Path | None, extra: dict[str, str] | None) -> dict[str, str]:
    env = {**os.environ, **RANK_ENV, **(extra or {})}
    if python is not None and Path(python) != Path(sys.executable):
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_command(
    command: list[str],
    *,
    log: Path,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    rss_budget: float | None = None,
) -> Finished:
    """Runs `command` in its own session, its output into `log`; on a timeout, or as soon as the RSS summed over its
    process tree exceeds `rss_budget` bytes, kills the whole tree (`kill_tree`: torchrun's ranks too)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start, seen = time.perf_counter(), 0
    with (
        open(log, "w") as log_file,
        subprocess.Popen(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        ) as process,
    ):
        while True:
            try:
                code: int | str = process.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if rss_budget is not None:
                seen = max(seen, tree_rss(process.pid))
            over, late = rss_budget is not None and seen > rss_budget, time.perf_counter() - start > timeout
            if over or late:
                kill_tree(process.pid)
                process.wait()
                code = "over budget" if over else f"timeout ({timeout:.0f} s)"
                break
    return Finished(code, time.perf_counter() - start, seen)


def tree_rss(root: int) -> int:
    """Resident bytes summed over `root` and its descendants."""
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants, parents first (torchrun's ranks need not share its process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    pids, stack = [], [root]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack += children.get(pid, [])
    return pids


def kill_tree(root: int) -> None:
    """SIGKILL to `root`'s descendants (the ranks) first, then to `root` (torchrun): none keeps running."""
    for pid in reversed(process_tree(root)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def single_process_env(apply: bool = True) -> dict[str, str]:
    """The variables of a one-process group (world size 1) on a free port, set in this process unless `apply` is
    False (`on_ranks` gives them to a lone rank instead).

    A question that trains in its own process (no torchrun) calls this before `accelerate_zero.initialize`; a free
    port, not a fixed one, so that two questions running at once do not collide.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    values = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    values["LOCAL_WORLD_SIZE"] = "1"
    if apply:
        os.environ.update(values)
    return values
