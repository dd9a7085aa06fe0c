"""DeepSpeed-compatible ZeRO config: `ZeroConfig.from_any` to load, `resolve_config` to make it concrete."""

from accelerate_zero.config.resolve import ResolvedZeroConfig, data_parallel_ranks, resolve_config
from accelerate_zero.config.schema import AUTO, ZeroConfig, ZeroConfigError


__all__ = ["AUTO", "ResolvedZeroConfig", "ZeroConfig", "ZeroConfigError", "data_parallel_ranks", "resolve_config"]
