"""ZeroEngine: builds a stage's components from one resolved config; the only object integrations call.

A stage is a composition, not a flag:
- stage 0: buckets all-reduced (ALL_REDUCE), one shard per rank holding everything (data parallelism);
- stage 1: buckets reduce-scattered at the accumulation boundary (SCATTER_IN_PLACE), optimizer on the shard;
- stage 2: buckets reduce-scattered on every micro-step into shard-sized gradients (SCATTER_TO_SHARD).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from accelerate_zero.checkpoint.engine_io import load_engine, save_engine
from accelerate_zero.checkpoint.io import resolve_tag
from accelerate_zero.config import ResolvedZeroConfig, ZeroConfig, resolve_config
from accelerate_zero.config.schema import DEFAULT_GRAD_ACCUM_DTYPE
from accelerate_zero.debug.memory import engine_memory
from accelerate_zero.engine import collectives
from accelerate_zero.engine.buckets import GradBucket, GradScaling, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.flat_buffer import all_gather_params, build_group_shard, group_slices
from accelerate_zero.engine.gathered import GatheredParameters, register_engine_params, unregister_engine_params
from accelerate_zero.engine.grad_reduce import GradReducer
from accelerate_zero.engine.groups import DataParallelGroup, init_data_parallel_group, resolve_device
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.host_grads import HostGradient, HostStaging
from accelerate_zero.engine.loss_scaler import build_loss_scaler
from accelerate_zero.engine.progress import BackwardPositionCheck
from accelerate_zero.engine.setup import (
    build_lr_scheduler_for,
    build_optimizer_for,
    cast_forward_inputs,
    check_implemented,
    dtype_from_name,
    forward_input_dtype,
    trainable_param_groups,
)
from accelerate_zero.engine.shard_plan import plan_group
from accelerate_zero.engine.sharded_optimizer import ShardedOptimizer, ShardSlice
from accelerate_zero.engine.stage3.build import DtypePlan, build_stage3
from accelerate_zero.engine.stage3.hooks import PlaceholderStateDictGuard, register_entry_hooks, register_unit_hooks
from accelerate_zero.engine.stage3.loading import preloaded_numel
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stage3.schedule import UnitScheduler
from accelerate_zero.engine.stage3.units import find_unit_modules, layout_units
from accelerate_zero.engine.step_log import StepLog
from accelerate_zero.offload.host_memory import HostMemory
from accelerate_zero.offload.nvme import NvmeSwapper, check_nvme_path
from accelerate_zero.offload.nvme_grads import NvmeGradStore
from accelerate_zero.offload.nvme_params import build_param_store, choose_swapped
from accelerate_zero.offload.policy import offload_masters, offload_policy, use_fused_cpu_step
from accelerate_zero.optim.fused import prefer_fused_step


logger = logging.getLogger(__name__)

_MODE_BY_STAGE = {0: ReduceMode.ALL_REDUCE, 1: ReduceMode.SCATTER_IN_PLACE, 2: ReduceMode.SCATTER_TO_SHARD}


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Any = None,
    lr_scheduler: Any = None,
    *,
    device: torch.device | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    unit_classes: list[type[nn.Module] | str] | None = None,
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

    Returns:
        The engine: `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()`.

    Raises:
        ZeroConfigError: the config is invalid (every problem listed).
        ValueError: the model, optimizer or scheduler do not fit the config.
        NotImplementedError: the config asks for a feature this version does not have (the key is named).
    """
    device = resolve_device(device)
    dp = init_data_parallel_group(device, process_group)
    resolved = resolve_config(ZeroConfig.from_any(config if config is not None else {}), world_size=dp.world_size)
    check_implemented(resolved)
    return ZeroEngine(model, optimizer, resolved, lr_scheduler, dp=dp, device=device, unit_classes=unit_classes)


