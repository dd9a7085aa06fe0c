"""Accelerate integration: `ZeroAccelerator`, `ZeroPlugin` and the `accelerate-zero launch` config translation.

`launcher.py` (the launch itself) imports accelerate's launcher and torch; it is not imported here.
"""

from accelerate_zero.integrations.accelerate.accelerator import ZeroAccelerator
from accelerate_zero.integrations.accelerate.launch_config import CONFIG_ENV, ENV_PREFIX
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin


__all__ = ["CONFIG_ENV", "ENV_PREFIX", "ZeroAccelerator", "ZeroPlugin"]
