"""Accelerate integration: `ZeroAccelerator`, `ZeroPlugin` and the `accelerate-zero launch` config translation.

`launcher.py` (the launch itself) imports accelerate's launcher and torch; it is not imported here.
"""

from accelerate_zero.integrations.accelerate.accelerator import ZeroAccelerator
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin
from accelerate_zero.integrations.accelerate.rank_env import CONFIG_ENV, ENV_PREFIX


__all__ = ["CONFIG_ENV", "ENV_PREFIX", "ZeroAccelerator", "ZeroPlugin"]
