"""DeepSpeed's launcher (`deepspeed --num_gpus 2 train.py ...`) as `accelerate-zero deepspeed`: the same flags, the
same processes.

[Note: what DeepSpeed's launcher gives each process]
DeepSpeed's runner builds the resource pool (a hostfile's `host slots=N` lines, else this machine's devices), keeps
what `--include`/`--exclude` or `--num_nodes`/`--num_gpus` select, and starts on each node one process per slot:
`python -u train.py --local_rank=<i> <script args>` (`--local_rank` before the script's own arguments, left out with
`--no_local_rank`), with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT
and the visible devices set. When one process fails the others are stopped and its exit code is returned. The
functions below reproduce that; what needs ssh (pdsh, OpenMPI, SLURM launching onto other nodes) is not available:
run the same command with `--no_ssh --node_rank=<n>` on every node instead, as DeepSpeed's own `--no_ssh` mode does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable


DEFAULT_HOSTFILE = "/job/hostfile"
"""DeepSpeed's default `--hostfile` (DLTS_HOSTFILE); absent, the pool is this machine."""
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
_STOP_GRACE_SECONDS = 10.0


class LaunchProblem(ValueError):
    """The command line or the hostfile cannot be launched (nothing was started); the message says why."""


def read_hostfile(path: str | os.PathLike[str]) -> dict[str, int] | None:
    """`host slots=N` per line (`#` comments, blank lines skipped), in file order; None when there is no file."""
    if not os.path.isfile(path):
        return None
    pool: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.match(line)
        if match is None:
            raise LaunchProblem(f"Hostfile contains a bad entry: {line}, unable to proceed with launching")
        if match[1] in pool:
            raise LaunchProblem(f"Hostfile contains multiple entries for {match[1]}, unable to proceed with launching")
        pool[match[1]] = int(match[2])
    if not pool:
        raise LaunchProblem("Hostfile is empty or not formatted correctly, unable to proceed with launching.")
    return pool


def _node_specs(spec: str) -> dict[str, list[int]]:
    """ "host-a@host-b:0,2" -> {"host-a": [], "host-b": [0, 2]} (no slots: the whole host)."""
    nodes: dict[str, list[int]] = {}
    for node in spec.split("@"):
        host, _, slots = node.partition(":")
        try:
            nodes.setdefault(host, []).extend(int(s) for s in slots.split(",") if slots)
        except ValueError:
            raise LaunchProblem(f"bad resource spec {node!r}: NAME[:SLOT[,SLOT ...]] with integer slots") from None
    return {host: sorted(set(slots)) for host, slots in nodes.items()}


def select_resources(
    pool: Mapping[str, int], include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1
) -> dict[str, list[int]]:
    """The slots used on each host, in pool order: `include` keeps, `exclude` removes (NODE_SPEC[@NODE_SPEC...],
    NODE_SPEC = NAME[:SLOT[,SLOT...]]), then the first `num_nodes` hosts and slots `0..num_gpus-1` on each."""
    if include and exclude:
        raise LaunchProblem("include_str and exclude_str are mutually exclusive.")
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        raise LaunchProblem("Cannot specify num_nodes/gpus with include/exclude")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    spec = include or exclude
    if spec:
        chosen = _node_specs(spec)
        for host, slots in chosen.items():
            if host not in active:
                raise LaunchProblem(f"Hostname '{host}' not found in hostfile")
            missing = [s for s in slots if s not in active[host]]
            if missing:
                raise LaunchProblem(f"No slot '{missing[0]}' specified on host '{host}'")
        if include:
            active = {host: chosen[host] or slots for host, slots in active.items() if host in chosen}
        else:
            for host, slots in chosen.items():  # no slots named: the whole host goes
                active[host] = [s for s in active[host] if slots and s not in slots]
        active = {host: slots for host, slots in active.items() if slots}
    if num_nodes > 0:
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        active = {host: list(range(num_gpus)) for host in active}
    return active


@dataclass(frozen=True)
class RankProcess:
    """One process to start on this node."""

    command: list[str]
    env: dict[str, str]


def rank_processes(
    resources: Mapping[str, list[int]],
    node_rank: int,
    script: str,
    script_args: Sequence[str],
    *,
    master_addr: str,
    master_port: int,
    module: bool = False,
    no_python: bool = False,
    no_local_rank: bool = False,
    visible_devices: bool = False,
    base_env: Mapping[str, str] | None = None,
) -> list[RankProcess]:
    """The processes node `node_rank` starts ([Note: what DeepSpeed's launcher gives each process]).

    `visible_devices`: set CUDA_VISIBLE_DEVICES to the node's slots (on a machine with GPUs)."""
    if module and no_python:
        raise LaunchProblem("Don't use both the '--no_python' flag and the '--module' flag at the same time.")
    hosts = list(resources)
    slots = resources[hosts[node_rank]]
    first = sum(len(resources[h]) for h in hosts[:node_rank])
    world = sum(len(s) for s in resources.values())
    env = dict(os.environ if base_env is None else base_env)
    env.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(world),
        CROSS_RANK=str(node_rank),
        CROSS_SIZE=str(len(hosts)),
        LOCAL_SIZE=str(len(slots)),
    )
    if visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    processes = []
    for local_rank in range(len(slots)):
        command = [] if no_python else [sys.executable, "-u", *(["-m"] if module else [])]
        command.append(script)
        if not no_local_rank:
            command.append(f"--local_rank={local_rank}")
        command += list(script_args)
        rank_env = dict(env, RANK=str(first + local_rank), LOCAL_RANK=str(local_rank))
        processes.append(RankProcess(command, rank_env))
    return processes


def run_processes(processes: Sequence[RankProcess], log_dir: str | None = None) -> int:
    """Starts the processes and waits: 0 when all succeed; else the first failure's exit code, the others stopped
    (SIGTERM, then SIGKILL after a grace period). SIGINT/SIGTERM to the launcher stop them too."""
    logs = []
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d%H%M%S")
        logs = [open(Path(log_dir) / f"{stamp}_rank{p.env['RANK']}.log", "w") for p in processes]  # noqa: SIM115
    started = [
        subprocess.Popen(p.command, env=p.env, stdout=logs[i] if logs else None, stderr=logs[i] if logs else None)
        for i, p in enumerate(processes)
    ]

    def stop_and_exit(signum: int, frame: object) -> None:
        _stop(started)
        sys.exit(128 + signum)

    previous = {sig: signal.signal(sig, stop_and_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in started]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(started)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for log in logs:
            log.close()


def _stop(started: Sequence[subprocess.Popen]) -> None:
    for process in started:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + _STOP_GRACE_SECONDS
    for process in started:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def refuse_remote_launch(resources: Mapping[str, list[int]], no_ssh: bool, force_multi: bool, launcher: str) -> None:
    """Launching onto other nodes over ssh (DeepSpeed's pdsh/OpenMPI/SLURM backends) is not available."""
    if (len(resources) > 1 or force_multi) and not no_ssh:
        raise DeepSpeedUnavailable(
            f"starting processes on {len(resources)} nodes over ssh (--launcher {launcher}) is not available: run "
            "the same command on every node with --no_ssh --node_rank=<that node's index> --master_addr=<node 0>"
        )
