"""`accelerate-zero deepspeed`: DeepSpeed's `deepspeed` launcher command line, for scripts that import
`accelerate_zero.deepspeed as deepspeed`.

Usage:
    accelerate-zero deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
    accelerate-zero deepspeed --include localhost:0,2 train.py --deepspeed_config ds.json
    accelerate-zero deepspeed --hostfile hosts --no_ssh --node_rank 1 --master_addr node0 train.py ...

Every process gets `--local_rank=<i>` before the script's arguments and DeepSpeed's environment
(accelerate_zero/deepspeed/launcher.py). A `--deepspeed_config` among the script's arguments is checked first, for
the world size launched: a bad config exits 2 with every problem listed, starting nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from accelerate_zero.config import ZeroConfigError


USAGE_EXIT_CODE = 2
_REFUSED_FLAGS = {
    "autotuning": "the autotuner is not available; `accelerate-zero estimate` sizes memory for a config",
    "bind_cores_to_rank": "binding cores is not available; set OMP_NUM_THREADS / taskset yourself",
    "bind_core_list": "binding cores is not available; set OMP_NUM_THREADS / taskset yourself",
    "venv_script": "remote environments (ssh launching) are not available",
    "ssh_port": "ssh launching is not available; use --no_ssh on every node",
    "launcher_args": "ssh launching backends are not available; use --no_ssh on every node",
    "save_pid": "the pid file is not written",
}


def register(subcommands: Any) -> None:
    """Adds the `deepspeed` subcommand: DeepSpeed's launcher flags (0.19.8's runner)."""
    parser = subcommands.add_parser(
        "deepspeed",
        help="launch a DeepSpeed-style script (import accelerate_zero.deepspeed as deepspeed) on every rank, with "
        "the flags of DeepSpeed's `deepspeed` launcher",
        description="DeepSpeed's launcher command line: starts one process per slot on this node, each given "
        "--local_rank=<i> and RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.",
    )
    parser.add_argument("-H", "--hostfile", default="/job/hostfile", help="`host slots=N` lines (MPI style)")
    parser.add_argument("-i", "--include", default="", help="NODE_SPEC[@NODE_SPEC ...], NODE_SPEC=NAME[:SLOT,...]")
    parser.add_argument("-e", "--exclude", default="", help="resources not to use (the --include format)")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, help="processes per node")
    parser.add_argument("--master_port", type=int, default=29500)
    parser.add_argument("--master_addr", default="", help="node 0's address (this machine without a hostfile)")
    parser.add_argument("--node_rank", type=int, default=-1, help="this node's index (with --no_ssh)")
    parser.add_argument("--launcher", default="pdsh", help="multi-node backend: only --no_ssh is available")
    parser.add_argument("--launcher_args", default="")
    parser.add_argument("--module", action="store_true", help="run the script as `python -m`")
    parser.add_argument("--no_python", action="store_true", help="execute the script directly")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    parser.add_argument("--no_ssh", action="store_true", help="start only this node's processes (run on every node)")
    parser.add_argument("--no_ssh_check", action="store_true")
    parser.add_argument("--force_multi", action="store_true")
    parser.add_argument("--save_pid", action="store_true")
    parser.add_argument("--enable_each_rank_log", default="None", help="a folder for one log file per rank")
    parser.add_argument("--autotuning", default="", choices=["", "tune", "run"])
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list", default=None)
    parser.add_argument("--ssh_port", type=int, default=None)
    parser.add_argument("--venv_script", default=None)
    parser.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    parser.add_argument("-q", "--quiet", action="store_true")
    parser.add_argument("user_script", help="the training script, followed by its arguments")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Starts the processes; returns the run's exit code, or 2 (nothing started) for a bad command line or config."""
    from accelerate_zero.deepspeed import launcher
    from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable

    try:
        processes = _plan(args, launcher)
    except ZeroConfigError as error:
        print("accelerate-zero deepspeed: invalid DeepSpeed config, nothing was started:", file=sys.stderr)
        for problem in error.problems:
            print(f"  - {problem}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except (launcher.LaunchProblem, DeepSpeedUnavailable) as error:
        print(f"accelerate-zero deepspeed: {error}", file=sys.stderr)
        return USAGE_EXIT_CODE
    log_dir = None if args.enable_each_rank_log == "None" else args.enable_each_rank_log
    return launcher.run_processes(processes, log_dir)


def _plan(args: argparse.Namespace, launcher: Any) -> list:
    from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable
    from accelerate_zero.engine.groups import has_accelerator

    for flag, reason in _REFUSED_FLAGS.items():
        if getattr(args, flag) not in (None, False, "", "None"):
            raise DeepSpeedUnavailable(f"--{flag}: {reason}")
    pool = launcher.read_hostfile(args.hostfile)
    master_addr = args.master_addr
    if pool is None:
        if args.num_nodes > 1:
            raise launcher.LaunchProblem("Num nodes is >1 but no extra nodes available via hostfile")
        pool, master_addr = {"localhost": _local_device_count(has_accelerator())}, "127.0.0.1"
    resources = launcher.select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    if not resources:
        raise launcher.LaunchProblem("no resources left after --include/--exclude")
    launcher.refuse_remote_launch(resources, args.no_ssh, args.force_multi, args.launcher)
    node_rank = args.node_rank if args.no_ssh else 0
    if not 0 <= node_rank < len(resources):
        raise launcher.LaunchProblem(
            f"--node_rank={args.node_rank}: with --no_ssh give this node's index among the {len(resources)} hosts"
        )
    if not master_addr:
        raise launcher.LaunchProblem("--master_addr is needed with a hostfile (node 0's address)")
    world_size = sum(len(slots) for slots in resources.values())
    _check_config(args.user_args, world_size)
    return launcher.rank_processes(
        resources,
        node_rank,
        args.user_script,
        args.user_args,
        master_addr=master_addr,
        master_port=args.master_port,
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        visible_devices=has_accelerator(),
    )


def _local_device_count(accelerator: bool) -> int:
    import torch

    return torch.cuda.device_count() if accelerator and torch.cuda.is_available() else 1


def _check_config(user_args: list[str], world_size: int) -> None:
    """Loads and resolves a `--deepspeed_config` the script is given, as every rank will (same checks)."""
    from accelerate_zero.config import ZeroConfig, resolve_config
    from accelerate_zero.deepspeed.launcher import LaunchProblem

    path = None
    for index, arg in enumerate(user_args):
        if arg == "--deepspeed_config" and index + 1 < len(user_args):
            path = user_args[index + 1]
        elif arg.startswith("--deepspeed_config="):
            path = arg.split("=", 1)[1]
    if path is None:
        return
    if not Path(path).is_file():
        raise LaunchProblem(f"--deepspeed_config {path}: no such file")
    resolve_config(ZeroConfig.from_any(path), world_size=world_size)
