"""Checks on a built DeepSpeed config before any process starts: the `resolve_config` rules, the
`parallelism_config` block's sizes, NVMe folders, the machine flags and hierarchical groups spanning nodes.

`accelerate-zero launch`, `validate` and `doctor` run them so that a config that cannot work fails once, here,
instead of on every rank; what only a rank can know (the Trainer's "auto" values, a writable NVMe folder) is left
to the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from accelerate_zero.config import ZeroConfig, resolve_config
from accelerate_zero.integrations.accelerate.parallelism import (
    parallelism_from_block,
    with_zero_keys,
    zero_keys_from_parallelism,
)
from accelerate_zero.integrations.accelerate.plugin_fields import OFFLOAD_BLOCKS, find_node


class Resolved(NamedTuple):
    """A config resolved for a world size with its "auto" values left to the integration that fills them."""

    config: dict[str, Any]
    """The resolved DeepSpeed config (JSON form) with each "auto" value put back as "auto"."""
    auto_keys: list[str]
    """Dotted keys still "auto": the Trainer / `ZeroAccelerator.prepare` fill them when the run starts."""


def resolve_leaving_auto(config: ZeroConfig | Mapping[str, Any], world_size: int) -> Resolved:
    """Applies every rule `resolve_config` applies at `world_size` to the values that are set, leaving "auto" alone.

    An "auto" value is dropped for the check (the rules then see the default, or infer the batch size DeepSpeed's
    way) and put back in the result, so a config the Trainer will complete passes while a rule that cannot hold
    whatever the Trainer fills (`train_batch_size` 32 with micro 4 x accumulation 8 x 2 processes) fails here,
    before any process starts, instead of on every rank.

    Raises:
        ZeroConfigError: every problem `resolve_config` finds in the values that are set.
    """
    validated = config if isinstance(config, ZeroConfig) else ZeroConfig.from_any(dict(config))
    autos = validated.auto_keys()
    concrete = validated.to_dict()
    # The optimizer and scheduler blocks were checked by `from_any`, where an "auto" counts as given (the Trainer
    # fills WarmupDecayLR's total_num_steps when training starts); no run-time rule reads them, and dropping their
    # "auto" values would make a required parameter look missing. They are put back as written.
    written = {name: concrete.pop(name) for name in _CHECKED_AT_LOAD if concrete.get(name) is not None}
    for path in autos:
        node, key = find_node(concrete, path)
        if node is not None:
            del node[key]
    resolved = resolve_config(ZeroConfig.from_any(concrete), world_size=world_size).to_dict()
    for path in autos:
        node, key = find_node(resolved, path)
        if isinstance(node, dict):
            node[key] = "auto"
    resolved.update(written)
    return Resolved(resolved, autos)


_CHECKED_AT_LOAD = ("optimizer", "scheduler")


def with_parallelism_block(
    config: ZeroConfig, block: Mapping[str, Any] | None, world_size: int
) -> tuple[ZeroConfig, list[str]]:
    """`config` with the sizes an accelerate config's `parallelism_config` block asks for at `world_size` (the keys
    each rank's `ParallelismConfig()` will add: [Note: data parallelism derived from the processes] in
    parallelism.py), and the problems that would stop every rank at startup instead."""
    try:
        keys = zero_keys_from_parallelism(parallelism_from_block(dict(block or {})), world_size)
        return with_zero_keys(config, keys, "the accelerate config's parallelism_config"), []
    except ValueError as error:
        return config, [f"parallelism_config: {error}"]


def nvme_path_problems(config: Mapping[str, Any]) -> list[str]:
    """NVMe folders that cannot exist on this machine: a path below a regular file (e.g. `/data/ckpt.bin/swap`).

    Checked by the launcher before it starts any process; the ranks check the rest (writable, room) themselves.
    """
    zero = config.get("zero_optimization")
    problems = []
    for block in OFFLOAD_BLOCKS:
        offload = zero.get(block) if isinstance(zero, Mapping) else None
        if not isinstance(offload, Mapping) or str(offload.get("device")).lower() != "nvme":
            continue
        path = offload.get("nvme_path")
        if not isinstance(path, str) or path.lower() == "none":
            continue
        blocker = next((p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            problems.append(
                f"zero_optimization.{block}.nvme_path={path!r}: {str(blocker)!r} is a file, not a folder, so no "
                "folder can be made there: set the path to a folder on a fast local disk"
            )
    return problems


# [Note: launch mistakes that hang]
# With --num_machines > 1 every machine runs the launcher with its --machine_rank, and torch.distributed.run waits at
# the rendezvous until all of them have joined the address of machine 0 (--main_process_ip). A machine rank outside
# [0, num_machines) never completes the rendezvous (machine ranks 0..n-1 are waited for), and a launch without the
# address makes each machine wait on its own localhost: both hang without a word until killed. They are refused in
# the launcher, before anything starts.


def machine_problems(machine_rank: Any, num_machines: int, main_process_ip: str | None) -> list[str]:
    """The machine flags that would leave the rendezvous waiting forever ([Note: launch mistakes that hang]).

    Args:
        machine_rank: --machine_rank (or the accelerate config's `machine_rank`).
        num_machines: --num_machines (or the accelerate config's).
        main_process_ip: --main_process_ip (or the accelerate config's); None when not given.
    """
    problems = []
    if not isinstance(machine_rank, int) or isinstance(machine_rank, bool) or not 0 <= machine_rank < num_machines:
        problems.append(
            f"--machine_rank {machine_rank} is outside --num_machines {num_machines}: machines are numbered 0 to "
            f"{num_machines - 1}; give each machine its own --machine_rank in that range"
        )
    if num_machines > 1 and not main_process_ip:
        problems.append(
            f"--num_machines {num_machines} without --main_process_ip: every machine (machine rank "
            f"{machine_rank} too) must be given the address of machine 0, where the processes meet; without it each "
            "machine waits on its own and the launch hangs. Pass --main_process_ip (and --main_process_port) on "
            "every machine"
        )
    return problems


def node_span_warnings(config: ZeroConfig, world_size: int, num_machines: int) -> list[str]:
    """hpZ and MiCS groups larger than a node, with their cost. DeepSpeed accepts them silently (its groups are
    consecutive ranks, whatever the node), so they are accepted here too, with a warning naming the cost."""
    per_node = world_size // max(num_machines, 1)
    zero = config.zero_optimization
    if num_machines <= 1 or zero.stage != 3:
        return []
    warnings = []
    hpz, mics = zero.zero_hpz_partition_size, zero.mics_shard_size
    if isinstance(hpz, int) and hpz > 1 and (hpz > per_node or per_node % hpz):
        warnings.append(
            f"zero_optimization.zero_hpz_partition_size={hpz} spans nodes ({per_node} processes per node): the "
            "secondary partition backward gathers from then lies on several nodes, so backward's all-gathers cross "
            f"nodes, which hpZ exists to avoid; set it to {per_node} (the processes per node) or a divisor of it"
        )
    if isinstance(mics, int) and mics > 0 and (mics > per_node or per_node % mics):
        warnings.append(
            f"zero_optimization.mics_shard_size={mics} spans nodes ({per_node} processes per node): every gather of "
            f"a shard group then crosses nodes (DeepSpeed's two-level gather for that case is not built); set it to "
            f"{per_node} (the processes per node) or a divisor of it, or leave MiCS off"
        )
    return warnings
