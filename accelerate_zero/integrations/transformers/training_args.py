"""`ZeroTrainingArguments`: `TrainingArguments` with a `zero_config` (a DeepSpeed config) instead of `deepspeed`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from accelerate_zero.config import ZeroConfig
from accelerate_zero.engine.groups import has_accelerator
from accelerate_zero.integrations.accelerate.launch_config import CONFIG_ENV, read_deepspeed_config
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin
from accelerate_zero.integrations.transformers.auto_values import AutoFill, fill_from_training_args


logger = logging.getLogger(__name__)


@dataclass
class ZeroArgumentsMixin:
    """Adds `zero_config` to a `TrainingArguments` dataclass (transformers' own, or a subclass such as TRL's
    `SFTConfig`): `@dataclass class ZeroSFTConfig(ZeroArgumentsMixin, SFTConfig): pass`.

    After `__post_init__`, `zero_fill` holds the DeepSpeed config with the "auto" values that the arguments decide
    filled in (transformers' `trainer_config_process`); `ZeroTrainerMixin` fills the rest when training starts and
    raises the mismatches then, as transformers does.
    """

    zero_config: dict | str | None = field(
        default=None,
        metadata={
            "help": (
                "A DeepSpeed config for accelerate_zero's ZeRO engine: a .json/.yaml path or a dict (a ZeroConfig also "
                "works in Python). None uses the config `accelerate-zero launch --config_file ...` provided, else "
                "stage 2 with every value from these arguments."
            )
        },
    )

    def __post_init__(self) -> None:
        if getattr(self, "deepspeed", None):
            raise ValueError(
                f"deepspeed={self.deepspeed!r}: accelerate_zero's TrainingArguments do not use the `deepspeed` argument "
                "(it needs the deepspeed package); pass the same DeepSpeed config as zero_config=..."
            )
        if isinstance(self.zero_config, ZeroConfig):
            self.zero_config = self.zero_config.to_dict()  # arguments are serialised to JSON (logging, hub)
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not has_accelerator():
            # [Note: process group under plain torchrun] (integrations/accelerate/accelerator.py): without a GPU,
            # accelerate forms the gloo group only when told the run is on the CPU.
            self.use_cpu = True
        super().__post_init__()  # type: ignore[misc]
        self.fill_zero_config()

    def fill_zero_config(self) -> None:
        """Fills the config's "auto" values from these arguments (again after a hyperparameter-search trial changed
        them) and validates it (every problem listed), before any process starts training."""
        raw = self._written_zero_config()
        self.zero_fill: AutoFill = fill_from_training_args(raw, self, self.auto_find_batch_size)
        self.zero_plugin = ZeroPlugin(config=self.zero_fill.config)

    def _written_zero_config(self) -> dict[str, Any]:
        """The DeepSpeed config as written: this object's, else the launcher's, else accelerate's generated one."""
        if isinstance(self.zero_config, dict):
            return dict(self.zero_config)
        if self.zero_config is not None:
            return read_deepspeed_config(self.zero_config)
        plugin = ZeroPlugin()
        if os.environ.get(CONFIG_ENV) is None:
            logger.info("no zero_config and no `accelerate-zero launch` config: ZeRO stage %s", plugin.zero_stage or 2)
        return plugin.deepspeed_config()

    @property
    def place_model_on_device(self) -> bool:
        """False: the engine moves the model to the device (at stage 3, only this rank's shards)."""
        return False

    @property
    def zero_stage(self) -> int:
        return int(self.zero_plugin.zero_config().zero_optimization.stage)


@dataclass
class ZeroTrainingArguments(ZeroArgumentsMixin, TrainingArguments):
    """`transformers.TrainingArguments` plus `zero_config`; exported as `accelerate_zero.TrainingArguments`.

    Use with `accelerate_zero.Trainer`. On the command line (`HfArgumentParser`) the config is `--zero_config PATH`.
    The `deepspeed` argument is refused (it needs the deepspeed package): give the same config as `zero_config`.
    """
