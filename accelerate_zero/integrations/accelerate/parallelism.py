"""accelerate's `ParallelismConfig` (also `TrainingArguments(parallelism_config=...)`) mapped onto the engine's layout.

accelerate describes FSDP2's meshes with `dp_replicate_size` x `dp_shard_size`: `dp_shard_size` alone is fully
sharded, both together are HSDP (shard inside a group, replicate across the groups). The engine's equivalents
are flat stage 3 and replicate x shard, which DeepSpeed calls MiCS (`mics_shard_size`, engine/layout.py).
`sp_size` with `sp_backend="deepspeed"` (ALST/Ulysses) is the engine's `sequence_parallel_size`
(accelerate_zero/sequence). Tensor and context parallelism are other dimensions that this engine does not
provide: asked for, they are refused by name instead of being dropped.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any


SEQUENCE_BACKENDS = ("deepspeed", "accelerate_zero")
USE_PARALLELISM_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"
ADOPTED_PARALLELISM_ENV = "ACCELERATE_ZERO_PARALLELISM_FROM_LAUNCH"


# [Note: adopting accelerate's parallelism launch] An accelerate config with a `parallelism_config` block (DeepSpeed's
# ALST recipe: `parallelism_config_sp_size: 2`, `parallelism_config_sp_backend: deepspeed`), launched by
# `accelerate launch` or `accelerate-zero launch`, reaches the ranks as `ACCELERATE_USE_PARALLELISM_CONFIG=true` and
# `PARALLELISM_CONFIG_*` variables, from which `Accelerator()` builds a `ParallelismConfig` of its own: on the CPU it
# then refuses to start (MULTI_CPU), and on GPUs it would build FSDP2's meshes the engine never reads, training
# without the sizes asked for. The first ZeroAccelerator or `TrainingArguments` of the process switches that flag off
# in this process (as [Note: adopting accelerate's DeepSpeed launch] does for DeepSpeed) and marks the process as
# launched so; each of them then builds the config with accelerate's class (it reads the variables) and maps it onto
# the engine's layout like a `parallelism_config=` argument.
def parallelism_from_launch() -> Any:
    """The `ParallelismConfig` the launch environment asks for, or None ([Note: adopting accelerate's parallelism
    launch]); accelerate itself no longer builds one from the environment afterwards."""
    if os.environ.get(USE_PARALLELISM_ENV, "false").lower() == "true":
        os.environ[ADOPTED_PARALLELISM_ENV] = "true"
        os.environ[USE_PARALLELISM_ENV] = "false"
    if os.environ.get(ADOPTED_PARALLELISM_ENV) != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()


# [Note: data parallelism derived from the processes] accelerate fills every size left out with 1 (`ParallelismConfig()`
# has dp_shard_size=1, and an ALST recipe's YAML often writes `dp_shard_size: 1`), and its DeepSpeed sequence-parallel
# path then ignores the data-parallel sizes: DeepSpeed's ALST takes data parallelism to be processes / sp_size. So do
# we: dp = world / sp, and a dp_shard_size of 1 is "left to derive" (dp / dp_replicate_size), as no rank count can make
# a 1 there mean anything else. A size that contradicts dp (dp_shard_size=4 with sp_size=2 on 4 processes) is refused
# naming both and the fix, by `validate`, `doctor` and the launcher before any process starts (launch_checks.py), and
# by every rank otherwise.
def layout_sizes(parallelism: Any, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, sp) of `parallelism` on `world_size` processes ([Note: data parallelism derived from
    the processes]).

    Raises:
        ValueError: a dimension other than data and sequence parallelism is asked for, sp_size does not divide the
            processes, or the data-parallel sizes contradict processes / sp_size.
    """
    others = {
        name: getattr(parallelism, name, None)
        for name in ("tp_size", "cp_size")
        if (getattr(parallelism, name, None) or 1) > 1
    }
    sequence = int(getattr(parallelism, "sp_size", None) or 1)
    backend = getattr(parallelism, "sp_backend", None) or "deepspeed"
    if sequence > 1 and backend not in SEQUENCE_BACKENDS:
        others["sp_backend"] = backend
    if others:
        sizes = ", ".join(f"{name}={value}" for name, value in others.items())
        raise ValueError(
            f"ParallelismConfig({sizes}): accelerate_zero shards over data parallelism only (dp_replicate_size x "
            "dp_shard_size); remove these sizes, or train them under accelerate's own FSDP2"
        )
    if world_size % sequence:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"ParallelismConfig(sp_size={sequence}) on {world_size} processes: the ranks sharing a sequence must "
            f"divide the processes (data parallelism is processes / sp_size, as in DeepSpeed's ALST); use an sp_size "
            f"among {divisors}, or launch a multiple of {sequence} processes"
        )
    data = world_size // sequence
    replicate = int(parallelism.dp_replicate_size or 1)
    shard = int(parallelism.dp_shard_size or 1)
    if shard == 1 and data % replicate == 0:
        shard = data // replicate  # accelerate's 1: derived
    if replicate * shard != data:
        fix = (
            f"remove dp_shard_size (it is derived: {data // replicate}) or set it to {data // replicate}"
            if data % replicate == 0
            else f"set dp_replicate_size to a divisor of {data}"
        )
        raise ValueError(
            f"ParallelismConfig(dp_replicate_size={parallelism.dp_replicate_size}, dp_shard_size="
            f"{parallelism.dp_shard_size}, sp_size={sequence}) on {world_size} processes: data parallelism is "
            f"processes / sp_size = {data} (DeepSpeed ALST's rule), and dp_replicate_size x dp_shard_size = "
            f"{replicate * int(parallelism.dp_shard_size or 1)} contradicts it; {fix}"
        )
    return replicate, shard, sequence


