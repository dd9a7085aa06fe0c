"""transformers integration: `ZeroTrainingArguments` (`zero_config`), `ZeroTrainer` and `ZeroTrainerMixin`."""

from accelerate_zero.integrations.transformers.trainer import ZeroTrainer, ZeroTrainerMixin, last_complete_checkpoint
from accelerate_zero.integrations.transformers.training_args import ZeroArgumentsMixin, ZeroTrainingArguments


__all__ = [
    "ZeroArgumentsMixin",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "ZeroTrainingArguments",
    "last_complete_checkpoint",
]
