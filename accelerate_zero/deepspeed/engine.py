"""The engine `accelerate_zero.deepspeed.initialize` returns: `ZeroEngine` with DeepSpeed 0.19.8's signatures where
they differ from ours (checkpoints, 16-bit saves, `step(lr_kwargs)`), its data loader, and DeepSpeed's attribute
pass-through to the model.

[Note: one engine, two faces]
`ZeroEngine` is what the accelerate, Trainer and TRL integrations drive, with our defaults (`save_checkpoint` leaves
frozen parameters out and returns the folder; a missing checkpoint raises). A script written for DeepSpeed expects
DeepSpeed's: `save_checkpoint(..., exclude_frozen_parameters=False)` returning True, `load_checkpoint` returning
`(None, None)` when there is no `latest`, `engine.config_of_the_model` reaching `engine.module.config_of_the_model`.
So the DeepSpeed face is a subclass built only by `accelerate_zero.deepspeed.initialize`; both run the same
training code. What DeepSpeed's engine offers and this one lacks raises `DeepSpeedUnavailable` naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from accelerate_zero.checkpoint.io import LATEST
from accelerate_zero.deepspeed.dataloader import DeepSpeedDataLoader
from accelerate_zero.deepspeed.unavailable import DeepSpeedUnavailable, engine_refusal
from accelerate_zero.engine import collectives
from accelerate_zero.engine.checkpoint_state import StepCounters
from accelerate_zero.engine.engine import ZeroEngine
from accelerate_zero.monitor.writers import ScriptMonitor, any_enabled


logger = logging.getLogger(__name__)

ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT = "train", "eval", "predict"


class DeepSpeedEngine(ZeroEngine):
    """`ZeroEngine` with DeepSpeed's engine signatures ([Note: one engine, two faces]); built by
    `accelerate_zero.deepspeed.initialize`."""

    training_dataloader: DeepSpeedDataLoader | None
    collate_fn: Any
    global_samples: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.training_dataloader = None
        self.collate_fn = None
        self.global_samples = 0
        self._step_applied = False

    @property
    def monitor(self) -> ScriptMonitor:
        """DeepSpeed's `engine.monitor`: `enabled`, and `write_events([(name, value, step), ...])` to the writers
        the config's monitor blocks turn on."""
        return ScriptMonitor(self.step_log.monitors, any_enabled(self.config))

    def __getattr__(self, name: str) -> Any:
        # DeepSpeed's engine passes unknown attributes through to the model (`engine.generate`, `engine.config`
        # is the engine's own). Only reached when normal lookup failed.
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        refusal = engine_refusal(name)
        if refusal is not None:
            raise DeepSpeedUnavailable(refusal)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # --------------------------------------------------------------- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, as `engine(...)`."""
        return self(*args, **kwargs)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Ends a micro-step; on the accumulation boundary steps the optimizer and the LR scheduler (DeepSpeed's
        `step`; `lr_kwargs` are not available: the scheduler steps without arguments)."""
        if lr_kwargs:
            raise DeepSpeedUnavailable(
                f"engine.step(lr_kwargs={lr_kwargs!r}): keyword arguments for the LR scheduler's step are not "
                "available; call engine.step() and drive the scheduler's values from its own state"
            )
        boundary = self.is_gradient_accumulation_boundary()
        skipped = self.skipped_steps
        super().step()
        self._step_applied = boundary and self.skipped_steps == skipped
        if boundary:
            self.global_samples += self.train_batch_size() or 0

    def was_step_applied(self) -> bool:
        """True when the latest `step()` updated the parameters (not between boundaries, not an fp16 overflow)."""
        return self._step_applied

    # ------------------------------------------------------------ data
    def deepspeed_io(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int | None = None,
        route: str = ROUTE_TRAIN,
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedDataLoader:
        """DeepSpeed's loader over `dataset`: `train_micro_batch_size_per_gpu` samples per rank, each rank its share
        (a `DistributedSampler`; unshuffled for `route` "eval"/"predict"), `dataloader_drop_last` from the config."""
        if not isinstance(dataset, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
            raise ValueError("Training data must be a torch Dataset")
        if self.layout.sequence is not None:
            raise DeepSpeedUnavailable(
                "training_data / deepspeed_io under sequence_parallel_size > 1: not available; build the loader with "
                "accelerate_zero.sequence's sequence-parallel loader"
            )
        if batch_size is None:
            batch_size = self.train_micro_batch_size_per_gpu()
        if batch_size is None:
            raise ValueError(
                "training_data needs a batch size: set train_micro_batch_size_per_gpu (or train_batch_size) in the "
                "DeepSpeed config"
            )
        if data_sampler is None and route in (ROUTE_EVAL, ROUTE_PREDICT):
            data_sampler = torch.utils.data.DistributedSampler(
                dataset, num_replicas=self.dp_world_size, rank=self.global_rank, shuffle=False
            )
        return DeepSpeedDataLoader(
            dataset,
            batch_size,
            pin_memory=pin_memory and self.device.type != "cpu",
            collate_fn=collate_fn if collate_fn is not None else self.collate_fn,
            num_local_io_workers=num_local_io_workers,
            data_sampler=data_sampler,
            data_parallel_world_size=self.dp_world_size,
            data_parallel_rank=self.global_rank,
            dataloader_drop_last=self.config.dataloader_drop_last,
        )

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's `save_checkpoint`: every rank its shard of the training state in `save_dir/tag` (default
        `global_step<N>`), `latest` naming it; returns True. The folder is ours (universal: it loads at any world
        size and stage with `load_checkpoint`), not DeepSpeed's file layout.

        Raises:
            DeepSpeedUnavailable: `save_latest=False` (a save always publishes `latest`).
        """
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if not save_latest:
            raise DeepSpeedUnavailable(
                "save_checkpoint(save_latest=False): not available, a save always updates 'latest'; keep it, and "
                "pass tag= to load_checkpoint to load another checkpoint"
            )
        super().save_checkpoint(
            save_dir, tag, dict(client_state or {}), exclude_frozen_parameters=exclude_frozen_parameters
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict | None]:
        """DeepSpeed's `load_checkpoint`: restores a checkpoint `save_checkpoint` wrote (any world size or stage).

        Returns:
            (the checkpoint folder, the `client_state` saved with it), or `(None, None)` when `tag` is None and
            `load_dir` has no `latest` file (DeepSpeed's "nothing to resume from").

        Raises:
            DeepSpeedUnavailable: `load_module_strict=False` or a `custom_load_fn`.
        """
        if not load_module_strict:
            raise DeepSpeedUnavailable(
                "load_checkpoint(load_module_strict=False): not available, a checkpoint's parameters must match the "
                "model's; load the weights you have with GatheredParameters(params, modifier_rank=0) instead"
            )
        if custom_load_fn is not None:
            raise DeepSpeedUnavailable(
                "load_checkpoint(custom_load_fn=...): not available; load the checkpoint, then change the weights "
                "inside GatheredParameters(params, modifier_rank=0)"
            )
        if tag is None and not (Path(load_dir) / LATEST).is_file():
            logger.warning(
                "Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file "
                "exists or pass an explicit checkpoint tag when loading a checkpoint.",
                Path(load_dir) / LATEST,
            )
            return None, None
        counters = StepCounters(self.global_steps, self.micro_steps, self.skipped_steps)
        samples = self.global_samples
        folder, client_state = super().load_checkpoint(
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
        )
        if load_module_only:  # the weights only: the step counters stay as they were (DeepSpeed's meaning)
            self._restore_step_counters(counters)
            self.global_samples = samples
        else:
            self.global_samples = self.global_steps * (self.train_batch_size() or 0)
        return folder, client_state

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's `save_16bit_model`: the gathered weights in the compute dtype, written by rank 0 to
        `save_dir/save_filename` (`torch.save`, or safetensors for a `.safetensors` name); every rank must call it.

        Returns:
            True; False (nothing written) at stage 3 without `stage3_gather_16bit_weights_on_model_save`.
        """
        if self.stage == 3 and not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            logger.warning(
                "Did not save the model %s because stage3_gather_16bit_weights_on_model_save is False",
                Path(save_dir) / save_filename,
            )
            return False
        only = None
        if exclude_frozen_parameters:
            only = {name for name, p in self.module.named_parameters() if p.requires_grad}
        if save_filename.endswith(".safetensors") and only is None:
            return super().save_16bit_model(save_dir, save_filename)
        state = self.full_state_dict(dtype=self.compute_dtype, only=only)
        if self.layout.world.rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / save_filename)
        collectives.barrier(self.layout.world)
        return True

    def save_fp16_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The full model state dict (gathered at stage 3; rank 0 holds it, the others get `{}`); every rank calls
        it."""
        if destination is not None or prefix or keep_vars:
            raise DeepSpeedUnavailable(
                "module_state_dict(destination=, prefix=, keep_vars=): not available; call it without arguments"
            )
        return self.full_state_dict()

    # -------------------------------------------------------- config queries
    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage == 3

    def zero_offload_optimizer(self) -> Any:
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        offload = self.config.zero_optimization.offload_optimizer
        return offload is not None and offload.device == "cpu"

    def optimizer_name(self) -> str | None:
        block = self.config.optimizer
        return block.type if block is not None else type(self.optimizer).__name__

    def get_batch_info(self) -> tuple[int | None, int | None, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()
