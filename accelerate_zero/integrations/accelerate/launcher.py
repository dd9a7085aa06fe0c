"""`accelerate-zero launch`: start a script on every rank with ZeRO configured, through accelerate's own launcher.

[Note: launching through accelerate without DeepSpeed]
`accelerate launch` sends `distributed_type: DEEPSPEED` (or `--use_deepspeed`) to its DeepSpeed launcher, whose
first statement raises ImportError when deepspeed is not installed (INTEGRATION_NOTES.md §3.4). So:

1. the accelerate config is read as `accelerate launch` reads it (`load_config_from_file`; the default config file
   when --config_file is not given), and the DeepSpeed config is built (`zero_settings.py`, `deepspeed_build.py`)
   and checked (`launch_checks.py`): a bad config stops here, before any process starts;
2. a copy of the accelerate config without its `deepspeed_config` block, with `distributed_type: MULTI_GPU` (NO for
   one process), is written to a temporary file, and accelerate's `launch_command` runs with it: its multi-GPU
   launcher calls `torch.distributed.run`, which starts `num_processes / num_machines` processes on this machine
   (with or without GPUs: `accelerate launch --cpu` would start one) and stops all of them when one fails;
3. the ranks inherit `ACCELERATE_ZERO_CONFIG` and `ACCELERATE_ZERO_<FIELD>` (read by `ZeroPlugin`); accelerate's
   DeepSpeed variables (`ACCELERATE_USE_DEEPSPEED`, ...) are never set, so accelerate never takes its DeepSpeed
   paths. Without an accelerator, `ACCELERATE_USE_CPU=true` makes `Accelerator()` see MULTI_CPU with every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from accelerate.commands.config import default_config_file, load_config_from_file
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import launch_command
from accelerate.utils import ComputeEnvironment, DistributedType, patch_environment
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from accelerate_zero.config import ZeroConfigError
from accelerate_zero.config.deepspeed_keys import NOTED_ENV
from accelerate_zero.engine.groups import has_accelerator
from accelerate_zero.integrations.accelerate.deepspeed_build import BuiltConfig, build_deepspeed_config
from accelerate_zero.integrations.accelerate.launch_checks import (
    machine_problems,
    node_span_warnings,
    nvme_path_problems,
    resolve_leaving_auto,
    with_parallelism_block,
)
from accelerate_zero.integrations.accelerate.rank_env import MOE_ENV, plugin_env
from accelerate_zero.integrations.accelerate.zero_settings import settings_from_accelerate


logger = logging.getLogger(__name__)

USAGE_EXIT_CODE = 2
"""argparse's exit code for a rejected command line: reported in one line instead of torch's failure block."""
_UNSUPPORTED_TYPES = (DistributedType.FSDP, DistributedType.XLA, DistributedType.MEGATRON_LM)
_UNSUPPORTED_FLAGS = {"use_fsdp": "--use_fsdp", "tpu": "--tpu", "use_megatron_lm": "--use_megatron_lm"}


class LaunchError(Exception):
    """The launch cannot start: a problem with the accelerate config file or the flags (nothing was started)."""


class PreparedLaunch(NamedTuple):
    """Everything decided before a process starts."""

    built: BuiltConfig
    """The validated DeepSpeed config and the plugin fields it sets."""
    env: dict[str, str]
    """Variables added to the ranks' environment."""
    cluster_config: ClusterConfig
    """The accelerate config handed to accelerate's launcher: MULTI_GPU (or NO), no `deepspeed_config` block."""
    num_processes: int
    """Processes over all machines."""
    num_machines: int


