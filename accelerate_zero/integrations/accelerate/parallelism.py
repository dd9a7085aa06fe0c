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


def zero_keys_from_parallelism(parallelism: Any, world_size: int) -> dict[str, Any]:
    """The config keys a `ParallelismConfig` asks for ({} for plain data parallelism): `zero_optimization` keys,
    and `sequence_parallel_size` at the top level.

    Raises:
        ValueError: a dimension other than data parallelism is asked for, or the sizes do not multiply to the
            world size.
    """
    if parallelism is None:
        return {}
    others = {
        name: getattr(parallelism, name, None)
        for name in ("tp_size", "cp_size")
        if (getattr(parallelism, name, None) or 1) > 1
    }
    sequence = getattr(parallelism, "sp_size", None) or 1
    backend = getattr(parallelism, "sp_backend", None) or "deepspeed"
    if sequence > 1 and backend not in SEQUENCE_BACKENDS:
        others["sp_backend"] = backend
    if others:
        sizes = ", ".join(f"{name}={value}" for name, value in others.items())
        raise ValueError(
            f"ParallelismConfig({sizes}): accelerate_zero shards over data parallelism only (dp_replicate_size x "
            "dp_shard_size); remove these sizes, or train them under accelerate's own FSDP2"
        )
    replicate = parallelism.dp_replicate_size or 1
    shard = parallelism.dp_shard_size or (world_size // (replicate * sequence))
    if replicate * shard * sequence != world_size:
        raise ValueError(
            f"ParallelismConfig(dp_replicate_size={parallelism.dp_replicate_size}, dp_shard_size="
            f"{parallelism.dp_shard_size}, sp_size={sequence}): {replicate} x {shard} x {sequence} != the "
            f"{world_size} processes; make the product the number of processes"
        )
    keys: dict[str, Any] = {"sequence_parallel_size": sequence} if sequence > 1 else {}
    if replicate > 1:
        # ZeRO shards over the sequence-parallel ranks too (as DeepSpeed's ALST does): a group is dp_shard x sp
        keys["zero_optimization"] = {"mics_shard_size": shard * sequence}
    return keys


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