class ZeroEngine:
    """Trains one model with ZeRO stage 0, 1 or 2 (DeepSpeed's engine API: forward, `backward`, `step`)."""

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
        dp: DataParallelGroup,
        device: torch.device,
        unit_classes: list[type[nn.Module] | str] | None = None,
    ) -> None:
        if not isinstance(config, ResolvedZeroConfig):
            raise TypeError(
                f"ZeroEngine needs a ResolvedZeroConfig, got {type(config).__name__}: build the engine with "
                "accelerate_zero.initialize, or pass resolve_config(config, world_size=...)"
            )
        self.module, self.config, self.dp, self.device = module, config, dp, device
        self.unit_classes = unit_classes
        self.stage = config.zero_optimization.stage
        self.compute_dtype = config.compute_dtype
        self.comm_stats_counter = CommStats()
        self.host_copies = HostCopies(device)
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._position_check = BackwardPositionCheck(dp, self.comm_stats_counter, device)
        self._global_grad_norm: float | None = None
        self._init_module()
        self.optimizer = build_optimizer_for(module, optimizer, config)
        self._init_shards()
        self.lr_scheduler = build_lr_scheduler_for(self.optimizer, lr_scheduler, config)
        self.step_log = StepLog(config, rank=dp.rank, device=device)
        register_engine_params(self)
        self.comm_stats_counter.reset()
        logger.info(
            "accelerate_zero: stage %d on %d ranks, %d buckets, compute dtype %s",
            self.stage,
            dp.world_size,
            len(self.reducer.buckets),
            self.compute_dtype,
        )

    # ------------------------------------------------------------------ setup
    def _init_module(self) -> None:
        if self.stage == 3:
            return  # [Note: stage 3 initialisation, unit by unit] in engine/stage3/build.py: _place_stage3_module
        self.module.to(self.device)
        if self.compute_dtype != torch.float32:
            for param in self.module.parameters():
                if param.is_floating_point():
                    param.data = param.data.to(self.compute_dtype)
        # Every rank starts from rank 0's weights and buffers, as DDP and DeepSpeed do.
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            collectives.broadcast(tensor.data, 0, self.dp, self.comm_stats_counter)

    def _init_shards(self) -> None:
        zero = self.config.zero_optimization
        # [Note: fp32 gradients under mixed precision] in config/schema.py
        grad_dtype = dtype_from_name(self.config.data_types.grad_accum_dtype or DEFAULT_GRAD_ACCUM_DTYPE)
        dtypes = DtypePlan(
            self.compute_dtype, grad_dtype, dtype_from_name(self.config.communication_data_type) or grad_dtype
        )
        trainable = trainable_param_groups(self.module, self.optimizer)
        self.offload = offload_policy(self.config)
        # [Note: pinned memory at its size] in offload/host_memory.py
        self.host_memory = HostMemory(pin=self.offload.pin_memory and self.device.type == "cuda")
        if self.offload.optimizer:
            # Gradients go to host memory as each bucket is reduced: no device gradient shard is kept.
            zero = dataclasses.replace(zero, contiguous_gradients=False)
        self.units: list[ParamUnit] = []
        self.scheduler: UnitScheduler | None = None
        self._state_dict_guard: PlaceholderStateDictGuard | None = None
        if self.stage == 3:
            buckets, locations, slices, on_complete, spilled = self._init_stage3(trainable, dtypes, zero)
        else:
            num_shards = 1 if self.stage == 0 else self.dp.world_size
            self.groups = [
                build_group_shard(
                    params,
                    plan_group([tuple(p.shape) for p in params], zero.reduce_bucket_size, num_shards),
                    rank=self.dp.rank if num_shards > 1 else 0,
                    mode=_MODE_BY_STAGE[self.stage],
                    compute_dtype=dtypes.compute,
                    grad_dtype=dtypes.grad,
                    comm_dtype=dtypes.comm,
                    device=self.device,
                    contiguous_gradients=zero.contiguous_gradients,
                )
                for params in trainable
            ]
            buckets, locations = self._order_group_buckets()
            slices, on_complete, spilled = [group_slices(shard) for shard in self.groups], None, {}
        self.param_store = None
        if self.offload.param_nvme_path is not None:  # first: the masters below read swapped shards from files
            slices = self._init_param_store(slices, spilled)
        if not set(spilled) <= set(self.param_store.shards if self.param_store is not None else ()):
            raise ValueError(
                "the model was loaded by accelerate_zero.from_pretrained with NVMe parameter offload that this "
                "engine's config does not match (offload_param.device, max_in_cpu or the unit layout): pass "
                "initialize the same config as from_pretrained"
            )
        if self.offload.optimizer:
            slices = offload_masters(slices, self.offload, self._slice_values, self.host_memory)
            use_fused_cpu_step(self.optimizer, self.config.zero_force_ds_cpu_optimizer)
        else:
            prefer_fused_step(self.optimizer, [s.master for group in slices for s in group])
        swapper, self.grad_store, self.host_staging = None, None, None
        # Stages 2 and 3 reduce each bucket to a slice this rank keeps until the step: under NVMe offload it goes
        # to a file too. Stages 0 and 1 hold their full gradient on the device anyway.
        swapped_grads = [b for b in buckets if b.mode is ReduceMode.SCATTER_TO_SHARD]
        if self.offload.nvme_path is not None:
            numel = sum(s.end - s.start for group in slices for s in group)
            grad_numel = sum(b.plan.shard_numel for b in swapped_grads)
            folder = check_nvme_path(
                self.offload.nvme_path,
                self.dp.rank,
                numel,
                grad_numel,
                world_size=self.dp.world_size,
                barrier=lambda: collectives.barrier(self.dp),
            )
            swapper = NvmeSwapper(folder, slices, zero.sub_group_size, self.offload.buffer_count, self._slice_values)
            self.grad_store = NvmeGradStore(
                folder / "gradients.bin", swapped_grads, self.offload.buffer_count, self.host_copies
            )
            for bucket in swapped_grads:
                bucket.grad_store = self.grad_store
        if self.offload.optimizer:
            # Allocated once the shards and masters went to their files, so the start-up peak is not both.
            in_host = [bucket for bucket in buckets if bucket.grad_store is None]
            self.host_staging = staging = HostStaging(
                max((b.plan.shard_numel for b in in_host), default=0),
                lambda numel: self.host_memory.zeros(numel, torch.float32),
            )
            for bucket in in_host:
                values = self.host_memory.zeros(bucket.plan.shard_numel, torch.float32)
                bucket.host_grad = HostGradient(values, staging, self.host_copies)
        self.reducer = self._build_reducer(buckets, locations, on_complete)
        self.reducer.register_hooks()
        self.sharded_optimizer = self._build_sharded_optimizer(slices)
        self.sharded_optimizer.param_store, self.sharded_optimizer.swapper = self.param_store, swapper
        self.sharded_optimizer.switch_param_groups()

    def _slice_values(self, shard_slice: ShardSlice) -> torch.Tensor:
        """The parameter values of a slice (read from its file when the NVMe parameter store holds its shard)."""
        if self.param_store is not None and self.param_store.holds(shard_slice):
            return self.param_store.read_slice(shard_slice)
        return shard_slice.params

    def _init_param_store(self, slices: list[list[ShardSlice]], spilled: dict[int, Path]) -> list[list[ShardSlice]]:
        """offload_param nvme: moves unit shards into files (adopting those partitioned loading already wrote);
        returns the slices, none stepping a swapped shard."""
        config = self.config.zero_optimization.offload_param
        swapped = choose_swapped(self.units, config.max_in_cpu)
        in_files = {id(unit.bucket) for unit, flat in swapped if flat is unit.trainable}
        self.param_store = build_param_store(
            config.nvme_path,
            self.dp.rank,
            swapped,
            buffer_count=config.buffer_count,
            buffer_size=config.buffer_size,
            # page-locked buffers only help (and only exist) when an accelerator copies from them
            pin_memory=config.pin_memory and self.device.type != "cpu",
            spilled=spilled,
        )

        def own_master(s: ShardSlice) -> ShardSlice:
            # An fp32 master that was the shard itself went to the file with it: the optimizer gets a copy (under
            # optimizer offload every master is replaced by a host or NVMe one anyway).
            if s.aliased and id(s.bucket) in in_files and not self.offload.optimizer:
                return ShardSlice(s.bucket, s.start, s.end, self._slice_values(s).clone(), s.params)
            return s

        slices = [[own_master(s) for s in group] for group in slices]
        for unit in self.units:
            unit.store = self.param_store
        assert self.scheduler is not None
        self.scheduler.param_store = self.param_store
        return slices

    def _init_stage3(self, trainable: list[list[nn.Parameter]], dtypes: DtypePlan, zero: Any) -> tuple:
        leaf = zero.leaf_module
        extra = [*leaf.classes, *leaf.names] if leaf is not None else []
        layout = layout_units(
            self.module,
            find_unit_modules(self.module, self.unit_classes, extra_leaf=extra),
            zero.stage3_param_persistence_threshold,
            model_persistence_threshold=zero.stage3_model_persistence_threshold,
            numel_of=preloaded_numel(self.module),
        )

        def from_rank_0(tensor: torch.Tensor) -> None:
            collectives.broadcast(tensor, 0, self.dp, self.comm_stats_counter)

        parts = build_stage3(
            self.module,
            layout,
            trainable,
            rank=self.dp.rank,
            world_size=self.dp.world_size,
            dtypes=dtypes,
            device=self.device,
            reduce_bucket_numel=zero.reduce_bucket_size,
            contiguous_gradients=zero.contiguous_gradients,
            host_memory=self.host_memory if self.offload.params else None,
            broadcast=from_rank_0,
        )
        self.groups, self.units = parts.persistent_groups, parts.units
        self.scheduler = UnitScheduler(
            parts.units,
            parts.root,
            self.dp,
            self.comm_stats_counter,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            use_all_reduce=zero.stage3_use_all_reduce_for_fetch_params,
            copies=self.host_copies,
        )
        self._unit_hooks = register_unit_hooks(parts.units, self.scheduler)
        self._unit_hooks += register_entry_hooks(self.module, parts.units, self.scheduler)  # sub-module calls
        # Under stage 3 every forward is a collective: transformers' generate() must keep all ranks stepping
        # until the longest sequence is done (synced_gpus). It enables that for modules flagged this way.
        self.module._is_fsdp_managed_module = True
        self._state_dict_guard = PlaceholderStateDictGuard()
        self._unit_hooks.append(self.module.register_state_dict_post_hook(self._state_dict_guard))
        scheduler = self.scheduler

        def on_complete(index: int) -> None:
            unit = parts.unit_of_bucket.get(index)
            if unit is not None:
                scheduler.post_backward(unit)

        return parts.buckets, parts.locations, parts.slices_by_group, on_complete, parts.spilled

    def _order_group_buckets(self) -> tuple[list[GradBucket], dict]:
        position = {param: i for i, param in enumerate(self.module.parameters())}
        entries = [(shard, bucket) for shard in self.groups for bucket in shard.buckets]
        # Launch order = the order backward completes buckets: the bucket whose first parameter comes last in
        # the model completes first ([Note: collective order is the same on every rank]).
        entries.sort(key=lambda e: -min(position[e[0].params[s.param_index]] for s in e[1].plan.slots))
        locations = {}
        for index, (shard, bucket) in enumerate(entries):
            for slot in bucket.plan.slots:
                locations[shard.params[slot.param_index]] = (index, slot)
        return [bucket for _, bucket in entries], locations

    def _build_reducer(self, buckets: list[GradBucket], locations: dict, on_complete: Any) -> GradReducer:
        zero = self.config.zero_optimization
        comm_dtypes = {bucket.comm_dtype for bucket in buckets} or {torch.float32}
        assert len(comm_dtypes) == 1, f"buckets of one engine reduce in one dtype, got {comm_dtypes}"
        scaling = GradScaling(
            self.dp.world_size,
            self.config.prescale_gradients,
            self.config.gradient_predivide_factor,
            comm_dtypes.pop(),
        )
        # Two reductions in flight overlap backward as well as more would, and bound the full-size buffers (stages 2
        # and 3) and the temporaries of a reduction (casts, [Note: reduce-scatter on gloo]) at every stage.
        in_flight = 2 if zero.overlap_comm else 0
        return GradReducer(
            buckets,
            locations,
            self.dp,
            self.comm_stats_counter,
            scaling,
            use_reduce_scatter=zero.reduce_scatter,
            max_in_flight=in_flight,
            ignore_unused_parameters=zero.ignore_unused_parameters,
            param_names={p: n for n, p in self.module.named_parameters()},
            on_bucket_complete=on_complete,
        )

    def _build_sharded_optimizer(self, slices: list[list[ShardSlice]]) -> ShardedOptimizer:
        zero = self.config.zero_optimization
        sharded = self.stage > 0 and self.dp.world_size > 1

        def publish() -> None:
            if sharded:
                all_gather_params(
                    self.groups,
                    self.dp,
                    self.comm_stats_counter,
                    max_numel_in_flight=zero.allgather_bucket_size,
                    use_all_gather=zero.allgather_partitions,
                )
            if self.scheduler is not None:
                self.scheduler.release_all()  # gathered copies are stale now

        return ShardedOptimizer(
            self.optimizer,
            slices,
            self.dp,
            self.comm_stats_counter,
            sharded=sharded,
            gradient_clipping=self.config.gradient_clipping,
            loss_scaler=build_loss_scaler(self.config),
            check_overflow=bool(self.config.fp16.enabled or self.config.bf16.check_overflow),
            publish=publish,
            device=self.device,
            progress=lambda: self.micro_steps,
            copies=self.host_copies,
        )

    # --------------------------------------------------------------- training
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model's forward; under bf16 (fp16: with `auto_cast`) floating inputs are cast to it first,
        `labels=` excepted ([Note: casting forward inputs] in engine/setup.py)."""
        dtype = forward_input_dtype(self.config)
        if dtype is not None:
            args, kwargs = cast_forward_inputs(args, kwargs, dtype)
        with self.step_log.timed("forward"):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagates `loss` divided by the accumulation steps (and times the fp16 loss scale).

        Gradients are reduced while backward runs: at stages 2 and 3 on every call (each bucket as soon as it is
        complete; at stage 3 each unit is released as soon as its gradient is reduced), at stages 0 and 1 only on
        the accumulation boundary (other micro-steps communicate nothing).
        """
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
        if self.is_gradient_accumulation_boundary():
            with self.step_log.timed("step"):
                self._optimizer_step()
        self.micro_steps += 1

    def _optimizer_step(self) -> None:
        self.reducer.finish_step()
        if self.scheduler is not None:
            self.scheduler.end_backward()
        outcome = self.sharded_optimizer.step()
        self.reducer.zero_grad()
        self._global_grad_norm = outcome.grad_norm
        if outcome.overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.step_log.after_step(self)

    def zero_grad(self) -> None:
        """Drops the accumulated gradients (the engine also does this after every optimizer step)."""
        self.reducer.zero_grad()

    # ---------------------------------------------------- accumulation control
    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps or 1)

    def train_batch_size(self) -> int | None:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.config.train_micro_batch_size_per_gpu

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
    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's unscaled gradient, before clipping (None before the first)."""
        return self._global_grad_norm

    @property
    def loss_scale(self) -> float:
        scaler = self.sharded_optimizer.loss_scaler
        return scaler.scale if scaler is not None else 1.0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

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

        def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
            cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            return tensor.detach().to(device="cpu", dtype=cast, copy=True)

        gathered: dict[str, torch.Tensor] = {}
        names: dict[int, list[str]] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        wanted = set(only) if only is not None else None
        for unit in self.units:
            params = [p for flat in unit.flats for p in flat.params]
            if wanted is not None:
                params = [p for p in params if wanted.intersection(names[id(p)])]
                if not params:
                    continue
            with GatheredParameters(params):
                if self.dp.rank == 0:
                    gathered.update({name: to_cpu(p) for p in params for name in names[id(p)]})
        if self.dp.rank != 0:
            return {}
        with self._state_dict_guard.disabled() if self._state_dict_guard else contextlib.nullcontext():
            full = self.module.state_dict()
        return {
            name: gathered[name] if name in gathered else to_cpu(t)
            for name, t in full.items()
            if wanted is None or name in wanted
        }

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """Writes the gathered 16-bit weights as one safetensors file on rank 0; every rank must call it.

        At stage 3 this needs `stage3_gather_16bit_weights_on_model_save: true`. Without it the sharded engine
        state is saved instead (`save_checkpoint(save_dir)`; turn it into weights with
        `accelerate-zero consolidate`) and False is returned, as DeepSpeed does.

        Returns:
            True when the weights file was written.
        """
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
        if self.dp.rank == 0:
            folder = Path(save_dir)
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".{save_filename}.partial"
            save_file({k: v.contiguous() for k, v in state.items()}, str(partial), metadata={"format": "pt"})
            partial.replace(folder / save_filename)  # never a half-written weights file
        if self.dp.world_size > 1:
            collectives.barrier(self.dp)
        return True

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        exclude_frozen_parameters: bool = True,
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
                are not saved] in checkpoint/engine_io.py). DeepSpeed's default is False: pass False for a
                checkpoint that holds the whole model.

        Returns:
            The checkpoint folder.
        """
        return str(save_engine(self, save_dir, tag, client_state, exclude_frozen_parameters))

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> tuple[str, dict]:
        """Restores a checkpoint written by `save_checkpoint`, re-partitioning it for this world size and stage.

        Returns:
            (the checkpoint folder, the client_state saved with it).
        """
        client_state = load_engine(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
        return str(resolve_tag(Path(load_dir), tag)), client_state

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
        return {
            name: torch.empty(views.get(id(t), t).shape, dtype=views.get(id(t), t).dtype, device="meta")
            for name, t in local.items()
            if only is None or name in only
        }

    def units_of(self, params: list[nn.Parameter]) -> list[ParamUnit]:
        """The stage 3 gather units holding any of `params`, in unit order (the same on every rank)."""
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(p) in wanted for flat in u.flats for p in flat.params)]

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds now, per kind, counted from the engine's tensors (each storage once).

        Kinds: parameters (the flat buffers and frozen parameters), gradients (the storage kept across
        micro-steps), master_weights (fp32 copies that are not the parameters themselves), optimizer_states,
        communication_buffers (stage 2 buckets being filled or reduced right now), and total. The peak of the
        latter since the engine started is reported as communication_buffers_peak (not part of total). Offloaded
        state is reported as host_parameters, host_gradients, host_master_weights, host_optimizer_states and
        host_total.
        """
        return engine_memory(self)

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Bytes moved per collective kind since the last `reset_comm_stats()` (see engine/collectives.py)."""
        return self.comm_stats_counter.as_dict()

    def reset_comm_stats(self) -> None:
        self.comm_stats_counter.reset()

    def destroy(self) -> None:
        """Removes the engine's hooks; the model keeps its current weights."""
        self.reducer.remove_hooks()
        if self.grad_store is not None:
            self.grad_store.close()
        if self.sharded_optimizer.swapper is not None:
            self.sharded_optimizer.swapper.close()
        if self.param_store is not None:
            self.param_store.close()
        self.host_copies.drain()  # before the pinned memory they may copy from is unregistered
        self.host_memory.close()
        for handle in getattr(self, "_unit_hooks", []):
            handle.remove()
        unregister_engine_params(self)
