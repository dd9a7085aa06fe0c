"""`ZeroTrainerMixin` / `ZeroTrainer`: the transformers `Trainer` training with accelerate_zero's ZeRO engine.

The Trainer keeps its loop; what it does with DeepSpeed (INTEGRATION_NOTES §2.1, §2.6) is done here with a
`ZeroAccelerator`, overriding only the methods that touch the model's training state:

* `create_accelerator_and_postprocess`: a `ZeroAccelerator` replaces the plain `Accelerator`. The Trainer keeps
  owning gradient accumulation (it divides the loss and marks the boundary; the engine steps on it).
* `_prepare_for_training`: the second "auto" pass (hidden size, step counts) and its mismatch error, the config's
  `optimizer`/`scheduler` blocks (built by the engine) or the Trainer's own optimizer and scheduler, one `prepare`
  of model and optimizer, then resuming from an engine checkpoint (any world size, any stage).
* Saving: `save_model` gathers the 16-bit weights (adapters only for a PEFT model); a checkpoint folder holds every
  rank's shards (`zero_model/`) next to Trainer's own files, and counts as complete only once `trainer_state.json`
  is written, so `resume_from_checkpoint=True` never picks a half-written one. With `checkpoint.writer.decoupled`
  the engine state is written in the background and the rotation waits for it ([Note: the Trainer's asynchronous
  saves] in checkpoint_saves.py). `resume_from_checkpoint` may also name a `checkpoint-N` the transformers Trainer
  wrote under DeepSpeed or FSDP, or a DCP folder written by FSDP2 or torchtitan.
* Evaluation/prediction before training prepares the model for inference (sharded at stage 3); `train()` undoes it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # importable without deepspeed
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from accelerate_zero.checkpoint import dcp_read
from accelerate_zero.checkpoint.accelerate_fsdp_save import save_fsdp
from accelerate_zero.checkpoint.hf_export import save_pretrained_parallel
from accelerate_zero.checkpoint.io import partial_dir, resolve_tag
from accelerate_zero.checkpoint.model_export import export_files, not_a_checkpoint
from accelerate_zero.integrations.accelerate.accelerator import ZeroAccelerator
from accelerate_zero.integrations.accelerate.checkpointing import CHECKPOINT_TAG, exports_in_parallel, saved_tag
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin
from accelerate_zero.integrations.accelerate.prepared import ZeroSchedulerWrapper
from accelerate_zero.integrations.transformers import checkpoint_saves
from accelerate_zero.integrations.transformers.auto_values import fill_from_model
from accelerate_zero.integrations.transformers.checkpoint_files import verify_manifest, write_manifest
from accelerate_zero.integrations.transformers.sequence_steps import SequenceParallelStepsMixin
from accelerate_zero.integrations.transformers.training_args import CHECKPOINT_FORMATS, ZeroArgumentsMixin
from accelerate_zero.sequence.loader import TOKEN_MASK
from accelerate_zero.sequence.normalization import LossNormalization


logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.pt"
_CHECKPOINT_FOLDER = re.compile(r"^checkpoint-(\d+)$")
_DCP_RESUME = "_zero_dcp_resume"


class ZeroTrainerMixin(SequenceParallelStepsMixin):
    """Makes a `transformers.Trainer` subclass train with the ZeRO engine: `class MyTrainer(ZeroTrainerMixin, SFTTrainer)`.

    The arguments must carry a ZeRO config: `accelerate_zero.TrainingArguments` (or any `TrainingArguments`
    subclass with `ZeroArgumentsMixin`). Stages 0-3 and every offload mode; the config's `optimizer`/`scheduler`
    blocks are built by the engine, otherwise the Trainer's own optimizer and scheduler are used.
    """

    accelerator: ZeroAccelerator

    # ------------------------------------------------------------- accelerator
    def create_accelerator_and_postprocess(self) -> None:
        if not isinstance(self.args, ZeroArgumentsMixin):
            raise TypeError(
                f"{type(self).__name__} trains with ZeRO and needs accelerate_zero.TrainingArguments (or a "
                f"TrainingArguments subclass with accelerate_zero.ZeroArgumentsMixin); got {type(self.args).__name__}"
            )
        # [Note: the Trainer's accelerator] Trainer builds a plain `Accelerator` from arguments it computes in
        # several steps (accumulation plugin, dataloader config, kwargs handlers). We let it, with mixed precision
        # "no" (the engine owns precision, and accelerate's state keeps the first value it is given), and then
        # build the ZeroAccelerator from the same arguments: both share accelerate's process state, so the first
        # one costs nothing but the object.
        if getattr(self, "_zero_new_trial", False):
            self.args.fill_zero_config()  # the trial's learning rate, batch size, ... into the config's "auto"s
        super().create_accelerator_and_postprocess()
        kwargs = dict(self._zero_accelerator_kwargs)
        self.accelerator = ZeroAccelerator(
            zero_plugin=self.args.zero_plugin, mixed_precision=self.args.mixed_precision, **kwargs
        )
        self.accelerator.caller_owns_accumulation = True
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )
        self._check_sequence_parallel_evaluation()
        if self.args.zero_stage == 3 and self.args.auto_find_batch_size:
            raise ValueError(
                "`auto_find_batch_size` isn't supported with ZeRO stage 3 (as with DeepSpeed ZeRO-3). Please use "
                "stage 2 or 1, or set the batch size"
            )
        if self.args.save_only_model and self.args.load_best_model_at_end:
            raise ValueError("ZeRO can't be used with `save_only_model` along with `load_best_model_at_end`.")

    def _hp_search_setup(self, trial: Any) -> None:
        """A hyperparameter-search trial sets its values on the arguments and builds a new accelerator (as
        transformers rebuilds its DeepSpeed config): the config's "auto" values are filled from the trial's."""
        self._zero_new_trial = self.hp_search_backend is not None and trial is not None
        try:
            super()._hp_search_setup(trial)  # type: ignore[misc]
        finally:
            self._zero_new_trial = False

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"
        args.pop("deepspeed_plugin", None)
        self._zero_accelerator_kwargs = {k: v for k, v in args.items() if k != "mixed_precision"}
        # `parallelism_config` is the ZeroAccelerator's (the engine's layout); accelerate's own would build FSDP2's
        args.pop("parallelism_config", None)
        return args

    # ------------------------------------------------------- sequence parallel
    # [Note: the Trainer under sequence parallelism] transformers' Trainer does ALST only through accelerate's
    # DeepSpeed backend (it reads `accelerator.parallelism_config`, which the ZeroAccelerator keeps out of accelerate).
    # The same steps here: the total batch counts world size / sp ranks, the train loader is cut along sequences,
    # and the loss is the sequence-parallel group's ([Note: the loss over a sequence-parallel group]), normalised as
    # the Trainer normalises without sp: by the labelled tokens of the whole step on every rank, counted on the cut
    # micro-batches (`_get_num_items_in_batch`); `sequence_parallel_loss_normalization="deepspeed_alst"` asks for
    # DeepSpeed's per-micro-batch rule instead ([Note: loss normalisation under sequence parallelism]).
    # `get_sp_size` is left at 1: transformers reads it where a DeepSpeed-adapted loader would not be counted yet
    # (our loader's length counts its micro-batches already) and to divide token counts (each rank's slices are
    # disjoint, so ours count nothing twice; evaluation's batches are whole on each rank even when
    # `sequence_parallel_evaluation` cuts them inside `prediction_step`).
    def get_total_train_batch_size(self, args: Any) -> int:
        total = super().get_total_train_batch_size(args)  # type: ignore[misc]
        return total // self.accelerator.sequence_parallel_size  # a group's ranks share their batches

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()  # type: ignore[misc]
        rule = self._sequence_loss_rule
        if not self.accelerator.cuts_sequences and rule is not LossNormalization.ACCUMULATED_TOKENS:
            raise ValueError(
                f"sequence_parallel_loss_normalization={rule.value!r} without sequence parallelism or sequence_tiling: "
                "it chooses how a loss over cut sequences is normalised, and nothing is cut here; remove it, or turn "
                "sequence parallelism on (ParallelismConfig sp_size, or sequence_parallel_size in the ZeRO config)"
            )
        if self.accelerator.cuts_sequences:
            _refuse_other_losses(self)
            if self.loss_is_scaled_for_ga is None or getattr(self, "_zero_set_loss_scaling", False):
                # the step's normaliser already counts the accumulation; the micro-batch rule leaves it to the Trainer
                self.loss_is_scaled_for_ga = rule is LossNormalization.ACCUMULATED_TOKENS
                self._zero_set_loss_scaling = True
        # always cut: the Trainer reads a step's batches before `training_step` calls `model.train()`, and a model
        # from `from_pretrained` or just evaluated is in eval mode then
        return self.accelerator.sequence_parallel_loader(loader, only_while_training=False)

    @property
    def _sequence_loss_rule(self) -> LossNormalization:
        return LossNormalization.parse(self.args.sequence_parallel_loss_normalization)

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        if not (batch_samples and TOKEN_MASK in batch_samples[0]):  # not cut: evaluation's whole batches
            return super()._get_num_items_in_batch(batch_samples, device)  # type: ignore[misc]
        if self._sequence_loss_rule is not LossNormalization.ACCUMULATED_TOKENS:
            return None  # each micro-batch is normalised by its own tokens, and the Trainer divides by the steps
        return self.accelerator.sequence_parallel_tokens(batch_samples, self.args.average_tokens_across_devices)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, **kwargs: Any) -> Any:
        if self.accelerator.cuts_sequences and model.training:
            return self.sequence_parallel_compute_loss(model, inputs, return_outputs, kwargs.get("num_items_in_batch"))
        return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)  # type: ignore[misc]

    def sequence_parallel_compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
    ) -> Any:
        """The loss of a cut micro-batch: the group's, divided by `num_items_in_batch` (the step's normaliser,
        `_get_num_items_in_batch`) or, None, by the micro-batch's own tokens. TRL trainers override it to keep
        their metrics."""
        return self.accelerator.sequence_parallel_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    @property
    def zero_engine(self) -> Any:
        """The engine training `self.model` (None before training starts)."""
        entry = self.accelerator.prepared_model_of(self.model) if hasattr(self, "accelerator") else None
        return entry.engine if entry is not None and entry.optimizer is not None else None

    # ---------------------------------------------------------------- training
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None) -> Any:
        entry = self.accelerator.prepared_model_of(self.model)
        if entry is not None:  # prepared for evaluation before training: train it from its full weights now
            self.accelerator.release_model(self.model)
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        fill = copy.deepcopy(self.args.zero_fill)
        fill_from_model(fill, self.args, self.model, max_steps)
        self.accelerator.set_zero_plugin(ZeroPlugin(config=fill.config))
        config = self.accelerator.zero_config

        self.create_optimizer()
        if config.scheduler is not None:
            self.lr_scheduler = DummyScheduler(self.optimizer)
        elif isinstance(self.optimizer, DummyOptim) and self.lr_scheduler is None:
            # The engine builds the config's optimizer; the Trainer's scheduler is built over it (transformers does
            # the same with DeepSpeed).
            self.lr_scheduler = DummyScheduler(
                self.optimizer, lr_scheduler_callable=functools.partial(self._scheduler_for, max_steps)
            )
        model = self._wrap_model(self.model_wrapped)
        if isinstance(self.lr_scheduler, DummyScheduler):
            model, self.optimizer, self.lr_scheduler = self.accelerator.prepare(
                self.model, self.optimizer, self.lr_scheduler
            )
        else:
            model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model

        dcp_folder = self.__dict__.pop(_DCP_RESUME, None)  # set by `train`
        if resume_from_checkpoint is not None or dcp_folder is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint or dcp_folder)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def create_optimizer(self, model: Any = None) -> Any:
        """The config's `optimizer` block is built by the engine (a `DummyOptim` stands for it until `prepare`);
        without one, the Trainer's optimizer."""
        if self.optimizer is None and self.accelerator.zero_config.optimizer is not None:
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            self.optimizer = DummyOptim(params, lr=self.args.learning_rate, weight_decay=self.args.weight_decay)
            return self.optimizer
        return super().create_optimizer(model) if model is not None else super().create_optimizer()

    def _scheduler_for(self, max_steps: int, optimizer: torch.optim.Optimizer) -> Any:
        trainer = copy.copy(self)  # create_scheduler stores what it builds; keep this trainer's slot empty
        trainer.lr_scheduler = None
        return trainer.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)

    def _prepare_input(self, data: Any) -> Any:
        prepared = super()._prepare_input(data)
        engine = self.zero_engine
        if (
            engine is not None
            and isinstance(prepared, torch.Tensor)
            and torch.is_floating_point(prepared)
            and engine.compute_dtype != torch.float32
        ):
            return prepared.to(engine.compute_dtype)  # the weights are 16-bit (transformers does this for DeepSpeed)
        return prepared

    def _update_auto_batch_size(self, batch_size: int) -> None:
        entry = self.accelerator.prepared_model_of(self.model)
        if entry is not None and entry.optimizer is not None:
            raise RuntimeError(
                "auto_find_batch_size: the ZeRO engine cannot be rebuilt for a new batch size once training started"
            )
        super()._update_auto_batch_size(batch_size)

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Writes the full 16-bit weights (`model.safetensors`, sharded with an index when large) and the config
        and tokenizer, loadable with `from_pretrained`; for a PEFT model, the adapter. Every rank must call it. At
        stage 3 every rank writes its share of the weight files (`checkpointing.exports_in_parallel`).

        At stage 3 without `stage3_gather_16bit_weights_on_model_save`, as with DeepSpeed, the sharded engine state
        is written instead (`accelerate-zero consolidate` turns it into weights); a Trainer checkpoint holds that
        state anyway, so there only the config is written.
        """
        engine = self.zero_engine
        if engine is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        adapter_keys = _adapter_keys(self.model)
        if exports_in_parallel(self.model, engine, adapter_keys, self.accelerator.zero_plugin):
            self._save(output_dir, state_dict={})  # config, generation config, tokenizer, arguments
            _remove_weight_files(self.args.should_save, output_dir)
            self.accelerator.wait_for_everyone()  # before any rank writes a weights file there
            save_pretrained_parallel(engine, output_dir, checkpoint_saves.SAVE_PRETRAINED_SHARD_BYTES)
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            return
        try:
            state_dict = self.accelerator.get_state_dict(self.model, only=adapter_keys)
        except ValueError:
            logger.warning(
                "stage3_gather_16bit_weights_on_model_save=false: saving the sharded engine state to %s instead of "
                "16-bit weights; `accelerate-zero consolidate` turns it into weights",
                output_dir,
            )
            self._save(output_dir, state_dict={})
            _remove_weight_files(self.args.should_save, output_dir)
            if not _internal_call:
                engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG, exclude_frozen_parameters=False)  # weights
            return
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank writes its shards (model, optimizer, engine scheduler, loss scale) to `<output_dir>/zero_model/`;
        a Trainer-built scheduler goes to scheduler.pt as usual."""
        engine = self.zero_engine
        if engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        fsdp_type = CHECKPOINT_FORMATS[self.args.save_checkpoint_format]
        if fsdp_type is not None:  # [Note: accelerate's FSDP folders out] in checkpoint/accelerate_fsdp_save.py
            checkpoint_saves.check_fsdp_scheduler(self.accelerator.zero_config, self.args.save_checkpoint_format)
            save_fsdp(engine, output_dir, 0, fsdp_type)
        else:  # [Note: the Trainer's asynchronous saves] in checkpoint_saves.py
            engine.save_checkpoint(
                output_dir, tag=CHECKPOINT_TAG, async_save=checkpoint_saves.saves_asynchronously(self.args)
            )
        own = not isinstance(self.lr_scheduler, ZeroSchedulerWrapper)
        if self.args.should_save and self.lr_scheduler is not None and (own or fsdp_type is not None):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        engine = self.zero_engine
        if engine is None:
            super()._save_checkpoint(model, trial)
            return
        checkpoint_saves.finish_saves(self, engine)  # the previous save published, then its rotation
        run_dir = self._get_output_dir(trial=trial)
        if checkpoint_saves.saves_asynchronously(self.args) and not self.args.save_only_model:
            # [Note: the Trainer's asynchronous saves] in checkpoint_saves.py: rotated once published
            with checkpoint_saves.rotation_deferred(self, run_dir):
                super()._save_checkpoint(model, trial)
        else:
            super()._save_checkpoint(model, trial)
        # [Note: the Trainer's files are checksummed too] in checkpoint_files.py: once every rank wrote its files.
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.accelerator.wait_for_everyone()
        if self.args.should_save and os.path.isdir(folder):
            write_manifest(folder)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Resuming loads the engine state after `prepare` (`_load_optimizer_and_scheduler`); only checks here."""
        _check_complete(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = self.zero_engine
        if checkpoint is None or engine is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if dcp_read.is_dcp_folder(Path(checkpoint)):  # written by FSDP2 or torchtitan
            own = None if isinstance(self.lr_scheduler, ZeroSchedulerWrapper) else self.lr_scheduler
            checkpoint_saves.resume_from_dcp(self, engine, checkpoint, own)
            return
        _check_complete(checkpoint)
        # A DeepSpeed Trainer's checkpoint-N holds global_stepN/ and `latest`, an FSDP Trainer's pytorch_model_fsdp_0/
        # and optimizer_0/, where ours holds zero_model/
        engine.load_checkpoint(checkpoint, tag=saved_tag(Path(checkpoint), 0, CHECKPOINT_TAG, 1))
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if not isinstance(self.lr_scheduler, ZeroSchedulerWrapper) and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        engine = self.zero_engine
        if engine is None:
            super()._load_best_model()
            return
        best = self.state.best_model_checkpoint
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        engine.load_checkpoint(best, tag=CHECKPOINT_TAG, load_optimizer_states=False, load_lr_scheduler_states=False)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            # The newest checkpoint a save finished (a killed save leaves a folder without trainer_state.json).
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint is not None and dcp_read.is_dcp_folder(Path(resume_from_checkpoint)):
            # A DCP folder (FSDP2, torchtitan) has no trainer_state.json, which transformers reads from the folder
            # it resumes: the Trainer starts as a new run and `_prepare_for_training` loads the folder.
            setattr(self, _DCP_RESUME, str(resume_from_checkpoint))
            resume_from_checkpoint = None
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.__dict__.pop(_DCP_RESUME, None)
        engine = self.zero_engine
        if engine is not None:  # the last asynchronous save published (its error raised here) and rotated
            checkpoint_saves.finish_saves(self, engine)
        return result


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """`transformers.Trainer` training with ZeRO; exported as `accelerate_zero.Trainer`. See `ZeroTrainerMixin`."""


def _refuse_other_losses(trainer: Any) -> None:
    """Sequence parallelism computes the group's token-mean loss itself; a loss the arguments ask for instead is
    refused by name, not dropped."""
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        asked = "compute_loss_func" if trainer.compute_loss_func is not None else "label_smoothing_factor"
        raise ValueError(
            f"{asked} with sequence_parallel_size={trainer.accelerator.sequence_parallel_size} or sequence_tiling: the loss is the token "
            "mean over the sequence-parallel group (accelerate_zero.sequence.sequence_parallel_loss); remove it, or "
            "override compute_loss with a loss over the group"
        )


def last_complete_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The `checkpoint-N` folder with the largest N whose save completed, or None."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    steps = sorted(
        ((int(m.group(1)), child) for child in folder.iterdir() if (m := _CHECKPOINT_FOLDER.match(child.name))),
        reverse=True,
    )
    for _, child in steps:
        if _is_complete(child):
            return str(child)
        logger.warning("skipping %s: its save did not finish (no readable %s)", child, TRAINER_STATE_NAME)
    return None


def _is_complete(checkpoint: Path) -> bool:
    try:
        json.loads((checkpoint / TRAINER_STATE_NAME).read_text())
    except (OSError, ValueError):
        return False
    if partial_dir(checkpoint, CHECKPOINT_TAG).exists():
        return False  # the engine state was being written
    if not (checkpoint / CHECKPOINT_TAG).exists():
        return True  # saved before the engine existed, or with save_only_model
    try:
        resolve_tag(checkpoint, CHECKPOINT_TAG)
    except (OSError, ValueError):
        return False
    return True


def _check_complete(checkpoint: str) -> None:
    exported = export_files(Path(checkpoint))
    if exported and not (Path(checkpoint) / TRAINER_STATE_NAME).exists():
        raise ValueError(not_a_checkpoint(Path(checkpoint), exported))
    if not _is_complete(Path(checkpoint)):
        raise ValueError(
            f"Can't resume from {checkpoint}: its save did not finish (no readable {TRAINER_STATE_NAME} or engine "
            f"state under {CHECKPOINT_TAG}/). Resume from an earlier checkpoint, or pass resume_from_checkpoint=True "
            "to take the newest complete one."
        )
    verify_manifest(checkpoint)


def _adapter_keys(model: torch.nn.Module) -> set[str] | None:
    """For a PEFT model, the state-dict keys its `save_pretrained` can write: the trainable parameters (adapters,
    `modules_to_save` copies, trained biases) and the input/output embeddings, which peft adds when they were resized
    or targeted. Gathering only these keeps rank 0 from holding the whole 16-bit base model. None otherwise."""
    if not hasattr(model, "peft_config") or not hasattr(model, "get_base_model"):
        return None
    keys = {name for name, param in model.named_parameters(remove_duplicate=False) if param.requires_grad}
    embeddings = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    prefixes = tuple(
        f"{name}." for name, module in model.named_modules(remove_duplicate=False) if id(module) in embeddings
    )
    keys.update(name for name, _ in model.named_parameters(remove_duplicate=False) if name.startswith(prefixes))
    return keys


def _remove_weight_files(should_save: bool, output_dir: str) -> None:
    if should_save:
        for name in ("model.safetensors", "pytorch_model.bin"):
            path = Path(output_dir) / name
            if path.exists():
                path.unlink()
