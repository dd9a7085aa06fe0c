"""accelerate's `ParallelismConfig` (also `TrainingArguments(parallelism_config=...)`) mapped onto the engine's layout.

accelerate describes FSDP2's meshes with `dp_replicate_size` x `dp_shard_size`: `dp_shard_size` alone is fully
sharded, both together are HSDP (shard inside a group, replicate across the groups). The engine's equivalents
are flat stage 3 and replicate x shard, which DeepSpeed calls MiCS (`mics_shard_size`, engine/layout.py). Tensor,
context and sequence parallelism are other dimensions that this engine does not provide: asked for, they are
refused by name instead of being dropped.
"""

from __future__ import annotations

from typing import Any


def zero_keys_from_parallelism(parallelism: Any, world_size: int) -> dict[str, Any]:
    """The `zero_optimization` keys a `ParallelismConfig` asks for ({} for plain data parallelism).

    Raises:
        ValueError: a dimension other than data parallelism is asked for, or the sizes do not multiply to the
            world size.
    """
    if parallelism is None:
        return {}
    others = {
        name: getattr(parallelism, name, None)
        for name in ("tp_size", "cp_size", "sp_size")
        if (getattr(parallelism, name, None) or 1) > 1
    }
    if others:
        sizes = ", ".join(f"{name}={value}" for name, value in others.items())
        raise ValueError(
            f"ParallelismConfig({sizes}): accelerate_zero shards over data parallelism only (dp_replicate_size x "
            "dp_shard_size); remove these sizes, or train them under accelerate's own FSDP2"
        )
    replicate = parallelism.dp_replicate_size or 1
    shard = parallelism.dp_shard_size or (world_size // replicate)
    if replicate * shard != world_size:
        raise ValueError(
            f"ParallelismConfig(dp_replicate_size={parallelism.dp_replicate_size}, dp_shard_size="
            f"{parallelism.dp_shard_size}): {replicate} x {shard} != the {world_size} processes; make the product "
            "the number of processes"
        )
    return {"mics_shard_size": shard} if replicate > 1 else {}


def with_zero_keys(config: Any, keys: dict[str, Any], source: str) -> Any:
    """`config` (a `ZeroConfig`) with `keys` written into its `zero_optimization`; a different value already there is
    an error naming both.

    Raises:
        ValueError: the config sets one of `keys` to another value.
    """
    if not keys:
        return config
    raw = config.to_dict()
    zero = raw.setdefault("zero_optimization", {})
    # mics_shard_size <= 0 is DeepSpeed's "off": not a value the config chose
    clashes = [
        f"zero_optimization.{key}={zero[key]!r} vs {source} {value!r}"
        for key, value in keys.items()
        if zero.get(key) not in (None, -1, 0) and zero[key] != value
    ]
    if clashes:
        raise ValueError(f"the ZeRO config and {source} disagree: {'; '.join(clashes)}: keep one of them")
    zero.update(keys)
    return type(config).from_any(raw)
