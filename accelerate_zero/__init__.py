"""accelerate_zero: ZeRO (stages 0-3, offload) in pure PyTorch for Accelerate and the transformers Trainer."""

from accelerate_zero.config import AUTO, ZeroConfig, ZeroConfigError
from accelerate_zero.engine.engine import ZeroEngine, initialize
from accelerate_zero.engine.gathered import GatheredParameters, register_external_parameter
from accelerate_zero.engine.stage3.loading import from_pretrained
from accelerate_zero.integrations.accelerate.accelerator import ZeroAccelerator


__version__ = "0.1.0"

# The Trainer integration imports transformers' Trainer (seconds): loaded on first use.
_TRAINER_NAMES = {
    "Trainer": "ZeroTrainer",
    "TrainingArguments": "ZeroTrainingArguments",
    "ZeroArgumentsMixin": "ZeroArgumentsMixin",
    "ZeroTrainer": "ZeroTrainer",
    "ZeroTrainerMixin": "ZeroTrainerMixin",
    "ZeroTrainingArguments": "ZeroTrainingArguments",
}


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        from accelerate_zero.integrations import transformers as integration

        return getattr(integration, _TRAINER_NAMES[name])
    raise AttributeError(f"module 'accelerate_zero' has no attribute {name!r}")


__all__ = [
    "AUTO",
    "GatheredParameters",
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
    "__version__",
    "from_pretrained",
    "initialize",
    "register_external_parameter",
]
