"""The composition root: builds a stage's parts from one resolved config, once; `ZeroEngine` only runs them.

A stage is a composition, not a flag:
- stage 0: buckets all-reduced (ALL_REDUCE), one shard per rank holding everything (data parallelism);
- stage 1: buckets reduce-scattered at the accumulation boundary (SCATTER_IN_PLACE), optimizer on the shard;
- stage 2: buckets reduce-scattered on every micro-step into shard-sized gradients (SCATTER_TO_SHARD);
- stage 3: stage 2 per unit, with each unit's parameters sharded and gathered on use (engine/stage3/).
Offload is where the shards live ([Note: offload is a store, not a flag] in engine/stores.py): the stores are
chosen here from the config and handed to the constructors that use them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accelerate_zero.config import ResolvedZeroConfig
from accelerate_zero.config.schema import DEFAULT_GRAD_ACCUM_DTYPE
from accelerate_zero.engine import collectives, quantized_comm, setup
from accelerate_zero.engine.activation_offload import ActivationsToHost
from accelerate_zero.engine.buckets import GradBucket, GradScaling, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.experts import gather_units, partition
from accelerate_zero.engine.experts.parallel import ExpertPlacement
from accelerate_zero.engine.flat_buffer import GroupShard, all_gather_params, build_group_shard, group_slices
from accelerate_zero.engine.grad_reduce import GradReducer, reductions_in_flight
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.host_grads import HostGradient, HostStaging
from accelerate_zero.engine.kept_grads import KeptGradient
from accelerate_zero.engine.layout import ShardingLayout
from accelerate_zero.engine.loss_scaler import build_loss_scaler
from accelerate_zero.engine.quantized_comm import QuantizedReduceScatter
from accelerate_zero.engine.scratch import ScratchBuffers
from accelerate_zero.engine.setup import build_optimizer_for, dtype_from_name, trainable_param_groups
from accelerate_zero.engine.shard_plan import BucketPlan, plan_group
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.sharded_optimizer import ShardedOptimizer
from accelerate_zero.engine.stage3.build import DtypePlan, build_stage3, plan_units
from accelerate_zero.engine.stage3.external import attach_registered
from accelerate_zero.engine.stage3.hooks import PlaceholderStateDictGuard, register_entry_hooks, register_unit_hooks
from accelerate_zero.engine.stage3.loading import preloaded_numel
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stage3.schedule import UnitScheduler
from accelerate_zero.engine.step_layout import choose_step_layout, owned_step_for
from accelerate_zero.engine.stores import ShardsInMemory, ShardStore, StepRunner, StepsInMemory
from accelerate_zero.offload.host_memory import HostMemory
from accelerate_zero.offload.host_threads import HostThreads, host_threads_for
from accelerate_zero.offload.nvme import NvmeSwapper, check_nvme_path
from accelerate_zero.offload.nvme_grads import NvmeGradStore
from accelerate_zero.offload.nvme_params import NvmeParamStore
from accelerate_zero.offload.pipelined_step import PipelinedHostStep
from accelerate_zero.offload.policy import OffloadPolicy, offload_masters, offload_policy
from accelerate_zero.optim.fused import choose_fused_kernels


_MODE_BY_STAGE = {0: ReduceMode.ALL_REDUCE, 1: ReduceMode.SCATTER_IN_PLACE, 2: ReduceMode.SCATTER_TO_SHARD}


@dataclass
class EngineParts:
    """What `assemble` built: everything `ZeroEngine` runs, typed, nothing wired in later."""

    optimizer: torch.optim.Optimizer
    offload: OffloadPolicy
    host_copies: HostCopies
    host_memory: HostMemory
    groups: list[GroupShard]
    """Stages 0-2: one flat shard per param group; stage 3: the persistent parameters'."""
    units: list[ParamUnit]
    """Stage 3: the gather units, in unit order (empty at stages 0-2)."""
    scheduler: UnitScheduler | None
    state_dict_guard: PlaceholderStateDictGuard | None
    hooks: list[RemovableHandle]
    reducer: GradReducer
    sharded_optimizer: ShardedOptimizer
    shard_store: ShardStore
    step_runner: StepRunner
    grad_store: NvmeGradStore | None
    host_staging: HostStaging | None
    activation_offload: ActivationsToHost | None = None
    experts: ExpertPlacement | None = None
    """`expert_parallel`: the split MoE layers and this rank's experts ([Note: expert parallelism in the engine] in
    engine/experts/partition.py); None when off."""
    """`activation_checkpointing.cpu_checkpointing`: the hooks keeping saved activations in host memory and what
    they moved (its handles are in `hooks`)."""