def zero_keys_from_parallelism(parallelism: Any, world_size: int) -> dict[str, Any]:
    """The config keys a `ParallelismConfig` asks for ({} for plain data parallelism): `zero_optimization` keys,
    and `sequence_parallel_size` at the top level.

    Raises:
        ValueError: as `layout_sizes`.
    """
    if parallelism is None:
        return {}
    replicate, shard, sequence = layout_sizes(parallelism, world_size)
    keys: dict[str, Any] = {"sequence_parallel_size": sequence} if sequence > 1 else {}
    if replicate > 1:
        # ZeRO shards over the sequence-parallel ranks too (as DeepSpeed's ALST does): a group is dp_shard x sp
        keys["zero_optimization"] = {"mics_shard_size": shard * sequence}
    return keys


def parallelism_from_block(block: dict[str, Any] | None) -> Any:
    """An accelerate config file's `parallelism_config` block (`parallelism_config_sp_size: 2`, ...) as the sizes
    the ranks' `ParallelismConfig()` will read from the launch environment; None for an empty block."""
    if not block:
        return None
    prefix = "parallelism_config_"
    values = {key[len(prefix) :] if key.startswith(prefix) else key: value for key, value in block.items()}
    sizes = {name: int(values.get(name) or 1) for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")}
    sizes["sp_size"] = int(values.get("sp_size") or 1)
    return SimpleNamespace(**sizes, sp_backend=values.get("sp_backend") or "deepspeed")  # accelerate's defaults


def with_zero_keys(config: Any, keys: dict[str, Any], source: str) -> Any:
    """`config` (a `ZeroConfig`) with `keys` (from `zero_keys_from_parallelism`) written into it; a different value
    already there is an error naming both.

    Raises:
        ValueError: the config sets one of `keys` to another value.
    """
    if not keys:
        return config
    raw = config.to_dict()
    # Values that mean "off" (mics_shard_size <= 0, sequence_parallel_size 1) are not values the config chose.
    written = {
        f"zero_optimization.{k}": (raw["zero_optimization"].get(k), v)
        for k, v in keys.get("zero_optimization", {}).items()
    }
    if "sequence_parallel_size" in keys:
        written["sequence_parallel_size"] = (raw.get("sequence_parallel_size"), keys["sequence_parallel_size"])
    clashes = [
        f"{key}={ours!r} vs {source} {theirs!r}"
        for key, (ours, theirs) in written.items()
        if ours not in (None, -1, 0, 1) and ours != theirs
    ]
    if clashes:
        raise ValueError(f"the ZeRO config and {source} disagree: {'; '.join(clashes)}: keep one of them")
    raw["zero_optimization"].update(keys.get("zero_optimization", {}))
    if "sequence_parallel_size" in keys:
        raw["sequence_parallel_size"] = keys["sequence_parallel_size"]
    return type(config).from_any(raw)