def prepare_launch(args: argparse.Namespace) -> PreparedLaunch:
    """Reads the accelerate config and flags, builds and validates the ZeRO config; starts nothing.

    Args:
        args: the parsed `accelerate-zero launch` arguments (the flags of `accelerate launch`).

    Raises:
        ZeroConfigError: the ZeRO settings are invalid (every problem listed).
        LaunchError: the accelerate config file or the flags are unusable.
    """
    config_file = args.config_file
    if config_file is None and os.path.isfile(default_config_file):
        config_file = default_config_file  # as `accelerate launch`
    cluster = _load_cluster_config(config_file)
    _check_paradigm(args, cluster)
    block = dict(cluster.deepspeed_config or {}) if cluster is not None else {}
    settings = settings_from_accelerate(
        block,
        vars(args),
        config_mixed_precision=cluster.mixed_precision if cluster is not None else None,
        config_is_deepspeed=cluster is not None and cluster.distributed_type == DistributedType.DEEPSPEED,
        source=config_file or "the command line",
    )
    built = build_deepspeed_config(settings)
    if not block and settings.config is None and not settings.fields and not args.use_deepspeed:
        logger.warning(
            "accelerate-zero launch: neither %s nor the flags configure ZeRO (no deepspeed_config block, "
            "--zero_stage or --deepspeed_config_file): using accelerate's DeepSpeed defaults (zero_stage 2)",
            config_file or "an accelerate config",
        )
    num_processes, num_machines = _process_counts(args, cluster)
    _check_multinode_launcher(args, block, num_machines)
    _check_machines(args, cluster, num_machines)
    _check_before_spawn(built, num_processes, cluster.parallelism_config if cluster is not None else None)
    for warning in node_span_warnings(built.zero_config, num_processes, num_machines):
        logger.warning("accelerate-zero launch: %s", warning)
    env = plugin_env(built)
    env[NOTED_ENV] = "1"  # the config's notes were logged here, once: the ranks do not repeat them
    moe_names = args.deepspeed_moe_layer_cls_names or block.get("deepspeed_moe_layer_cls_names")
    if moe_names:
        env[MOE_ENV] = str(moe_names)
    if args.cpu or (cluster is not None and cluster.use_cpu) or not has_accelerator():
        env["ACCELERATE_USE_CPU"] = "true"
    translated = _translate(cluster, num_processes, num_machines)
    return PreparedLaunch(built, env, translated, num_processes, num_machines)


def launch(args: argparse.Namespace) -> int:
    """Runs `accelerate-zero launch` (see the module docstring); returns the exit code.

    Returns:
        0 when every rank succeeded; otherwise the failing exit code (1 when torch's launcher reports failed ranks).

    Raises:
        ZeroConfigError: the ZeRO settings are invalid; nothing was started.
        LaunchError: the accelerate config file or the flags are unusable; nothing was started.
    """
    prepared = prepare_launch(args)
    with tempfile.TemporaryDirectory(prefix="accelerate_zero_launch_") as folder:
        path = os.path.join(folder, "accelerate_config.yaml")
        prepared.cluster_config.to_yaml_file(path)
        launch_args = copy.copy(args)
        launch_args.config_file = path
        launch_args.use_deepspeed = launch_args.multi_gpu = False  # the translated config decides
        if prepared.num_processes > 1 or prepared.num_machines > 1:
            launch_args.cpu = False  # `--cpu` would pick accelerate's one-process launcher; ACCELERATE_USE_CPU is set
        with patch_environment(**prepared.env), _signal_handlers_restored():
            return _run_accelerate_launcher(launch_args)


def _run_accelerate_launcher(args: argparse.Namespace) -> int:
    try:
        launch_command(args)
    except ChildFailedError as error:
        codes = {failure.exitcode for failure in error.failures.values()}
        # argparse rejected the command line (its message is above); ranks the launcher then stopped show -SIGTERM
        if USAGE_EXIT_CODE in codes and codes <= {USAGE_EXIT_CODE, -signal.SIGTERM}:
            ranks = ", ".join(str(r) for r, f in sorted(error.failures.items()) if f.exitcode == USAGE_EXIT_CODE)
            logger.error(
                "accelerate-zero launch: the script exited with code 2 (command-line error) on rank %s", ranks
            )
            return USAGE_EXIT_CODE
        logger.error("accelerate-zero launch: %s", error)
        return 1
    except SignalException as error:  # the launcher was told to stop; torch's launcher stopped the ranks
        return 128 + int(error.sigval)
    except subprocess.CalledProcessError as error:  # accelerate's one-process launcher
        return error.returncode or 1
    except SystemExit as error:  # the same with --quiet
        return error.code if isinstance(error.code, int) else 1
    except (ValueError, ConnectionError, AssertionError, FileNotFoundError) as error:
        raise LaunchError(str(error)) from None  # accelerate's checks before it starts anything
    return 0


