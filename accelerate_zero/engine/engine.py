"""ZeroEngine: runs the parts engine/assemble.py built (forward, backward, step), and is DeepSpeed's engine API;
the only object integrations call."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from accelerate_zero.checkpoint.engine_io import load_engine, save_engine
from accelerate_zero.config import ResolvedZeroConfig, ZeroConfig, resolve_config
from accelerate_zero.config.checkpoint_writer import writer_decoupled
from accelerate_zero.debug.memory import engine_memory
from accelerate_zero.engine import collectives
from accelerate_zero.engine.assemble import assemble
from accelerate_zero.engine.checkpoint_state import CheckpointState, StepCounters
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.compiling import CompileAPI, uncompiled
from accelerate_zero.engine.deepspeed_api import DeepSpeedEngineAPI
from accelerate_zero.engine.experts.partition import expert_element_offsets
from accelerate_zero.engine.full_weights import full_state_dict, named_full_parameters
from accelerate_zero.engine.gathered import register_engine_params, unregister_engine_params
from accelerate_zero.engine.groups import DataParallelGroup, init_data_parallel_group, resolve_device
from accelerate_zero.engine.layout import ShardingLayout, build_sharding_layout, flat_layout, plan_from_config
from accelerate_zero.engine.nodes import node_layout_from_env
from accelerate_zero.engine.progress import BackwardPositionCheck
from accelerate_zero.engine.setup import (
    build_lr_scheduler_for,
    cast_forward_inputs,
    check_implemented,
    forward_input_dtype,
)
from accelerate_zero.engine.sleep import OffloadStateTypeEnum, SleepingState
from accelerate_zero.engine.stage3.init_adoption import adopt_init_shards
from accelerate_zero.engine.step_log import StepLog


logger = logging.getLogger(__name__)


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Any = None,
    lr_scheduler: Any = None,
    *,
    device: torch.device | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    unit_classes: list[type[nn.Module] | str] | None = None,
    engine_class: type[ZeroEngine] | None = None,
) -> ZeroEngine:
    """Shards `model`'s training state across the data-parallel ranks, as `deepspeed.initialize` does.

    Args:
        model: the model; it is moved to `device` and its trainable parameters become views into flat buffers.
        optimizer: a torch optimizer over `model`'s parameters (any class, several param groups); it is kept and
            re-pointed at this rank's shard. None builds one from the config's `optimizer` block.
        config: a DeepSpeed-format config: dict, path to a .json/.yaml file, or a `ZeroConfig`.
        lr_scheduler: a scheduler bound to `optimizer`, or a callable taking the optimizer and returning one.
            None builds one from the config's `scheduler` block, if any.
        device: where the model computes; default: the local CUDA device (`LOCAL_RANK`) if there is one, else the
            CPU. "cuda" means the local device; a CUDA device is bound as the current one (`torch.cuda.set_device`).
        process_group: the data-parallel group; default: torch's default group (created if needed).
        unit_classes: stage 3: the module classes (or class names) whose parameters are gathered together;
            default: `model._no_split_modules` for transformers models, else the root's children.
        engine_class: a `ZeroEngine` subclass to build instead (accelerate_zero.deepspeed's engine).

    Returns:
        The engine: `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()`.

    Raises:
        ZeroConfigError: the config is invalid (every problem listed).
        ValueError: the model, optimizer or scheduler do not fit the config.
        NotImplementedError: the config asks for a feature this version does not have (the key is named).
    """
    device = resolve_device(device)
    world = init_data_parallel_group(device, process_group)
    resolved = resolve_config(ZeroConfig.from_any(config if config is not None else {}), world_size=world.world_size)
    check_implemented(resolved)
    plan = plan_from_config(resolved, node_layout_from_env(world.world_size))
    adopt_init_shards(model, resolved, world, plan, device, unit_classes)  # a model built under zero.Init
    layout = build_sharding_layout(world, plan)
    build = engine_class or ZeroEngine
    return build(model, optimizer, resolved, lr_scheduler, layout=layout, device=device, unit_classes=unit_classes)


_PARAMETERS = (OffloadStateTypeEnum.lp_params,)
_GRADIENTS = (OffloadStateTypeEnum.lp_grads,)


class ZeroEngine(DeepSpeedEngineAPI, CompileAPI):
    """Trains one model with ZeRO stage 0-3 (DeepSpeed's engine API: forward, `backward`, `step`; its accessors and
    sleep calls in engine/deepspeed_api.py, `compile()` in engine/compiling.py)."""

    module: nn.Module
    config: ResolvedZeroConfig
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    dp: DataParallelGroup
    micro_steps: int
    global_steps: int
    skipped_steps: int

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: ResolvedZeroConfig,
        lr_scheduler: Any,
        *,
        dp: DataParallelGroup | None = None,
        device: torch.device,
        unit_classes: list[type[nn.Module] | str] | None = None,
        layout: ShardingLayout | None = None,
    ) -> None:
        """`layout`: every group the engine uses (engine/layout.py); without one, `dp` alone, everything
        partitioned over it."""
        if not isinstance(config, ResolvedZeroConfig):
            raise TypeError(
                f"ZeroEngine needs a ResolvedZeroConfig, got {type(config).__name__}: build the engine with "
                "accelerate_zero.initialize, or pass resolve_config(config, world_size=...)"
            )
        if layout is None:
            assert dp is not None, "ZeroEngine needs a layout or a data-parallel group"
            layout = flat_layout(dp)
        self.module, self._forward, self.config, self.device = uncompiled(module), module, config, device
        self.layout = layout
        """The groups of every kind ([Note: the three hierarchical layouts] in engine/layout.py)."""
        self.dp = layout.shard
        """The ranks one copy of the state is partitioned over (the layout's `shard` group)."""
        self.stage = config.zero_optimization.stage
        self.compute_dtype = config.compute_dtype
        self.comm_stats_counter = CommStats()
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._position_check = BackwardPositionCheck(self.dp, self.comm_stats_counter, device)
        self._global_grad_norm: float | None = None
        self.sleeping = SleepingState(device)
        parts = assemble(
            self.module,
            optimizer,
            config,
            layout=self.layout,
            device=device,
            stats=self.comm_stats_counter,
            progress=lambda: self.micro_steps,
            unit_classes=unit_classes,
        )
        self.optimizer = parts.optimizer
        self.offload, self.host_copies, self.host_memory = parts.offload, parts.host_copies, parts.host_memory
        self.groups, self.units, self.scheduler = parts.groups, parts.units, parts.scheduler
        self.reducer, self.sharded_optimizer = parts.reducer, parts.sharded_optimizer
        self.shard_store, self.grad_store, self.host_staging = parts.shard_store, parts.grad_store, parts.host_staging
        self._state_dict_guard, self._hooks = parts.state_dict_guard, parts.hooks
        self.activation_offload = parts.activation_offload
        self.experts = parts.experts
        """`expert_parallel`: the split MoE layers and the experts this rank holds (engine/experts/parallel.py); None when
        off."""
        """`activation_checkpointing.cpu_checkpointing`: what autograd saved in the forwards, kept in host memory
        (engine/activation_offload.py); None when off."""
        self.lr_scheduler = build_lr_scheduler_for(self.optimizer, lr_scheduler, config)
        self.step_log = StepLog(config, self.layout.world, device, self.comm_stats_counter)
        register_engine_params(self)
        self._expose_sleep_on_optimizer()
        self.comm_stats_counter.reset()
        logger.info(
            "accelerate_zero: stage %d on %d ranks, %d buckets, compute dtype %s",
            self.stage,
            self.layout.world.world_size,
            len(self.reducer.buckets),
            self.compute_dtype,
        )

    # --------------------------------------------------------------- training
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model's forward; under bf16 (fp16: with `auto_cast`) floating inputs are cast to it first,
        `labels=` excepted ([Note: casting forward inputs] in engine/setup.py)."""
        dtype = forward_input_dtype(self.config)
        if dtype is not None:
            args, kwargs = cast_forward_inputs(args, kwargs, dtype)
        with self.step_log.timed("forward"):
            return self._forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagates `loss` divided by the accumulation steps (and times the fp16 loss scale).

        Gradients are reduced while backward runs: at stages 2 and 3 on every call (each bucket as soon as it is
        complete; at stage 3 each unit is released as soon as its gradient is reduced), at stages 0 and 1 only on
        the accumulation boundary (other micro-steps communicate nothing).
        """
        self.sleeping.check_awake("backward")
        self.sharded_optimizer.settle()  # backward writes the gradients a host step in flight reads
        self.step_log.record_loss(loss)  # the monitors' train_loss (nothing without a monitor)
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        if self.sharded_optimizer.loss_scaler is not None:
            scaled = scaled.float() * self.sharded_optimizer.loss_scaler.scale
        boundary = self.is_gradient_accumulation_boundary()
        if self.reducer.partitioned and self.dp.world_size > 1:  # [Note: ranks out of step] in engine/progress.py
            self._position_check.start(self.micro_steps, boundary)
        self.reducer.begin_backward(boundary=boundary)
        with self.step_log.timed("backward"):
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException:
                self.reducer.abort_backward()
                self._position_check.finish()
                raise
            self._position_check.finish()
            self.reducer.end_backward()
            if self.scheduler is not None:
                self.scheduler.end_backward()
        return loss

    def step(self) -> None:
        """Ends a micro-step; on the accumulation boundary clips, steps the optimizer and the LR scheduler.

        On an fp16 overflow (on any rank) the step is skipped on every rank, the loss scale drops and the LR
        scheduler does not step. Gradients are zeroed after the boundary.
        """
        self.sleeping.check_awake("step")
        if self.is_gradient_accumulation_boundary():
            with self.step_log.timed("step"):
                self.reducer.finish_step()
                if self.scheduler is not None:
                    self.scheduler.end_backward()
                # At stage 3 an offloaded host step may still run when this returns: the gradients are zeroed when
                # it is settled ([Note: the host step across the step boundary] in engine/step_in_flight.py).
                gated = [flat.shard for unit in self.units for flat in unit.flats]  # read through the store
                outcome = self.sharded_optimizer.step(then=self.reducer.zero_grad, gated=gated)
                if self.scheduler is not None and self.sharded_optimizer.stepping:
                    self.scheduler.prefetch_ahead()  # the next forward's first units, while the rest steps
                self._global_grad_norm = outcome.grad_norm
                if outcome.overflow:
                    self.skipped_steps += 1
                elif self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                self.global_steps += 1
            self.step_log.after_step(self)  # the step's time included
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Drops the accumulated gradients (the engine also does this after every optimizer step)."""
        self.sleeping.check_awake("zero_grad()", _GRADIENTS)
        self.sharded_optimizer.settle()
        self.reducer.zero_grad()

    # ---------------------------------------------------- accumulation control
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step()` steps the optimizer."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Overrides the micro-step count (accelerate's `sync_gradients`); None goes back to counting."""
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally without communicating (stages 0 and 1 only)."""
        if self.reducer.partitioned:
            raise RuntimeError(
                f"no_sync() is incompatible with gradient partitioning (zero_optimization.stage={self.stage}): "
                "stages 2 and 3 reduce every micro-step; use gradient_accumulation_steps instead"
            )
        previous, self._boundary_override = self._boundary_override, False
        try:
            yield
        finally:
            self._boundary_override = previous

    # ----------------------------------------------------------------- queries
    def full_state_dict(
        self, dtype: torch.dtype | None = None, only: Collection[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """The full model state dict (keys as `module.state_dict()`) on CPU on rank 0; `{}` on other ranks.

        Every rank must call it (with the same `only`). At stage 3 the units are gathered one at a time, so no rank
        ever holds more than one extra unit.

        Args:
            dtype: cast floating-point tensors to this dtype; None keeps the compute dtype.
            only: keep just these keys (e.g. a PEFT model's adapter): units holding none of them are not gathered
                and rank 0 never holds the rest.
        """
        self.sleeping.check_awake("full_state_dict()", _PARAMETERS)
        return full_state_dict(self, self._state_dict_guard, dtype, only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """Writes the gathered 16-bit weights as one safetensors file on rank 0; every rank must call it.

        At stage 3 this needs `stage3_gather_16bit_weights_on_model_save: true`. Without it the sharded engine
        state is saved instead (`save_checkpoint(save_dir)`; turn it into weights with
        `accelerate-zero consolidate`) and False is returned, as DeepSpeed does.

        Returns:
            True when the weights file was written.
        """
        self.sleeping.check_awake("save_16bit_model()", _PARAMETERS)
        if self.stage == 3 and not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            logger.warning(
                "stage3_gather_16bit_weights_on_model_save=false: saving the sharded engine state to %s instead of "
                "16-bit weights",
                save_dir,
            )
            self.save_checkpoint(save_dir, exclude_frozen_parameters=False)  # weights: the whole model
            return False
        state = self.full_state_dict(dtype=self.compute_dtype)
        # A tied parameter is written once, under its first name (the embedding), as save_pretrained does.
        kept = {name for name, _ in self.module.named_parameters()}
        aliases = {name for name, _ in self.module.named_parameters(remove_duplicate=False)} - kept
        state = {k: v for k, v in state.items() if k not in aliases}
        if self.layout.world.rank == 0:
            folder = Path(save_dir)
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".{save_filename}.partial"
            save_file({k: v.contiguous() for k, v in state.items()}, str(partial), metadata={"format": "pt"})
            partial.replace(folder / save_filename)  # never a half-written weights file
        collectives.barrier(self.layout.world)
        return True

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        exclude_frozen_parameters: bool = True,
        async_save: bool | None = None,
        checkpoint_format: str = "universal",
    ) -> str:
        """Saves the full training state (every rank its shard); every rank must call it.

        The folder is universal: `load_checkpoint` restores it on any world size and stage. A save that is
        interrupted never replaces the previous checkpoint (see accelerate_zero/checkpoint/io.py).

        Args:
            save_dir: the folder holding checkpoints; `<save_dir>/latest` names the newest.
            tag: the checkpoint's sub-folder; default `global_step<N>`.
            client_state: a dict of tensors and plain values saved alongside and returned by `load_checkpoint`.
            exclude_frozen_parameters: leave out parameters with `requires_grad=False` (a LoRA base); loading then
                takes them from the model after checking they are the ones trained with ([Note: frozen parameters
                are not saved] in checkpoint/frozen.py). DeepSpeed's default is False: pass False for a
                checkpoint that holds the whole model.
            async_save: None: as the config's `checkpoint.writer.decoupled` says (default False; universal format
                only). True: return
                once the state is copied to host memory; a background thread writes and publishes
                it while training goes on ([Note: asynchronous saves] in checkpoint/async_save.py). The next save or
                load waits for it (and raises its error, on every rank); until then `latest` names the previous
                checkpoint. Pass the same value on every rank.
            checkpoint_format: "universal" (ours), or "dcp": a `torch.distributed.checkpoint` folder FSDP2 loads
                with `set_model_state_dict` / `set_optimizer_state_dict` ([Note: DCP checkpoints out] in
                checkpoint/dcp_save.py; no client_state, not asynchronous).

        Returns:
            The checkpoint folder (with `async_save`, where it will be once published).
        """
        self.sleeping.check_awake("save_checkpoint()")
        return str(
            save_engine(
                self,
                save_dir,
                tag,
                client_state,
                exclude_frozen_parameters,
                self._saves_asynchronously(checkpoint_format) if async_save is None else async_save,
                checkpoint_format,
            )
        )

    def _saves_asynchronously(self, checkpoint_format: str) -> bool:
        """The config's `checkpoint.writer.decoupled`, for our format (a DCP save is synchronous, as documented)."""
        return checkpoint_format != "dcp" and writer_decoupled(self.config.checkpoint.writer)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> tuple[str, dict]:
        """Restores a checkpoint written by `save_checkpoint`, re-partitioning it for this world size and stage; or a
        DCP checkpoint written by FSDP2 or torchtitan (`load_dir`, or `load_dir/tag`, holding `.metadata`; [Note: DCP
        checkpoints in] in checkpoint/dcp_load.py); or another framework's: DeepSpeed's ZeRO and universal folders,
        accelerate's FSDP save_state folders (checkpoint/deepspeed_read.py, accelerate_fsdp.py).

        Returns:
            (the checkpoint folder, the client_state saved with it).
        """
        self.sleeping.check_awake("load_checkpoint()")
        # The load writes host shards and masters in place: no copy in flight may still read them
        # ([Note: asynchronous host copies], rule 3).
        self.host_copies.drain()
        if self.scheduler is not None:
            self.scheduler.release_all()  # gathered copies (and hpZ's secondary ones) of the values replaced
        folder, client_state = load_engine(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
        return str(folder), client_state

    def checkpoint_state(self) -> CheckpointState:
        """What a checkpoint reads of this engine and restores into it (engine/checkpoint_state.py)."""
        return CheckpointState(
            self.module,
            self.units,
            self.reducer.buckets,
            self.sharded_optimizer,
            self.shard_store,
            StepCounters(self.global_steps, self.micro_steps, self.skipped_steps),
            self._restore_step_counters,
            whole_layout=expert_element_offsets(self.experts),
            writes_parts=self.layout.expert_peers is None or self.layout.expert_peers.rank == 0,
        )

    def _restore_step_counters(self, counters: StepCounters) -> None:
        # The accumulation boundary follows from `micro_steps`.
        self.global_steps, self.micro_steps = counters.global_steps, counters.micro_steps
        self.skipped_steps = counters.skipped_steps

    def gather_groups(self) -> list[list[nn.Parameter]]:
        """Stage 3: the parameters gathered together, one list per unit in unit order (the same on every rank);
        empty at stages 0-2. What integrations walk instead of the units themselves."""
        return [[p for flat in unit.flats for p in flat.params] for unit in self.units]

    def meta_state_dict(self, only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The full state dict's keys, shapes and dtypes as meta tensors, without a collective and without holding a
        weight (stage 3 parameters have their full shapes, not their placeholders'); `only` keeps just these keys."""
        views = {
            id(p): view
            for unit in self.units
            for flat in unit.flats
            for p, view in zip(flat.params, flat.views, strict=True)
        }
        with self._state_dict_guard.disabled() if self._state_dict_guard else contextlib.nullcontext():
            local = self.module.state_dict(keep_vars=True)
        whole = {key: shape for key, (_, shape) in expert_element_offsets(self.experts).items()}  # split experts
        return {
            name: torch.empty(
                whole.get(id(t)) or views.get(id(t), t).shape, dtype=views.get(id(t), t).dtype, device="meta"
            )
            for name, t in local.items()
            if only is None or name in only
        }

    def named_full_parameters(
        self, max_bytes: int | None = None, dtype: torch.dtype | None = None, rank0_only: bool = False, merge_lora=True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) pairs, at most `max_bytes` of units gathered at once, a LoRA adapter merged ([Note:
        streaming full weights to a generator] in engine/full_weights.py). Every rank iterates it to the end."""
        self.sleeping.check_awake("named_full_parameters()", _PARAMETERS)
        return named_full_parameters(self, max_bytes, dtype, rank0_only, merge_lora)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds now, per kind, counted from the engine's tensors (each storage once).

        Kinds: parameters (the flat buffers and frozen parameters), gradients (the storage kept across
        micro-steps), master_weights (fp32 copies that are not the parameters themselves), optimizer_states,
        communication_buffers (stage 2 buckets being filled or reduced right now), and total. The peak of the
        latter since the engine started is reported as communication_buffers_peak, and the temporaries kept for
        reuse in host memory as cached_buffers ([Note: temporaries reused in host memory]; like CUDA's reserved
        memory, what the allocator keeps rather than what training holds): neither is part of total. Offloaded
        state is reported as host_parameters, host_gradients, host_master_weights, host_optimizer_states and
        host_total; with `cpu_checkpointing`, the activations held in host memory until backward as
        host_activations (part of host_total).
        """
        return engine_memory(self)

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Bytes moved per collective kind since the last `reset_comm_stats()` (see engine/collectives.py)."""
        return self.comm_stats_counter.as_dict()

    def reset_comm_stats(self) -> None:
        self.comm_stats_counter.reset()

    def destroy(self) -> None:
        """Removes the engine's hooks; the model keeps its current weights."""
        self.sleeping.check_awake("destroy()")
        self._expose_sleep_on_optimizer(expose=False)
        self.reducer.remove_hooks()
        self.reducer.scratch.clear()
        if self.grad_store is not None:
            self.grad_store.close()
        self.sharded_optimizer.settle()
        self.sharded_optimizer.step_runner.close()
        self.shard_store.close()
        self.host_copies.drain()  # before the pinned memory they may copy from is unregistered
        self.host_memory.close()
        for handle in self._hooks:
            handle.remove()
        if self.scheduler is not None:
            self.scheduler.end_recording()  # a first forward that raised: its torch function mode is process-wide
        unregister_engine_params(self)
