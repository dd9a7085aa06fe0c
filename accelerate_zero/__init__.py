"""accelerate_zero: ZeRO (stages 0-3, offload) in pure PyTorch for Accelerate and the transformers Trainer."""

import importlib
from typing import TYPE_CHECKING

from accelerate_zero.config import AUTO, ZeroConfig, ZeroConfigError
from accelerate_zero.engine.engine import ZeroEngine, initialize
from accelerate_zero.engine.gathered import GatheredParameters, register_external_parameter
from accelerate_zero.engine.sleep import OffloadDeviceEnum, OffloadStateTypeEnum
from accelerate_zero.engine.stage3.loading import from_pretrained


if TYPE_CHECKING:
    from accelerate_zero.integrations.accelerate.accelerator import ZeroAccelerator
    from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin

__version__ = "0.1.0"

# The integrations import their libraries (accelerate: ~3 MB of modules; transformers' Trainer: seconds), which the
# engine alone does not need: each public name below is loaded from its module on first use.
_ACCELERATE = "accelerate_zero.integrations.accelerate"
_TRANSFORMERS = "accelerate_zero.integrations.transformers"
_LAZY_NAMES = {
    "ZeroAccelerator": (_ACCELERATE, "ZeroAccelerator"),
    "ZeroPlugin": (_ACCELERATE, "ZeroPlugin"),
    "Trainer": (_TRANSFORMERS, "ZeroTrainer"),
    "TrainingArguments": (_TRANSFORMERS, "ZeroTrainingArguments"),
    "ZeroArgumentsMixin": (_TRANSFORMERS, "ZeroArgumentsMixin"),
    "ZeroTrainer": (_TRANSFORMERS, "ZeroTrainer"),
    "ZeroTrainerMixin": (_TRANSFORMERS, "ZeroTrainerMixin"),
    "ZeroTrainingArguments": (_TRANSFORMERS, "ZeroTrainingArguments"),
}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        module, attribute = _LAZY_NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'accelerate_zero' has no attribute {name!r}")


__all__ = [
    "AUTO",
    "GatheredParameters",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "Trainer",
    "TrainingArguments",
    "ZeroArgumentsMixin",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "ZeroTrainingArguments",
    "ZeroAccelerator",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "ZeroPlugin",
    "__version__",
    "from_pretrained",
    "initialize",
    "register_external_parameter",
]