def assemble(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ResolvedZeroConfig,
    *,
    layout: ShardingLayout,
    device: torch.device,
    stats: CommStats,
    progress: Callable[[], int],
    unit_classes: list[type[nn.Module] | str] | None = None,
) -> EngineParts:
    """Places `module` on `device` (stage 3: sharded unit by unit), builds or adopts the optimizer and builds the
    stage's buckets, units, stores and sharded optimizer. `progress`: the engine's micro-step counter."""
    return _Assembly(module, config, layout, device, stats, unit_classes).build(optimizer, progress)


class _Assembly:
    """The build in order; the attributes are the parts made so far (read by the later steps)."""

    def __init__(
        self,
        module: nn.Module,
        config: ResolvedZeroConfig,
        layout: ShardingLayout,
        device: torch.device,
        stats: CommStats,
        unit_classes: list[type[nn.Module] | str] | None,
    ) -> None:
        self.module, self.config, self.device, self.stats = module, config, device, stats
        self.layout, self.dp, self.world = layout, layout.shard, layout.world
        """`dp`: the ranks the state is partitioned over; `world`: every rank ([Note: the three hierarchical
        layouts] in engine/layout.py)."""
        self.unit_classes = unit_classes
        self.stage = config.zero_optimization.stage
        self.offload = offload_policy(config)
        self.host_copies = HostCopies(device)
        self.scratch = ScratchBuffers(device)  # [Note: temporaries reused in host memory]
        # [Note: pinned memory at its size] in offload/host_memory.py
        self.host_memory = HostMemory(pin=self.offload.pin_memory and device.type == "cuda")
        self.shard_store: ShardStore = ShardsInMemory()
        if self.offload.param_nvme_path is not None and self.stage == 3:
            params = config.zero_optimization.offload_param
            self.shard_store = NvmeParamStore(
                params.nvme_path,
                self.world.rank,  # replicas of a shard on one node must not share a folder
                buffer_count=params.buffer_count,
                buffer_size=params.buffer_size,
                max_in_cpu=params.max_in_cpu,
                # page-locked buffers only help (and only exist) when an accelerator copies from them
                pin_memory=params.pin_memory and device.type != "cpu",
            )
        self.grad_store: NvmeGradStore | None = None
        self.host_staging: HostStaging | None = None
        if self.offload.optimizer:
            self.host_staging = HostStaging(lambda numel: self.host_memory.zeros(numel, torch.float32))
            if self.offload.nvme_path is not None:
                self.grad_store = NvmeGradStore(self.offload.buffer_count, self.host_copies)
        self.groups: list[GroupShard] = []
        self.units: list[ParamUnit] = []
        self.scheduler: UnitScheduler | None = None
        self.state_dict_guard: PlaceholderStateDictGuard | None = None
        self.hooks: list[RemovableHandle] = []
        self.experts: ExpertPlacement | None = None
        self.expert_groups: list[tuple[int, GroupShard]] = []  # (optimizer param group, its experts' flat group)

    def build(self, optimizer: torch.optim.Optimizer | None, progress: Callable[[], int]) -> EngineParts:
        config, zero = self.config, self.config.zero_optimization
        # First: every later step sees this rank's experts only ([Note: expert parallelism in the engine]).
        self.experts = partition.split_for_engine(self.module, self.layout, self.stats, config.expert_parallel)
        optimizer = build_optimizer_for(self.module, optimizer, config)
        # [Note: fp32 gradients under mixed precision] in config/schema.py
        grad_dtype = dtype_from_name(config.data_types.grad_accum_dtype or DEFAULT_GRAD_ACCUM_DTYPE)
        comm_dtype = dtype_from_name(config.communication_data_type) or grad_dtype
        dtypes = DtypePlan(config.compute_dtype, grad_dtype, comm_dtype)
        trainable, experts = partition.split_trainable(trainable_param_groups(self.module, optimizer), self.experts)
        self.step_layout = layout = choose_step_layout(optimizer, trainable, config)  # may refuse the optimizer
        if self.offload.optimizer:
            # Gradients go to host memory as each bucket is reduced: no device gradient shard is kept.
            zero = dataclasses.replace(zero, contiguous_gradients=False)
        mode = _MODE_BY_STAGE[min(self.stage, 2)]
        make = lambda *cut: self._group_shard(*cut, dtypes, zero)  # noqa: E731
        if self.stage == 3:  # the split experts: in units over their peers, or as at stage 2 (planned there)
            buckets, locations, slices, on_complete = self._build_stage3(trainable, experts, dtypes, zero, make)
        else:
            self.expert_groups = partition.build_expert_groups(experts, self.layout, mode, make)
            buckets, locations, slices, on_complete = self._build_flat_groups(trainable, dtypes, zero)
            self._place_rest()
        if self.expert_groups:
            self.groups, buckets, locations, slices, on_complete = partition.with_expert_groups(
                self.module, self.groups, buckets, slices, on_complete, self.expert_groups
            )
        slices, held = layout.split(slices)  # the whole-tensor groups are stepped by their owners
        if self.offload.optimizer:
            # [Note: no device masters under optimizer offload]
            # The fp32 masters live in host memory only: the slices were cut with the parameters as their masters
            # (no fp32 copy of the shard on the device, 4 bytes per parameter / W that would only be copied out and
            # dropped), and here each gets its host master, cast from the parameters one slice at a time.
            slices = offload_masters(slices, self.offload, self._slice_values, self.host_memory)
        choose_fused_kernels(optimizer, [s.master for group in slices for s in group], self.offload.optimizer)
        step_runner = self._nvme_optimizer(slices, zero)
        reducer = self._build_reducer(buckets, locations, on_complete)
        reducer.register_hooks()
        if self.scheduler is not None:
            self.scheduler.register_before_unit_backward(lambda unit: reducer.gradients_coming(unit.bucket))
        self.owned = owned_step_for(layout, buckets, held, self.dp, self.stats, config, self.device, self.host_memory)
        sharded_optimizer = self._build_sharded_optimizer(optimizer, slices, step_runner, progress)
        sharded_optimizer.switch_param_groups()
        activations = None
        if config.activation_checkpointing.cpu_checkpointing:  # [Note: activations in host memory]
            # Attached last: its pre-hook goes first and its post-hook runs last, around every other hook.
            activations = ActivationsToHost(self.device, pin_memory=True)
            self.hooks += activations.attach(self.module)
        return EngineParts(
            optimizer=optimizer,
            offload=self.offload,
            host_copies=self.host_copies,
            host_memory=self.host_memory,
            groups=self.groups,
            units=self.units,
            scheduler=self.scheduler,
            state_dict_guard=self.state_dict_guard,
            hooks=self.hooks,
            reducer=reducer,
            sharded_optimizer=sharded_optimizer,
            shard_store=self.shard_store,
            step_runner=sharded_optimizer.step_runner,
            grad_store=self.grad_store,
            host_staging=self.host_staging,
            activation_offload=activations,
            experts=self.experts,
        )

    # ------------------------------------------------------------ stages 0-2
    # [Note: stages 0-2 initialisation, straight into the flat buffers]
    # Moving the whole module to the device and then flattening it held the model twice on the device at once (in its
    # loaded dtype, and the flat buffers in the compute dtype). Instead each trainable parameter is copied from where
    # the user built it (host memory, usually) into its group's flat buffer on the device, cast on the way, and
    # re-pointed at its view, so its original can go at once (flat_buffer.flatten_params); then the rest (frozen
    # parameters, buffers) is moved and cast, and everything is made rank 0's: one broadcast per flat buffer.
    def _place_rest(self) -> None:
        # Not `module.to(device)`: it would also "move" the flattened parameters, and a move that copies (seen:
        # accelerate's CPU device "cpu:0" against tensors on "cpu", now normalised in groups.resolve_device) leaves
        # them no longer views of their flat buffer, so the optimizer steps values the model never reads
        # (tests/integration/test_zero_accelerator.py caught it). Only what was not flattened is moved.
        flattened = {id(p) for shard in [*self.groups, *(g for _, g in self.expert_groups)] for p in shard.params}
        compute_dtype = self.config.compute_dtype
        others = [p for p in self.module.parameters() if id(p) not in flattened]
        for param in others:
            dtype = compute_dtype if param.is_floating_point() else param.dtype
            param.data = param.data.to(device=self.device, dtype=dtype)
        for buffer in self.module.buffers():
            buffer.data = buffer.data.to(self.device)
        # Every rank starts from rank 0's weights and buffers, as DDP and DeepSpeed do (a split layer's experts:
        # rank 0's were broadcast before the split).
        own = {id(p) for p in self.experts.expert_parameters()} if self.experts is not None else set()
        shared = [p for p in others if id(p) not in own]
        for tensor in [*(shard.param_buffer for shard in self.groups), *shared, *self.module.buffers()]:
            collectives.broadcast(tensor.data, 0, self.world, self.stats)

    def _build_flat_groups(self, trainable: list[list[nn.Parameter]], dtypes: DtypePlan, zero: Any) -> tuple:
        num_shards = 1 if self.stage == 0 else self.dp.world_size
        rank = self.dp.rank if num_shards > 1 else 0
        self.groups = [
            self._group_shard(p, num_shards, rank, _MODE_BY_STAGE[self.stage], dtypes, zero) for p in trainable
        ]
        position = {param: i for i, param in enumerate(self.module.parameters())}
        entries = [(shard, bucket) for shard in self.groups for bucket in shard.buckets]
        # Launch order = the order backward completes buckets: the bucket whose first parameter comes last in
        # the model completes first ([Note: collective order is the same on every rank]).
        entries.sort(key=lambda e: -min(position[e[0].params[s.param_index]] for s in e[1].plan.slots))
        locations = {}
        for index, (shard, bucket) in enumerate(entries):
            for slot in bucket.plan.slots:
                locations[shard.params[slot.param_index]] = (index, slot)
        slices = [group_slices(shard) for shard in self.groups]
        return [bucket for _, bucket in entries], locations, slices, None

    def _group_shard(
        self, params: list[nn.Parameter], num_shards: int, rank: int, mode: ReduceMode, dtypes: DtypePlan, zero: Any
    ) -> GroupShard:
        return build_group_shard(
            params,
            plan_group([tuple(p.shape) for p in params], zero.reduce_bucket_size, num_shards),
            rank=rank,
            mode=mode,
            compute_dtype=dtypes.compute,
            grad_dtype=dtypes.grad,
            comm_dtype=dtypes.comm,
            device=self.device,
            contiguous_gradients=zero.contiguous_gradients,
            kept_for=self._kept_for,
            scratch=self.scratch,
            # [Note: no device masters under optimizer offload]; a whole-tensor group's masters are its owners'
            fp32_master=not (self.offload.optimizer or self.step_layout.steps_any(params)),
        )

    # ---------------------------------------------------------------- stage 3
    def _build_stage3(self, trainable: list, experts: list, dtypes: DtypePlan, zero: Any, make: Callable) -> tuple:
        split = self.experts.expert_parameters() if self.experts is not None else ()
        layout = plan_units(self.module, zero, self.unit_classes, preloaded_numel(self.module), exclude=split)
        own_units, trainable, experts = gather_units.for_stage3(
            self.module, self.experts, self.layout.expert_peers, layout, trainable, experts, zero, dtypes,
            self.device, store=self.shard_store, to_host=self.offload.params, kept_for=self._kept_for,
            scratch=self.scratch,
        )  # fmt: skip
        self.expert_groups = partition.build_expert_groups(experts, self.layout, ReduceMode.SCATTER_TO_SHARD, make)

        world, shard_of = self.world, self.layout.shard_index_of

        def from_rank_0(tensor: torch.Tensor) -> None:
            collectives.broadcast(tensor, 0, world, self.stats)

        def cut_on_rank_0(output: torch.Tensor, shards: list[torch.Tensor] | None) -> None:
            # Every replica of shard j gets rank 0's shard j: views, no copy ([Note: rank 0's weights, cut on rank 0]).
            per_rank = None if shards is None else [shards[shard_of(r)] for r in range(world.world_size)]
            collectives.scatter(output, per_rank, world, self.stats)

        parts = build_stage3(
            self.module,
            layout,
            trainable,
            rank=self.dp.rank,
            world_size=self.dp.world_size,
            cuts=self.world.rank == 0,
            dtypes=dtypes,
            device=self.device,
            reduce_bucket_numel=zero.reduce_bucket_size,
            contiguous_gradients=zero.contiguous_gradients,
            host_memory=self.host_memory if self.offload.params else None,
            broadcast=from_rank_0,
            scatter=cut_on_rank_0,
            shard_store=self.shard_store,
            kept_for=self._kept_for,
            scratch=self.scratch,
            fp32_masters=not self.offload.optimizer,  # [Note: no device masters under optimizer offload]
            own_group_units=own_units,
        )
        self.groups, self.units = parts.persistent_groups, parts.units
        slices = parts.slices_by_group
        if isinstance(self.shard_store, NvmeParamStore):  # first: the masters read swapped shards from files
            slices = self._own_masters(slices)
        self.scheduler = scheduler = UnitScheduler(
            parts.units,
            parts.root,
            self.dp,
            self.stats,
            secondary=self.layout.secondary,
            weight_quantization=quantized_comm.WEIGHTS if zero.zero_quantized_weights else None,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            use_all_reduce=zero.stage3_use_all_reduce_for_fetch_params,
            copies=self.host_copies,
            shard_store=self.shard_store,
        )
        self.hooks = register_unit_hooks(parts.units, scheduler)
        self.hooks += register_entry_hooks(self.module, parts.units, scheduler)  # sub-module calls
        attach_registered(self.module, parts.units)  # register_external_parameter before initialize
        setup.keep_generate_in_step(self.module)  # under stage 3 every forward is a collective
        self.state_dict_guard = PlaceholderStateDictGuard()
        self.hooks.append(self.module.register_state_dict_post_hook(self.state_dict_guard))

        unit_of_bucket = parts.unit_of_bucket  # not `parts`: the hook would keep its first slices alive

        def on_complete(index: int) -> None:
            unit = unit_of_bucket.get(index)
            if unit is not None:
                scheduler.post_backward(unit)

        return parts.buckets, parts.locations, slices, on_complete

    def _own_masters(self, slices: list[list[ShardSlice]]) -> list[list[ShardSlice]]:
        """offload_param nvme: the slices of shards now in files get fp32 masters of their own, read from the files
        (the shard they were cut from is an empty placeholder; under optimizer offload every master is replaced by
        a host or NVMe one anyway)."""
        store = self.shard_store

        def own_master(s: ShardSlice) -> ShardSlice:
            if store.holds(s) and not self.offload.optimizer:
                return ShardSlice(s.bucket, s.start, s.end, store.read_slice(s).to(torch.float32, copy=True), s.params)
            return s

        return [[own_master(s) for s in group] for group in slices]

    def _slice_values(self, shard_slice: ShardSlice) -> torch.Tensor:
        """The parameter values of a slice (read from its file when the parameter store holds its shard)."""
        return self.shard_store.read_slice(shard_slice) if self.shard_store.holds(shard_slice) else shard_slice.params

    # --------------------------------------------------------------- offload
    def _kept_for(self, plan: BucketPlan, mode: ReduceMode) -> KeptGradient | None:
        """Where a bucket keeps its averaged slice ([Note: a reduced gradient has one home] in
        engine/kept_grads.py): under optimizer offload in host memory, or at stages 2/3 on NVMe in the gradient file
        (stages 0 and 1 hold their full gradient on the device anyway); else on the device (None)."""
        if self.grad_store is not None and mode is ReduceMode.SCATTER_TO_SHARD:
            return self.grad_store.slot(plan.shard_numel)
        if self.host_staging is not None:
            return HostGradient(
                plan.shard_numel,
                self.host_staging,
                self.host_copies,
                lambda numel: self.host_memory.zeros(numel, torch.float32),
            )
        return None

    def _nvme_optimizer(self, slices: list[list[ShardSlice]], zero: Any) -> StepRunner:
        """offload_optimizer nvme: masters and state step sub-group by sub-group from files, beside the gradient
        file; cpu: in memory, chunk by chunk ([Note: the pipelined host step] in offload/pipelined_step.py).
        Otherwise: all in memory, at once."""
        if self.offload.nvme_path is None:
            if self.offload.optimizer:
                return PipelinedHostStep(slices, zero.sub_group_size)
            return StepsInMemory([s for group in slices for s in group])
        assert self.grad_store is not None
        folder = check_nvme_path(
            self.offload.nvme_path,
            self.world.rank,  # replicas of a shard on one node must not share a folder
            sum(s.end - s.start for group in slices for s in group),
            self.grad_store.numel,
            world_size=self.world.world_size,
            barrier=lambda: collectives.barrier(self.world),
        )
        swapper = NvmeSwapper(folder, slices, zero.sub_group_size, self.offload.buffer_count, self._slice_values)
        self.grad_store.open(folder / "gradients.bin")
        return swapper

    # ------------------------------------------------------ reduction and step
    def _build_reducer(self, buckets: list[GradBucket], locations: dict, on_complete: Any) -> GradReducer:
        config, zero = self.config, self.config.zero_optimization
        comm_dtypes = {bucket.comm_dtype for bucket in buckets} or {torch.float32}
        assert len(comm_dtypes) == 1, f"buckets of one engine reduce in one dtype, got {comm_dtypes}"
        scaling = GradScaling(  # averaged over every rank: replicas included
            self.world.world_size, config.prescale_gradients, config.gradient_predivide_factor, comm_dtypes.pop()
        )
        # Reductions in flight bound the full-size buffers (stages 2/3) and a reduction's temporaries ([Note:
        # reductions in flight on gloo]): two, or one on gloo at stage 3.
        units = self.scheduler is not None
        in_flight = reductions_in_flight(zero.overlap_comm, buckets, self.dp, zero.reduce_scatter, units=units)
        return GradReducer(
            buckets,
            locations,
            self.dp,
            self.stats,
            scaling,
            replicate=self.layout.replicate,
            quantized=self._quantized_reduce_scatter(),
            use_reduce_scatter=zero.reduce_scatter,
            max_in_flight=in_flight,
            ignore_unused_parameters=zero.ignore_unused_parameters,
            param_names={p: n for n, p in self.module.named_parameters()},
            on_bucket_complete=on_complete,
            scratch=self.scratch,
            keeps_autograd_grads=self.scheduler is not None,
        )

    def _quantized_reduce_scatter(self) -> QuantizedReduceScatter | None:
        """qgZ (`zero_quantized_gradients`): the layout built its node and across-node groups."""
        if self.layout.two_level is None:
            return None
        return QuantizedReduceScatter(self.layout.two_level, quantized_comm.GRADIENTS)

    def _build_sharded_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        slices: list[list[ShardSlice]],
        step_runner: StepRunner,
        progress: Callable[[], int],
    ) -> ShardedOptimizer:
        zero = self.config.zero_optimization
        sharded = self.stage > 0 and self.dp.world_size > 1
        groups, scheduler = self.groups, self.scheduler

        def publish() -> None:
            if sharded:
                all_gather_params(
                    groups,
                    self.dp,
                    self.stats,
                    max_numel_in_flight=zero.allgather_bucket_size,
                    use_all_gather=zero.allgather_partitions,
                )
            if scheduler is not None:
                scheduler.release_all()  # gathered copies are stale now

        return ShardedOptimizer(
            optimizer,
            slices,
            self.dp,
            self.stats,
            sharded=sharded,
            gradient_clipping=self.config.gradient_clipping,
            loss_scaler=build_loss_scaler(self.config),
            check_overflow=bool(self.config.fp16.enabled or self.config.bf16.check_overflow),
            publish=publish,
            device=self.device,
            progress=progress,
            copies=self.host_copies,
            step_runner=step_runner,
            shard_store=self.shard_store,
            host_threads=self._host_threads(),
            owned=self.owned,  # engine/owned_step.py: the whole-tensor param groups
        )

    def _host_threads(self) -> HostThreads | None:
        """[Note: threads for host work] in offload/host_threads.py: only an offloaded step beside a GPU."""
        offload = self.config.zero_optimization.offload_optimizer
        share = offload.cpuadam_cores_perc if offload is not None else None
        return host_threads_for(self.device, self.offload.optimizer, share)
