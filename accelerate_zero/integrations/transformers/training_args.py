"""`ZeroTrainingArguments`: `TrainingArguments` with a `zero_config` (a DeepSpeed config) instead of `deepspeed`."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from accelerate_zero.config import ZeroConfig
from accelerate_zero.config.loading import ALIASES
from accelerate_zero.config.schema import is_auto
from accelerate_zero.engine.groups import has_accelerator
from accelerate_zero.integrations.accelerate.deepspeed_env import adopt_accelerate_deepspeed_launch
from accelerate_zero.integrations.accelerate.launch_config import CONFIG_ENV, read_deepspeed_config, same_value
from accelerate_zero.integrations.accelerate.parallelism import parallelism_from_launch
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin
from accelerate_zero.integrations.accelerate.rank_env import read_defaulted, read_launcher_precision
from accelerate_zero.integrations.transformers.auto_values import AutoFill, fill_from_training_args
from accelerate_zero.sequence.normalization import LossNormalization


logger = logging.getLogger(__name__)


CHECKPOINT_FORMATS = {"zero": None, "fsdp": "SHARDED_STATE_DICT", "fsdp_full": "FULL_STATE_DICT"}
"""`save_checkpoint_format` values, and the FSDP state_dict_type each writes (None: our engine's format)."""


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

    sequence_parallel_evaluation: bool = field(
        default=False,
        metadata={
            "help": (
                "Evaluate and predict over cut sequences too, under sequence parallelism: each rank's evaluation "
                "batch is scored across the sequence-parallel group as in training (the Trainer and ZeroSFTTrainer: "
                "eval_loss and predictions as without sp; ZeroGRPOTrainer and ZeroDPOTrainer: their metrics too); "
                "False: each rank evaluates its own whole sequences. Refused without sequence parallelism."
            )
        },
    )

    sequence_parallel_loss_normalization: str = field(
        default=LossNormalization.ACCUMULATED_TOKENS.value,
        metadata={
            "help": (
                "What the loss is divided by when sequences are cut (sequence parallelism or sequence_tiling): "
                "'accumulated_tokens' (default) the labelled tokens of the whole optimizer step on every rank, as the "
                "Trainer without it; 'deepspeed_alst' each micro-batch's token mean averaged over the accumulation "
                "steps, DeepSpeed ALST's rule (it weighs the tokens of short micro-batches more)."
            ),
            "choices": [rule.value for rule in LossNormalization],
        },
    )

    save_checkpoint_format: str = field(
        default="zero",
        metadata={
            "help": (
                "What a checkpoint-N folder holds beside the Trainer's own files: 'zero' (default) our engine's "
                "shards (zero_model/, any world size and stage); 'fsdp' what the transformers Trainer writes under "
                "FSDP with state_dict_type SHARDED_STATE_DICT (pytorch_model_fsdp_0/ and optimizer_0/, DCP); "
                "'fsdp_full' what it writes with FULL_STATE_DICT, its default (pytorch_model_fsdp.bin and "
                "optimizer.bin): an FSDP run resumes them with resume_from_checkpoint, and so does this Trainer."
            ),
            "choices": list(CHECKPOINT_FORMATS),
        },
    )

    def __post_init__(self) -> None:
        LossNormalization.parse(self.sequence_parallel_loss_normalization)
        if self.save_checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"save_checkpoint_format={self.save_checkpoint_format!r}: expected one of {list(CHECKPOINT_FORMATS)}"
            )
        adopt_accelerate_deepspeed_launch()  # before transformers builds a DeepSpeedPlugin from the environment
        if getattr(self, "parallelism_config", None) is None:  # before the Trainer's Accelerator reads the environment
            self.parallelism_config = parallelism_from_launch()
        self._take_deepspeed_argument()
        if isinstance(self.zero_config, ZeroConfig):
            self.zero_config = self.zero_config.to_dict()  # arguments are serialised to JSON (logging, hub)
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not has_accelerator():
            # [Note: process group under plain torchrun] (integrations/accelerate/accelerate_setup.py): without a GPU,
            # accelerate forms the gloo group only when told the run is on the CPU.
            self.use_cpu = True
        super().__post_init__()  # type: ignore[misc]
        self.fill_zero_config()

    def _take_deepspeed_argument(self) -> None:
        """`deepspeed=` (and `--deepspeed`, which transformers' parser still offers) is a DeepSpeed config, the
        format `zero_config` reads: take it as `zero_config`, so transformers never builds its DeepSpeed objects
        (they import deepspeed)."""
        deepspeed = getattr(self, "deepspeed", None)
        if not deepspeed:
            return
        if self.zero_config is not None and _as_dict(self.zero_config) != _as_dict(deepspeed):
            raise ValueError(
                f"deepspeed={deepspeed!r} and zero_config={self.zero_config!r} are two different ZeRO configs: "
                "deepspeed= is read as zero_config=, so pass only one of them"
            )
        self.zero_config, self.deepspeed = deepspeed, None
        if int(os.environ.get("RANK", "0")) == 0:
            logger.warning(
                "deepspeed=%r is used as zero_config: accelerate_zero's ZeRO engine trains with it (no deepspeed)",
                deepspeed,
            )

    def fill_zero_config(self) -> None:
        """Fills the config's "auto" values from these arguments (again after a hyperparameter-search trial changed
        them) and validates it (every problem listed), before any process starts training."""
        raw = self._written_zero_config()
        keep = self._launcher_precision(raw)
        self.zero_fill: AutoFill = fill_from_training_args(raw, self, self.auto_find_batch_size, keep)
        self.zero_plugin = ZeroPlugin(config=self.zero_fill.config)

    def _written_zero_config(self) -> dict[str, Any]:
        """The DeepSpeed config as written: this object's, else the launcher's, else accelerate's generated one."""
        if self.zero_config is not None:
            written = _as_dict(self.zero_config)
            launcher = os.environ.get(CONFIG_ENV)
            if launcher is not None:
                _refuse_conflicts(written, json.loads(launcher), self.zero_config, read_defaulted(os.environ))
            return written
        plugin = ZeroPlugin()
        if os.environ.get(CONFIG_ENV) is None:
            logger.info("no zero_config and no `accelerate-zero launch` config: ZeRO stage %s", plugin.zero_stage or 2)
        return plugin.deepspeed_config()

    def _launcher_precision(self, raw: dict[str, Any]) -> frozenset[str]:
        """[Note: the script's precision over the launcher's]
        transformers makes `TrainingArguments(fp16=True)` / `bf16=True` the run's mixed precision whatever the
        launcher's `mixed_precision` says (it hands `args.mixed_precision` to `DeepSpeedPlugin.set_mixed_precision`),
        and keeps the launcher's when the arguments set none. So for a config that came from the launcher, the
        precision keys its `mixed_precision` wrote become "auto" when the arguments set a precision (a DeepSpeed
        file's own fp16/bf16 blocks stay the user's: a different precision in the arguments is a conflict, as
        accelerate's `set_mixed_precision` refuses it), and every precision key is kept, unchecked, when the
        arguments set none. Returns the keys to keep unchecked."""
        if self.zero_config is not None:
            return frozenset()  # the script's own config: transformers' fill_match rules, unchanged
        launched = read_launcher_precision(os.environ)
        if not any(getattr(self, name, False) for name in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval")):
            return frozenset({"fp16.enabled", "bf16.enabled"}) if os.environ.get(CONFIG_ENV) else frozenset()
        own = [path for path in ("fp16.enabled", "bf16.enabled") if path not in launched]
        if any(_get_path(raw, path) is True for path in own):
            return frozenset()  # the file enables a precision: the fill reports any other as a mismatch
        for path in launched:
            block, key = path.split(".")
            if isinstance(raw.get(block), dict):
                raw[block][key] = "auto"
        return frozenset()

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


def _get_path(config: dict[str, Any], path: str) -> Any:
    block, key = path.split(".")
    return config[block].get(key) if isinstance(config.get(block), dict) else None


def _as_dict(config: dict | str | os.PathLike[str] | ZeroConfig) -> dict[str, Any]:
    if isinstance(config, ZeroConfig):
        return config.to_dict()
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return json.loads(config)  # transformers also takes the config as a JSON string
    return read_deepspeed_config(config)


def _refuse_conflicts(
    written: dict[str, Any], launcher: dict[str, Any], source: Any, defaulted: frozenset[str] = frozenset()
) -> None:
    """[Note: two config sources] `zero_config` (or `deepspeed`) and the config `accelerate-zero launch` exported
    (ACCELERATE_ZERO_CONFIG) both describe the run. The arguments' config is used; a key both set to different
    values (neither "auto") is an error naming both values, as transformers reports its "auto" mismatches. A key only
    one of them sets is no conflict, and neither is a launcher key in `defaulted`: accelerate's default that no file,
    flag or accelerate config chose (`accelerate-zero launch train.py` alone writes stage 2 and no offload; a script
    asking for stage 3 contradicts nobody)."""
    ours = _leaves(written)
    theirs = {path: value for path, value in _leaves(launcher).items() if path not in defaulted}
    conflicts = [
        f"- zero_config {path}={ours[path]!r} vs launcher {path}={theirs[path]!r}"
        for path in sorted(ours.keys() & theirs.keys())
        if not is_auto(ours[path]) and not is_auto(theirs[path]) and not same_value(ours[path], theirs[path])
    ]
    if conflicts:
        listed = "\n".join(conflicts)
        raise ValueError(
            f"The ZeRO config in the training arguments ({source!r}) and the one `accelerate-zero launch` exported "
            f"({CONFIG_ENV}, from its --config_file and flags) disagree:\n{listed}\nMake them agree, set these keys "
            'to "auto" in one of them, or drop one source (remove --zero_config/--deepspeed to use the launcher\'s).'
        )


def _leaves(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Key path -> value of every non-dict value, DeepSpeed's aliases written as their names; None values left out."""
    aliases = ALIASES.get(prefix.rstrip("."), {})
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = prefix + aliases.get(key, key)
        if isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        elif value is not None:
            out[path] = value
    return out
