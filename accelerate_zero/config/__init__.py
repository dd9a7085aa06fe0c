"""DeepSpeed-compatible ZeRO config: `ZeroConfig.from_any` to load, `resolve_config` to make it concrete."""

from accelerate_zero.config.resolve import resolve_config
from accelerate_zero.config.schema import AUTO, ZeroConfig, ZeroConfigError


__all__ = ["AUTO", "ZeroConfig", "ZeroConfigError", "resolve_config"]
