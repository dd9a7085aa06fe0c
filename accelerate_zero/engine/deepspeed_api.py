"""The DeepSpeed engine's accessors and sleep calls, as RL frameworks and trainers call them on `ZeroEngine`.

[Note: the DeepSpeed surface beside the engine core]
TRL, OpenRLHF, verl and open-r1 forks drive a DeepSpeed engine through a handful of calls besides forward, backward
and step: the batch and accumulation queries, `zero_optimization_stage()`, `engine.config["zero_optimization"]
[...]`, `offload_states` / `reload_states` on the engine or on `engine.optimizer`, and `empty_partition_cache()`.
They live here, as a base class of `ZeroEngine`, so the engine's own module holds what trains and saves; each is
a thin read of the engine's parts or a delegation to engine/sleep.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from accelerate_zero.checkpoint.async_save import wait_for_snapshots
from accelerate_zero.config import ResolvedZeroConfig, data_parallel_ranks
from accelerate_zero.engine.sleep import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
    SleepingState,
    check_device,
    parse_include,
    training_state,
)


class DeepSpeedEngineAPI:
    """DeepSpeed's engine accessors over `ZeroEngine`'s parts ([Note: the DeepSpeed surface beside the engine
    core]); not used on its own."""

    module: nn.Module
    config: ResolvedZeroConfig
    optimizer: torch.optim.Optimizer
    stage: int
    units: list[Any]
    scheduler: Any
    reducer: Any
    sharded_optimizer: Any
    sleeping: SleepingState
    layout: Any
    _global_grad_norm: float | None

    # ------------------------------------------------------------- queries
    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps or 1)

    def train_batch_size(self) -> int | None:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.config.train_micro_batch_size_per_gpu

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3), as DeepSpeed's engine reports it."""
        return self.stage

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's unscaled gradient, before clipping (None before the first)."""
        return self._global_grad_norm

    @property
    def loss_scale(self) -> float:
        scaler = self.sharded_optimizer.loss_scaler
        return scaler.scale if scaler is not None else 1.0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each param group's `betas` (0.0 for a group without), as DeepSpeed's engine reports momentum."""
        return [group.get("betas", 0.0) for group in self.optimizer.param_groups]

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    # ------------------------------------------------------------- ranks
    @property
    def local_rank(self) -> int:
        """This process's index on its node (`LOCAL_RANK`, which every launcher sets; 0 without one)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.layout.world.rank

    @property
    def world_size(self) -> int:
        return self.layout.world.world_size

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks (the world over `sequence_parallel_size`: ranks sharing a sequence share batches)."""
        return data_parallel_ranks(self.config, self.layout.world.world_size)

    def get_data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel ranks (its batch's index)."""
        if self.layout.sequence is not None:
            raise NotImplementedError(
                "get_data_parallel_rank() under sequence_parallel_size > 1: not available; the sequence-parallel "
                "loaders of accelerate_zero.sequence give every rank of a group its share of the same batch"
            )
        return self.layout.world.rank

    def train(self, mode: bool = True) -> DeepSpeedEngineAPI:
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngineAPI:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    # --------------------------------------------------------------- sleep
    def empty_partition_cache(self) -> None:
        """Releases every stage-3 parameter kept gathered (reuse distance, hpZ's secondary copies): DeepSpeed's call
        after a `no_grad` forward or generation; nothing to do at stages 0-2. Call it between steps."""
        if self.scheduler is not None:
            self.scheduler.release_all()

    def offload_states(
        self,
        include: Iterable[OffloadStateTypeEnum | str] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Moves the training state off the device until `reload_states()`, as DeepSpeed's engine does between
        rollouts ([Note: sleeping moves storages, not tensors] in engine/sleep.py).

        Args:
            include: the kinds to move (`OffloadStateTypeEnum` members or their names); None: all of them. A second
                call adds kinds. `lp_grads` and `contiguous_grad_buffer` are one storage here: either moves it.
            device: "cpu" (the only one offered, as in DeepSpeed).
            pin_memory: host copies in pinned memory (on a GPU).
            non_blocking: do not wait for the copies.

        Stage-3 parameters left gathered by a `no_grad` forward, `generate` or an evaluation are released first, as
        DeepSpeed does. Call it between steps.
        """
        kinds = parse_include(include)
        check_device(device)
        wait_for_snapshots()  # an asynchronous save's writer may still be copying the storages that move now
        self.empty_partition_cache()
        if any(flat.full.untyped_storage().nbytes() for unit in self.units for flat in unit.flats):
            raise RuntimeError(
                "offload_states() while a stage-3 forward holds gathered parameters: call it between steps"
            )
        self.reducer.scratch.clear()
        self.sleeping.offload(training_state(self), kinds, self.module, pin_memory, non_blocking)

    def _expose_sleep_on_optimizer(self, expose: bool = True) -> None:
        """DeepSpeed's `engine.optimizer.offload_states(...)` / `reload_states(...)` (OpenRLHF's helpers call them
        there): the engine's own calls, set on the optimizer instance it was built with; `expose=False` takes them
        away again (`destroy`)."""
        for name in ("offload_states", "reload_states"):
            if expose:
                setattr(self.optimizer, name, getattr(self, name))
            elif name in vars(self.optimizer):
                delattr(self.optimizer, name)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Puts back what `offload_states()` moved; training goes on as if it never left. Nothing to do when nothing
        is offloaded (DeepSpeed's behaviour)."""
        self.sleeping.reload(non_blocking)