_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@contextlib.contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    """torch's launcher installs signal handlers it never removes; restore ours when `launch` is called in-process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n, None) for n in _HANDLED_SIGNALS) if sig}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: installed outside Python, cannot be put back
                signal.signal(sig, handler)


def _load_cluster_config(config_file: str | None) -> ClusterConfig | None:
    if config_file is None:
        return None
    if not os.path.isfile(config_file):
        raise LaunchError(f"--config_file {config_file}: no such file")
    try:
        cluster = load_config_from_file(config_file)
    except Exception as error:  # yaml/json syntax, unknown top-level keys, bad enum values: all accelerate's messages
        raise LaunchError(f"cannot read the accelerate config {config_file}: {error}") from None
    if not isinstance(cluster, ClusterConfig) or cluster.compute_environment != ComputeEnvironment.LOCAL_MACHINE:
        raise LaunchError(f"{config_file}: accelerate-zero launch only runs compute_environment: LOCAL_MACHINE")
    return cluster


def _check_paradigm(args: argparse.Namespace, cluster: ClusterConfig | None) -> None:
    given = [flag for name, flag in _UNSUPPORTED_FLAGS.items() if getattr(args, name, False)]
    if given:
        raise LaunchError(f"{', '.join(given)}: accelerate-zero launch runs ZeRO; use `accelerate launch` for that")
    if cluster is not None and cluster.distributed_type in _UNSUPPORTED_TYPES:
        raise LaunchError(
            f"distributed_type: {cluster.distributed_type.value} in {args.config_file or default_config_file}: "
            "accelerate-zero launch runs ZeRO; use DEEPSPEED (with a deepspeed_config block), MULTI_GPU, MULTI_CPU "
            "or NO"
        )


def _process_counts(args: argparse.Namespace, cluster: ClusterConfig | None) -> tuple[int, int]:
    num_machines = args.num_machines or (cluster.num_machines if cluster is not None else 1) or 1
    num_processes = args.num_processes
    if num_processes is None and cluster is not None:
        if cluster.num_processes == -1:
            raise LaunchError("You need to manually pass in `--num_processes` using this config yaml.")
        num_processes = cluster.num_processes
    if num_processes is None:
        num_processes = max(torch.cuda.device_count(), 1) * num_machines
    if num_processes < num_machines or num_processes % num_machines:
        raise LaunchError(
            f"{num_processes=} is not a multiple of {num_machines=}: --num_processes counts the processes of all "
            "machines, each machine starts num_processes / num_machines"
        )
    return num_processes, num_machines


def _check_machines(args: argparse.Namespace, cluster: ClusterConfig | None, num_machines: int) -> None:
    """[Note: launch mistakes that hang] in launch_checks.py: refused here, before any rendezvous."""
    machine_rank = args.machine_rank if args.machine_rank is not None else getattr(cluster, "machine_rank", 0)
    main_ip = args.main_process_ip if args.main_process_ip is not None else getattr(cluster, "main_process_ip", None)
    problems = machine_problems(machine_rank, num_machines, main_ip)
    if problems:
        raise LaunchError("; ".join(problems))


def _check_before_spawn(built: BuiltConfig, world_size: int, parallelism: dict[str, Any] | None = None) -> None:
    """What would stop every rank at startup, found here instead: the `parallelism_config` block's sizes at the
    world size about to start, the batch rule there (its "auto" values aside: the integration fills them; the
    ranks sharing a sequence counted once) and NVMe folders that cannot exist on this machine."""
    config, problems = with_parallelism_block(built.zero_config, parallelism, world_size)
    problems += nvme_path_problems(built.deepspeed_config)
    try:
        resolve_leaving_auto(config, world_size)
    except ZeroConfigError as error:
        problems = [*error.problems, *problems]
    if problems:
        raise ZeroConfigError(problems)


def _check_multinode_launcher(args: argparse.Namespace, block: dict[str, Any], num_machines: int) -> None:
    launcher = args.deepspeed_multinode_launcher or block.get("deepspeed_multinode_launcher")
    if num_machines > 1 and launcher not in (None, "standard"):
        raise LaunchError(
            f"deepspeed_multinode_launcher={launcher!r} starts the other machines with DeepSpeed's runner, which "
            "needs deepspeed: accelerate-zero launch starts each machine's processes with torch.distributed.run "
            "(accelerate's 'standard' launcher); set deepspeed_multinode_launcher: standard and run "
            "accelerate-zero launch on every machine with its --machine_rank"
        )


def _translate(cluster: ClusterConfig | None, num_processes: int, num_machines: int) -> ClusterConfig:
    """The accelerate config accelerate's launcher gets: MULTI_GPU (NO for one process), no DeepSpeed block."""
    distributed_type = DistributedType.MULTI_GPU if num_processes > 1 or num_machines > 1 else DistributedType.NO
    if cluster is None:
        return ClusterConfig(
            compute_environment=ComputeEnvironment.LOCAL_MACHINE,
            distributed_type=distributed_type,
            mixed_precision="no",
            use_cpu=False,
            debug=False,
            num_processes=num_processes,
            num_machines=num_machines,
        )
    return dataclasses.replace(
        cluster,
        distributed_type=distributed_type,
        deepspeed_config={},
        num_processes=num_processes,
        num_machines=num_machines,
    )
