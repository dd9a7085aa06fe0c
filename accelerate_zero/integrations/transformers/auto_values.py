"""The "auto" values of a DeepSpeed config filled from `TrainingArguments`, as transformers fills them.

transformers fills a DeepSpeed config in two passes (INTEGRATION_NOTES §2.2): when the `TrainingArguments` are
created (batch sizes, accumulation, clipping, optimizer and scheduler hyperparameters, fp16/bf16), and when
training starts and the model and the number of steps are known (the hidden-size bucket sizes, the scheduler's
step counts). A value that is not "auto" must equal the argument it corresponds to; every disagreement is
collected and reported in one error, worded as transformers words it, at the second pass.

Both passes work on the config as written (a plain dict): a key the user left out is not compared, and a block the
user left out (e.g. `optimizer`) is not created.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from accelerate_zero.config.fields import parse_number
from accelerate_zero.config.hidden_size import HIDDEN_SIZE_KEYS, hidden_size_autos
from accelerate_zero.config.resolve import data_parallel_size
from accelerate_zero.config.schema import is_auto


@dataclass
class AutoFill:
    """A DeepSpeed config (as written) being filled, and the disagreements found so far."""

    config: dict[str, Any]
    mismatches: list[str] = field(default_factory=list)

    def fill(self, path: str, value: Any, arg_name: str | None = None, must_match: bool = True) -> None:
        """Replaces an "auto" at `path` with `value`; otherwise, if `must_match`, records a value that differs.

        A path whose parent block is absent is skipped (transformers' `fill_match`).
        """
        node, key = self._node(path)
        if node is None:
            return
        if is_auto(node.get(key)):
            node[key] = value
            return
        written = node.get(key)
        if must_match and written is not None and not _same(written, value):
            self.mismatches.append(f"- ds {path}={written} vs hf {arg_name}={value}")

    def is_auto(self, path: str) -> bool:
        node, key = self._node(path)
        return node is not None and is_auto(node.get(key))

    def get(self, path: str) -> Any:
        node, key = self._node(path)
        return None if node is None else node.get(key)

    def _node(self, path: str) -> tuple[dict[str, Any] | None, str]:
        *parents, key = path.split(".")
        node: Any = self.config
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return (node, key) if isinstance(node, dict) else (None, key)

    def raise_mismatches(self) -> None:
        """transformers' error, listing every disagreement.

        Raises:
            ValueError: when any value disagrees with the training arguments.
        """
        if self.mismatches:
            listed = "\n".join(self.mismatches)
            raise ValueError(
                "Please correct the following DeepSpeed config values that mismatch TrainingArguments"
                f" values:\n{listed}\nThe easiest method is to set these DeepSpeed config values to 'auto'."
            )


def fill_from_training_args(
    config: dict[str, Any], args: Any, auto_find_batch_size: bool = False, keep: frozenset[str] = frozenset()
) -> AutoFill:
    """The first pass (transformers' `trainer_config_process`), on a copy of `config`.

    Args:
        config: the DeepSpeed config as written.
        args: the `TrainingArguments`.
        auto_find_batch_size: batch sizes then need not match (they change while searching).
        keep: `fp16.enabled` / `bf16.enabled` paths whose written value stands unchecked (the launcher's mixed
            precision when the arguments set none: [Note: the script's precision over the launcher's]).
    """
    fill = AutoFill(copy.deepcopy(config))
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    # Left out of the config (transformers' zero3 test config has neither): the Trainer's values, which it uses
    # anyway (accelerate would write 1 for both, and the engine's batch rule would then disagree with the run).
    fill.config.setdefault("train_micro_batch_size_per_gpu", "auto")
    fill.config.setdefault("gradient_accumulation_steps", "auto")
    fill.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", not auto_find_batch_size)
    fill.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    # the ranks of a sequence-parallel group share their batches (the config's size, else ParallelismConfig's)
    sequence = fill.config.get("sequence_parallel_size")
    if not isinstance(sequence, int):
        sequence = getattr(getattr(args, "parallelism_config", None), "sp_size", None) or 1
    fill.fill(
        "train_batch_size",
        data_parallel_size(args.world_size, sequence) * micro * accumulation,
        "train_batch_size (calculated)",
        not auto_find_batch_size,
    )
    fill.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    fill.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill.fill("scheduler.params.warmup_min_lr", 0, must_match=False)
    fill.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if args.save_on_each_node:
        fill.config.setdefault("checkpoint", {})["use_node_local_storage"] = True
    fp16, bf16 = bool(args.fp16 or args.fp16_full_eval), bool(args.bf16 or args.bf16_full_eval)
    fill.fill("fp16.enabled", fp16, "fp16|fp16_full_eval", must_match="fp16.enabled" not in keep)
    fill.fill("bf16.enabled", bf16, "bf16|bf16_full_eval", must_match="bf16.enabled" not in keep)
    return fill


def fill_from_model(fill: AutoFill, args: Any, model: Any, num_training_steps: int) -> None:
    """The second pass (transformers' `trainer_config_finalize`), in place; then raises every mismatch.

    Raises:
        ValueError: a hidden-size "auto" and a model config without a hidden size, or any mismatch of either pass.
    """
    stage3 = fill.get("zero_optimization.stage") == 3
    wanted = [key for key in HIDDEN_SIZE_KEYS if fill.is_auto(key)]
    if wanted:
        hidden = hidden_size_of(model)
        if hidden is None:
            raise ValueError(
                "The model's config file has neither `hidden_size` nor `hidden_sizes` entry, therefore it's not "
                f"possible to automatically fill out the following `auto` entries in the DeepSpeed config file: "
                f"{wanted}. You can fix that by replacing `auto` values for these keys with an integer value of "
                "your choice."
            )
        for key, value in hidden_size_autos(hidden, stage3=stage3).items():
            fill.fill(key, value, must_match=False)
    fill.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    fill.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    fill.raise_mismatches()


def hidden_size_of(model: Any) -> int | None:
    """The hidden size transformers uses for the bucket-size autos: the config's `hidden_size`, else the largest of
    `hidden_sizes`, else the same in `text_config`; None when there is none."""
    config = getattr(model, "config", None)
    for node in (config, getattr(config, "text_config", None)):
        if node is None:
            continue
        if getattr(node, "hidden_size", None) is not None:
            return int(node.hidden_size)
        if getattr(node, "hidden_sizes", None):
            return int(max(node.hidden_sizes))
    return None


def _same(written: Any, value: Any) -> bool:
    """Equal as values: "8" and 8 agree (transformers compares with `!=`, which reports them as different while
    printing them the same: INTEGRATION_NOTES §2.2), [0.9, 0.999] and (0.9, 0.999) agree."""
    if isinstance(written, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(written) == len(value) and all(_same(a, b) for a, b in zip(written, value, strict=True))
    if isinstance(written, bool) or isinstance(value, bool):
        return str(written).lower() == str(value).lower()
    a, b = parse_number(written), parse_number(value)
    if a is not None and b is not None:
        return a == b
    return written == value
