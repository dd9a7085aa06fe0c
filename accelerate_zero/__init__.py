"""accelerate_zero: ZeRO (stages 0-3, offload) in pure PyTorch for Accelerate and the transformers Trainer."""

from accelerate_zero.config import AUTO, ZeroConfig, ZeroConfigError
from accelerate_zero.engine.engine import ZeroEngine, initialize
from accelerate_zero.engine.gathered import GatheredParameters, register_external_parameter
from accelerate_zero.engine.stage3.loading import from_pretrained
from accelerate_zero.integrations.accelerate.accelerator import ZeroAccelerator


__version__ = "0.1.0"

__all__ = [
    "AUTO",
    "GatheredParameters",
    "ZeroAccelerator",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "__version__",
    "from_pretrained",
    "initialize",
    "register_external_parameter",
]
