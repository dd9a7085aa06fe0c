"""`ZeroPlugin`: ZeRO settings in accelerate's plugin style, read from `accelerate-zero launch`'s environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accelerate_zero.config import ZeroConfig
from accelerate_zero.integrations.accelerate.deepspeed_build import build_deepspeed_config
from accelerate_zero.integrations.accelerate.deepspeed_env import adopt_accelerate_deepspeed_launch
from accelerate_zero.integrations.accelerate.plugin_fields import PLUGIN_FIELDS, coerce_fields
from accelerate_zero.integrations.accelerate.rank_env import CONFIG_ENV, env_name, read_env
from accelerate_zero.integrations.accelerate.zero_settings import ZeroSettings, read_deepspeed_config


@dataclass
class ZeroPlugin:
    """
    This plugin configures ZeRO for accelerate_zero. Its fields are those of accelerate's `DeepSpeedPlugin` that
    apply, and it builds the DeepSpeed config with the same rules (see `integrations/accelerate/deepspeed_build.py`).

    A field left `None` is read from the environment `accelerate-zero launch` sets (`ACCELERATE_ZERO_<FIELD>`, e.g.
    `ACCELERATE_ZERO_ZERO_STAGE`); an argument given here wins over the environment.

    Args:
        config (`str`, `os.PathLike`, `dict` or `ZeroConfig`, defaults to `None`):
            A DeepSpeed config: path to a .json/.yaml file, dict, or `ZeroConfig`. The fields fill its "auto" values
            (as accelerate's plugin does with a `deepspeed_config_file`); a field given here that contradicts one of
            its other values is an error. `None` reads `ACCELERATE_ZERO_CONFIG` (the launcher's config, a JSON
            string), whose values the fields given here replace; when that is unset too, the fields generate the
            config as accelerate does (batch sizes "auto").
        zero_stage (`int`, defaults to `None`):
            ZeRO stage: 0 (data parallel), 1 (shard optimizer states), 2 (also gradients), 3 (also parameters).
            `None` means the environment, else the config's, else 2.
        gradient_accumulation_steps (`int` or `"auto"`, defaults to `None`):
            Micro-batches per optimizer step. `None` means the environment, else "auto" (filled at prepare time).
        gradient_clipping (`float` or `"auto"`, defaults to `None`):
            Global gradient-norm clip, 0 disables. `None` means the environment, else "auto".
        offload_optimizer_device (`str`, defaults to `None`):
            Where optimizer states live: "none", "cpu" or "nvme". `None` means the environment, else "none".
        offload_param_device (`str`, defaults to `None`):
            Where parameter shards live (stage 3): "none", "cpu" or "nvme". `None` means the environment, else "none".
        offload_optimizer_nvme_path (`str`, defaults to `None`):
            Folder for optimizer state swap files; required with `offload_optimizer_device="nvme"`.
        offload_param_nvme_path (`str`, defaults to `None`):
            Folder for parameter swap files; required with `offload_param_device="nvme"`.
        zero3_init_flag (`bool`, defaults to `None`):
            Build the model already sharded (stage 3 only). `None` means the environment, else true at stage 3.
        zero3_save_16bit_model (`bool`, defaults to `None`):
            Gather the full 16-bit weights on the main process when saving (stage 3,
            `stage3_gather_16bit_weights_on_model_save`). `None` means the environment, else the config's, else false.

    Raises:
        ZeroConfigError: at construction, listing every problem of the resulting config.
    """

    config: str | os.PathLike[str] | Mapping[str, Any] | ZeroConfig | None = field(
        default=None,
        metadata={"help": "DeepSpeed config (path, dict or ZeroConfig); None reads ACCELERATE_ZERO_CONFIG"},
    )
    zero_stage: int | None = field(default=None, metadata={"help": "ZeRO stage 0-3 (default 2)"})
    gradient_accumulation_steps: int | str | None = field(
        default=None, metadata={"help": 'micro-batches per optimizer step, or "auto"'}
    )
    gradient_clipping: float | str | None = field(
        default=None, metadata={"help": 'global gradient-norm clip, or "auto"'}
    )
    offload_optimizer_device: str | None = field(default=None, metadata={"help": "none|cpu|nvme"})
    offload_param_device: str | None = field(default=None, metadata={"help": "none|cpu|nvme (stage 3)"})
    offload_optimizer_nvme_path: str | None = field(
        default=None, metadata={"help": "NVMe folder for optimizer states"}
    )
    offload_param_nvme_path: str | None = field(default=None, metadata={"help": "NVMe folder for parameters"})
    zero3_init_flag: bool | None = field(default=None, metadata={"help": "build the model sharded (stage 3)"})
    zero3_save_16bit_model: bool | None = field(
        default=None, metadata={"help": "gather 16-bit weights when saving (stage 3)"}
    )

    _env_fields: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _config_from_env: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        adopt_accelerate_deepspeed_launch()  # started by `accelerate launch` with a DeepSpeed config: its settings
        explicit = {name: getattr(self, name) for name in PLUGIN_FIELDS if getattr(self, name) is not None}
        typed = coerce_fields(explicit, {name: f"ZeroPlugin({name}=...)" for name in explicit})
        env_fields, env_config = read_env(os.environ)
        self._env_fields = frozenset(name for name in env_fields if name not in typed)
        for name, value in {**env_fields, **typed}.items():
            setattr(self, name, value)
        if self.config is None and env_config is not None:
            self.config, self._config_from_env = env_config, True
        self.zero_config()  # a bad setting fails here, as accelerate's plugins do

    def zero_config(self) -> ZeroConfig:
        """The DeepSpeed config these settings describe, validated but not resolved ("auto" values may remain).

        Raises:
            ZeroConfigError: listing every problem, each naming the setting.
        """
        return build_deepspeed_config(self._settings()).zero_config

    def deepspeed_config(self) -> dict[str, Any]:
        """The same config as a DeepSpeed JSON dict as written: only the keys given, "auto" values kept.

        Raises:
            ZeroConfigError: listing every problem, each naming the setting.
        """
        return build_deepspeed_config(self._settings()).deepspeed_config

    def _settings(self) -> ZeroSettings:
        sources = {
            name: env_name(name) if name in self._env_fields else f"ZeroPlugin({name}=...)"
            for name in PLUGIN_FIELDS
            if getattr(self, name) is not None
        }
        values = coerce_fields({name: getattr(self, name) for name in sources}, sources)  # fields may be reassigned
        settings = ZeroSettings(
            fields={k: v for k, v in values.items() if k not in self._env_fields},
            sources=sources,
            env_fields={k: v for k, v in values.items() if k in self._env_fields},
            fields_override_config=self._config_from_env,
        )
        if isinstance(self.config, ZeroConfig):
            settings.config, settings.config_label = self.config.to_dict(), "ZeroPlugin(config=ZeroConfig)"
        elif isinstance(self.config, Mapping):
            settings.config = dict(self.config)
            settings.config_label = CONFIG_ENV if self._config_from_env else "ZeroPlugin(config=dict)"
        elif self.config is not None:
            settings.config, settings.config_label = read_deepspeed_config(self.config), f"config {self.config}"
        return settings
