"""Runs a function on W fresh ranks (one `torchrun --standalone` group per call) and brings back what each returned.

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
    """A group exited with an error, timed out, or left a rank's result missing; the message ends with its log."""


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

    Raises:
        LaunchFailed: a rank failed, the group timed out, or a result is missing.
    """
    module = sys.modules[function.__module__]
    stem = Path(module.__file__).stem
    name = name or function.__name__
    out_dir = out_dir or BENCH_DIR / "out" / stem
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix, log = out_dir / name, out_dir / f"{name}.log"
    for stale in [*out_dir.glob(f"{name}.rank*.json"), *out_dir.glob(f"{name}.rank*.error")]:
        stale.unlink()
    command = [
        str(python or sys.executable), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(world_size), str(RANK_SCRIPT), "--module", "" if module.__name__ == "__main__" else module.__name__,
        "--file", str(module.__file__), "--function", function.__name__, "--kwargs", json.dumps(kwargs or {}),
        "--out", str(prefix), "--threads", str(threads), "--backend", backend,
    ]  # fmt: skip
    load_before, start = os.getloadavg()[0], time.perf_counter()
    code = _run(command, _rank_env(python, env), log, timeout)
    seconds, load_after = time.perf_counter() - start, os.getloadavg()[0]
    paths = [Path(f"{prefix}.rank{rank}.json") for rank in range(world_size)]
    if code != 0 or not all(path.exists() for path in paths):
        errors = sorted(out_dir.glob(f"{name}.rank*.error"))
        source = errors[0] if errors else log
        tail = "\n    ".join(source.read_text(errors="replace").splitlines()[-15:])
        raise LaunchFailed(f"{name}: {code} after {seconds:.0f} s; the end of {source}:\n    {tail}")
    print(f"  {name}: done in {seconds:.0f}s (1-min load average {load_before:.1f} -> {load_after:.1f})", flush=True)
    results = [json.loads(path.read_text()) for path in paths]
    return Ranks(results, seconds, (load_before, load_after), log)


def _rank_env(python: Path | None, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ, **RANK_ENV, **(extra or {}))
    if python is not None and Path(python) != Path(sys.executable):
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def _run(command: list[str], env: dict[str, str], log: Path, timeout: float) -> int | str:
    """Runs `command`; on a timeout kills it with every process under it (`kill_tree`)."""
    with (
        open(log, "w") as log_file,
        subprocess.Popen(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        ) as process,
    ):
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.wait()
            return f"timeout ({timeout:.0f} s)"


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


def single_process_env() -> dict[str, str]:
    """Sets and returns the variables of a one-process group (world size 1) on a free port, for in-process runs.

    A question that trains in its own process (no torchrun) calls this before `accelerate_zero.initialize`; a free
    port, not a fixed one, so that two questions running at once do not collide.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    values = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    values["LOCAL_WORLD_SIZE"] = "1"
    os.environ.update(values)
    return values
