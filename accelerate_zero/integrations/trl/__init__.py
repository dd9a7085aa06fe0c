"""TRL trainers on the ZeRO engine: change one import.

    from accelerate_zero.integrations.trl import SFTConfig, SFTTrainer   # was: from trl import SFTConfig, SFTTrainer

`ZeroSFTTrainer`/`ZeroDPOTrainer`/`ZeroGRPOTrainer` (also exported under TRL's names) and their configs, which take
`zero_config` (or `deepspeed`, read as `zero_config`). Importing this module needs TRL installed.
"""

from accelerate_zero.integrations.trl.trainers import (
    ZeroDistributedBackend,
    ZeroDPOConfig,
    ZeroDPOTrainer,
    ZeroGRPOConfig,
    ZeroGRPOTrainer,
    ZeroSFTConfig,
    ZeroSFTTrainer,
    ZeroTRLMixin,
)


DPOConfig, DPOTrainer = ZeroDPOConfig, ZeroDPOTrainer
GRPOConfig, GRPOTrainer = ZeroGRPOConfig, ZeroGRPOTrainer
SFTConfig, SFTTrainer = ZeroSFTConfig, ZeroSFTTrainer

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "SFTConfig",
    "SFTTrainer",
    "ZeroDPOConfig",
    "ZeroDPOTrainer",
    "ZeroDistributedBackend",
    "ZeroGRPOConfig",
    "ZeroGRPOTrainer",
    "ZeroSFTConfig",
    "ZeroSFTTrainer",
    "ZeroTRLMixin",
]
