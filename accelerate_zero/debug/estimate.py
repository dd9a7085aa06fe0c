"""What a ZeRO run would hold per rank, counted with the layout functions and rules the engine itself uses.

`estimate_stage(model, setup, stage, offload)` lays the parameters out with `shard_plan.plan_group` as the engine
does (padding per bucket; at stage 3 one padded bucket per gather unit, the units from `find_unit_modules` +
`layout_units`, persistent parameters whole), then counts the bytes of each kind under the names
`ZeroEngine.memory_breakdown()` uses. `tests/distributed/test_estimate_vs_engine.py` compares the two.

[Note: what each stage holds, per rank]
W is the data-parallel world size, c the compute dtype's bytes (2 under bf16/fp16, else 4), g the gradient
dtype's (4: fp32, unless `data_types.grad_accum_dtype` says otherwise; [Note: fp32 gradients under mixed precision]
in config/schema.py).
- stage 0: the full padded flat buffer of parameters (c) and of gradients (g); the optimizer steps the whole
  buffer, so fp32 master weights (only when c != 4: in fp32 they are the parameters) and states are full too.
- stage 1: parameters and gradients full (the reduce-scatter writes the averaged slice in place, into the same
  buffer); master weights and optimizer states cover this rank's slice of every bucket: 1/W.
- stage 2: parameters full; gradients, master weights and states 1/W. While backward runs, the bucket being
  filled holds a full-size gradient (`communication_buffers`: the largest bucket, or the three largest with
  `overlap_comm`: two reductions in flight and one bucket filling).
- stage 3: each gather unit keeps only its 1/W shard (parameters, gradients, master, states); persistent
  parameters are held whole and their gradients, master and states 1/W (a stage-2 group). Units are gathered
  just in time (`gathered_parameters`, see [Note: stage 3 gathered parameters]) and their full gradient exists
  while the unit is reduced (`communication_buffers`).
Optimizer states are fp32 tensors the size of the optimizer's tensors (`OPTIMIZERS`), plus torch's 4-byte `step`
scalar per tensor for Adam and Adagrad. At stages 0-2 an optimizer tensor is a bucket's whole slice (padding
included); at stage 3 the run of a unit's slice that holds parameters (padding excluded), as the engine does.

[Note: what offload would do]
What the engine's offload (and DeepSpeed's) moves, per rank:
- "cpu" (`offload_optimizer.device=cpu`, stages 1-3): master weights (fp32, also when training in fp32: the host
  copy is then a second one) and optimizer states go to CPU RAM, with the fp32 gradient slice the CPU optimizer
  steps. Stages 2 and 3 then keep no gradient shard on the GPU (each reduced bucket is copied out); stage 1 keeps
  its full gradient buffer (the reduce-scatter is in place).
- "cpu+param" (stage 3, as `accelerate_configs/zero3_offload.yaml`): "cpu", and the units' parameter shards in CPU
  RAM; persistent parameters stay on the GPU, gathered units are still gathered on the GPU.
- "nvme" (stage 3, ZeRO-Infinity, as `accelerate_configs/zero3_nvme.yaml`): master weights, optimizer states,
  the fp32 gradient slice and the units' parameter shards on NVMe; on the GPU each reduced gradient slice waits as
  a private fp32 copy until its write lands (`NVME_RESIDENT_SUBGROUPS` of the largest unit shard, counted as
  communication buffers). CPU RAM holds the sub-groups in flight
  during the step: at most `NVME_RESIDENT_SUBGROUPS` (offload_optimizer.buffer_count's default) of
  `sub_group_size` elements, counted as host master weights, optimizer states and gradients. The parameter
  swap buffers (`offload_param.buffer_count` unit shards) are not counted. At stages 1 and 2 DeepSpeed treats NVMe optimizer
  offload as "cpu", and at stage 0 it ignores offload: those combinations are not estimated.

[Note: stage 3 gathered parameters]
The root unit (embeddings, final norm, a tied head) stays gathered for the whole forward; the running unit is
gathered, and the next ones are prefetched up to `stage3_prefetch_bucket_size` elements. With
`stage3_max_reuse_distance` > 0 a unit is kept after its forward while at most `stage3_max_live_parameters`
elements are gathered, so the peak is about max(root + largest unit + prefetch, max_live + largest unit), never
more than the whole model. A bare parameter count has no layers: `shapes_from_count` makes up equal ones.

[Note: activations]
A rough figure, from the standard transformer formula without recomputation (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", no tensor parallelism): per layer s*b*h*34 bytes in 16-bit,
plus 5*a*s^2*b for the attention scores when they are materialized (eager attention; SDPA/flash attention do not
keep them). fp32 training doubles it. With gradient checkpointing each layer keeps only its input (2*s*b*h) and
one layer is recomputed at a time (one layer's full activations). The logits add s*b*V*(c + 8): the logits, their
fp32 copy for the loss and its saved log-softmax. s = sequence length, b = micro batch, h = hidden size,
a = attention heads, V = vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from accelerate_zero.config.schema import DEFAULT_GRAD_ACCUM_DTYPE, ZeroOptimizationConfig, default_overlap_comm
from accelerate_zero.debug.estimate_optimizers import OPTIMIZERS, owner_layout
from accelerate_zero.engine.shard_plan import BucketPlan, plan_group
from accelerate_zero.engine.stage3.units import find_unit_modules, layout_units


Shape = tuple[int, ...]

STAGES = (0, 1, 2, 3)
OFFLOAD_MODES = ("none", "cpu", "cpu+param", "nvme")
NVME_RESIDENT_SUBGROUPS = 4
MODEL_STATE_KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")
"""The kinds `memory_breakdown()` reports that are held across steps (the model states)."""
DEVICE_KINDS = (*MODEL_STATE_KINDS, "communication_buffers", "gathered_parameters")
"""Per-device kinds: the model states, then transient buffers (reduce buckets, stage 3 gathered units)."""

LADDER = (
    (0, "none"),
    (1, "none"),
    (2, "none"),
    (3, "none"),
    (1, "cpu"),
    (2, "cpu"),
    (3, "cpu"),
    (3, "cpu+param"),
    (3, "nvme"),
)
"""Cheapest first: lower stages communicate less (stage 2 before stage 3), and offload only when nothing fits
without it (PCIe is far slower than GPU memory), parameters last."""


_DTYPE_BYTES = {"no": 4, "fp32": 4, "fp16": 2, "bf16": 2}
_MAX_PIECES = 4096


@dataclass(frozen=True)
class Architecture:
    """What the activation estimate needs from a transformer config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int


@dataclass(frozen=True)
class ModelShapes:
    """The trainable parameters of a model, and how stage 3 would group them.

    Build it with `shapes_from_module` (a real or meta-device model) or `shapes_from_count` (a bare count).
    """

    shapes: tuple[Shape, ...]
    """Trainable parameter shapes in `model.parameters()` order: one optimizer param group, as the engine sees it."""
    units: tuple[tuple[Shape, ...], ...]
    """Stage 3: the trainable shapes of each gather unit in `layout_units` order (root unit last); persistent
    parameters are not in any unit."""
    persistent: tuple[Shape, ...]
    """Stage 3: parameters held whole on every rank (`stage3_param_persistence_threshold`), in `shapes` order."""
    exact_units: bool = True
    """False for a bare count: made-up equal tensors stand for the layers, so stage 3 transients are approximate."""
    architecture: Architecture | None = None
    """For the activation estimate; None when unknown."""

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


@dataclass(frozen=True)
class TrainingSetup:
    """The run being estimated (everything but the stage and the offload mode)."""

    world_size: int
    """Data-parallel ranks (GPUs per node x nodes)."""
    mixed_precision: str = "bf16"
    """"no" (fp32), "fp16" or "bf16"."""
    optimizer: str = "adamw"
    """A key of `OPTIMIZERS`."""
    zero: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    """Bucket sizes, stage 3 thresholds and `overlap_comm` (its stage and offload blocks are ignored)."""
    grad_accum_dtype: str | None = None
    """`data_types.grad_accum_dtype`; None: fp32 ([Note: fp32 gradients under mixed precision])."""
    communication_data_type: str | None = None
    """`communication_data_type`; None: the gradient dtype (no cast copy)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size=}")
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(f"mixed_precision must be 'no', 'fp16' or 'bf16', got {self.mixed_precision=}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer=}")

    @property
    def compute_bytes(self) -> int:
        return _DTYPE_BYTES[self.mixed_precision]

    @property
    def grad_bytes(self) -> int:
        return _DTYPE_BYTES[self.grad_accum_dtype or DEFAULT_GRAD_ACCUM_DTYPE]

    @property
    def comm_bytes(self) -> int:
        return _DTYPE_BYTES[self.communication_data_type] if self.communication_data_type else self.grad_bytes

    def overlap_comm(self, stage: int) -> bool:
        """The rule `config.resolve` applies (`default_overlap_comm`)."""
        return self.zero.overlap_comm if self.zero.overlap_comm is not None else default_overlap_comm(stage)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank would hold at one stage and offload mode (see the notes in this module)."""

    stage: int
    offload: str
    device: dict[str, int]
    """GPU bytes per kind (`DEVICE_KINDS`) and "total"."""
    host: dict[str, int]
    """CPU RAM bytes per kind (`MODEL_STATE_KINDS`) and "total", for this rank."""
    nvme: dict[str, int]
    """NVMe bytes per kind (`MODEL_STATE_KINDS`) and "total", for this rank."""

    @property
    def model_states(self) -> int:
        """GPU bytes held across steps: parameters + gradients + master weights + optimizer states."""
        return sum(self.device[kind] for kind in MODEL_STATE_KINDS)


def shapes_from_module(
    model: nn.Module,
    zero: ZeroOptimizationConfig | None = None,
    *,
    unit_classes: Sequence[type[nn.Module] | str] | None = None,
    architecture: Architecture | None = None,
) -> ModelShapes:
    """The shapes of `model`'s trainable parameters and their stage 3 layout, as `ZeroEngine` would make it.

    The model may live on the meta device: only shapes are read.

    Args:
        zero: the stage 3 thresholds and `leaf_module`; None: the defaults.
        unit_classes: as `accelerate_zero.initialize(unit_classes=...)`; None: `model._no_split_modules`, else the
            root's children.
        architecture: for the activation estimate.
    """
    zero = zero if zero is not None else ZeroOptimizationConfig()
    leaf = zero.leaf_module
    extra = [*leaf.classes, *leaf.names] if leaf is not None else []
    layout = layout_units(
        model,
        find_unit_modules(model, unit_classes, extra_leaf=extra),
        zero.stage3_param_persistence_threshold,
        model_persistence_threshold=zero.stage3_model_persistence_threshold,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    persistent = set(layout.persistent)
    return ModelShapes(
        shapes=tuple(tuple(p.shape) for p in trainable),
        units=tuple(tuple(tuple(p.shape) for p in spec.trainable) for spec in layout.units),
        persistent=tuple(tuple(p.shape) for p in trainable if p in persistent),
        architecture=architecture,
    )


def shapes_from_count(
    numel: int, zero: ZeroOptimizationConfig | None = None, *, architecture: Architecture | None = None
) -> ModelShapes:
    """A model known only by its parameter count, as one optimizer param group of equal tensors.

    The tensors have at most `reduce_bucket_size` elements each, so each fills one bucket (padding: at most W - 1
    elements per bucket) and stands for one stage 3 unit; real layer sizes differ, so the stage 3 transient
    buffers are approximate (`exact_units` False). A count within `stage3_param_persistence_threshold` is
    persistent.
    """
    if numel < 1:
        raise ValueError(f"a model needs at least one parameter, got {numel=}")
    zero = zero if zero is not None else ZeroOptimizationConfig()
    numel = int(numel)
    # Capped: a piece larger than the bucket size gets a bucket of its own, which is all that matters here.
    pieces = min(math.ceil(numel / zero.reduce_bucket_size), _MAX_PIECES) if zero.reduce_bucket_size else 1
    shapes = tuple((numel // pieces + (1 if i < numel % pieces else 0),) for i in range(pieces))
    small = numel <= zero.stage3_param_persistence_threshold and numel <= zero.stage3_model_persistence_threshold
    units = ((), ()) if small else (*((shape,) for shape in shapes), ())
    persistent = shapes if small else ()
    return ModelShapes(shapes, units, persistent, exact_units=False, architecture=architecture)


# ------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Held:
    """Element counts one rank holds, before dtypes and offload turn them into bytes."""

    full_params: int
    """Parameter elements held whole (stages 0-2: all of them, padded; stage 3: the persistent ones)."""
    unit_params: int
    """Stage 3: elements of this rank's unit shards."""
    grads: int
    """Gradient elements kept across micro-steps."""
    shard: int
    """Elements of the optimizer's shard (the size of the fp32 master weights)."""
    state_elements: int
    """Elements the optimizer states cover."""
    state_tensors: int
    """Optimizer tensors (one `step` scalar each for Adam/Adagrad)."""
    reduce_buffers: int
    """Peak transient full-gradient elements (buckets being filled or reduced)."""
    cast_buffers: int
    """Peak transient elements cast to `communication_data_type` (0 when no cast is needed)."""
    gathered: int
    """Stage 3: peak transient elements of gathered units."""
    largest_shard: int = 0
    """Stage 3: elements of the largest unit shard (NVMe gradient slices in flight are this size)."""
    owner: tuple[int, int, int] | None = None
    """Whole-tensor optimizers: (elements this rank owns, their state bytes, step buffer bytes); [Note: what the
    owner layout holds, per rank] in debug/estimate_optimizers.py."""


def _largest(numels: Sequence[int], count: int) -> int:
    return sum(sorted(numels, reverse=True)[:count])


def _held_stages_012(model: ModelShapes, setup: TrainingSetup, stage: int) -> _Held:
    plan = plan_group(model.shapes, setup.zero.reduce_bucket_size, 1 if stage == 0 else setup.world_size)
    overlap = setup.overlap_comm(stage)
    bucket_numels = [bucket.numel for bucket in plan.buckets]
    # engine._build_reducer: two reductions in flight at every stage, and a third issued before the oldest is waited.
    in_flight = 3 if overlap else 1
    return _Held(
        full_params=plan.numel,
        unit_params=0,
        grads=plan.shard_numel if stage == 2 else plan.numel,
        shard=plan.shard_numel,
        state_elements=plan.shard_numel,
        state_tensors=len(plan.buckets),
        reduce_buffers=_largest(bucket_numels, in_flight) if stage == 2 else 0,
        cast_buffers=_largest(bucket_numels, in_flight) if setup.comm_bytes != setup.grad_bytes else 0,
        gathered=0,
    )


def _owned_elements(bucket: BucketPlan, rank: int) -> int:
    spans = [bucket.slot_overlap(slot, rank) for slot in bucket.slots]
    return sum(span[1] - span[0] for span in spans if span is not None)


def _held_stage3(model: ModelShapes, setup: TrainingSetup, rank: int) -> _Held:
    world, zero = setup.world_size, setup.zero
    persistent = plan_group(model.persistent, zero.reduce_bucket_size, world)
    # param_unit.build_flat: a unit is one bucket, however large.
    units = [plan_group(shapes, sys.maxsize, world).buckets[0] if shapes else None for shapes in model.units]
    planned = [unit for unit in units if unit is not None]
    unit_shard = sum(unit.shard_numel for unit in planned)
    owned = [_owned_elements(unit, rank) for unit in planned]
    bucket_numels = [unit.numel for unit in planned] + [bucket.numel for bucket in persistent.buckets]
    in_flight = 3 if setup.overlap_comm(3) else 1
    return _Held(
        full_params=persistent.numel,
        unit_params=unit_shard,
        grads=persistent.shard_numel + unit_shard,
        shard=persistent.shard_numel + unit_shard,
        state_elements=persistent.shard_numel + sum(owned),
        state_tensors=len(persistent.buckets) + sum(1 for n in owned if n > 0),
        reduce_buffers=_largest(bucket_numels, in_flight),
        cast_buffers=_largest(bucket_numels, in_flight) if setup.comm_bytes != setup.grad_bytes else 0,
        gathered=_gathered_peak([unit.numel if unit else 0 for unit in units], zero),
        largest_shard=max((unit.shard_numel for unit in planned), default=0),
    )


def _gathered_peak(unit_numels: list[int], zero: ZeroOptimizationConfig) -> int:
    """[Note: stage 3 gathered parameters]; `unit_numels` padded, root unit last."""
    total = sum(unit_numels)
    *layers, root = unit_numels
    largest = max(layers, default=0)
    peak = root + largest + min(zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters)
    if zero.stage3_max_reuse_distance > 0:
        peak = max(peak, zero.stage3_max_live_parameters + largest)
    return min(total, peak)


# ------------------------------------------------------------------------------------------------- bytes
def is_applicable(stage: int, offload: str) -> bool:
    """Whether DeepSpeed has this combination ([Note: what offload would do])."""
    if stage not in STAGES or offload not in OFFLOAD_MODES:
        return False
    return offload == "none" or (offload == "cpu" and stage > 0) or stage == 3


def estimate_stage(
    model: ModelShapes, setup: TrainingSetup, stage: int, offload: str = "none", *, rank: int | None = None
) -> MemoryEstimate:
    """Bytes `rank` would hold at `stage` with `offload` (see the notes in this module).

    Args:
        model: from `shapes_from_module` or `shapes_from_count`.
        setup: world size, precision, optimizer and ZeRO knobs.
        stage: 0, 1, 2 or 3.
        offload: one of `OFFLOAD_MODES`.
        rank: the rank to count; None: the one holding most (for flat shards ranks differ only by where the padding
            falls, so rank 0; for whole parameters on owners, the most loaded owner).

    Returns:
        GPU, CPU RAM and NVMe bytes per kind for this rank.

    Raises:
        ValueError: for a combination `is_applicable` refuses, or a rank outside the world.
    """
    if not is_applicable(stage, offload):
        raise ValueError(f"no estimate for {stage=} with {offload=}: see is_applicable()")
    if rank is not None and not 0 <= rank < setup.world_size:
        raise ValueError(f"rank must be in [0, {setup.world_size}), got {rank=}")
    layout = None
    if OPTIMIZERS[setup.optimizer].whole_tensors:
        args = (model.shapes, model.units, model.persistent, stage, setup.world_size, setup.zero.reduce_bucket_size)
        layout = owner_layout(*args, setup.optimizer)
    if rank is None:
        rank = 0 if layout is None else layout.heaviest
    held = _held_stage3(model, setup, rank) if stage == 3 else _held_stages_012(model, setup, stage)
    if layout is not None:
        moved = layout.moved[rank] + layout.received(rank)  # each way: gradients (g bytes), values (c bytes)
        buffers = layout.assembled[rank] * 4 + moved * (setup.grad_bytes + setup.compute_bytes)
        held = dataclasses.replace(held, owner=(layout.owned[rank], layout.state_bytes[rank], buffers))
    return _to_bytes(held, setup, stage, offload)


def _to_bytes(held: _Held, setup: TrainingSetup, stage: int, offload: str) -> MemoryEstimate:
    c, g = setup.compute_bytes, setup.grad_bytes
    states = OPTIMIZERS[setup.optimizer]
    offload_optimizer, offload_params = offload != "none", offload in ("cpu+param", "nvme")
    device = {
        "parameters": held.full_params * c + (0 if offload_params else held.unit_params * c),
        "gradients": 0 if offload_optimizer and stage >= 2 else held.grads * g,
        # In fp32 the master weights are the parameters themselves, unless the optimizer runs elsewhere.
        "master_weights": held.shard * 4 if c != 4 and not offload_optimizer else 0,
        "optimizer_states": 0,
        "communication_buffers": held.reduce_buffers * g + held.cast_buffers * setup.comm_bytes,
        "gathered_parameters": held.gathered * c,
    }
    optimizer_bytes = held.state_elements * 4 * states.per_element + held.state_tensors * 4 * states.scalars
    masters = held.shard
    if held.owner is not None:  # whole parameters on owners: their own fp32 masters, even in fp32 training
        masters, optimizer_bytes = held.owner[0], held.owner[1]
        device["master_weights"] = 0 if offload_optimizer else masters * 4
        device["communication_buffers"] += held.owner[2]
    host = dict.fromkeys(MODEL_STATE_KINDS, 0)
    nvme = dict.fromkeys(MODEL_STATE_KINDS, 0)
    if not offload_optimizer:
        device["optimizer_states"] = optimizer_bytes
    else:
        target = nvme if offload == "nvme" else host
        target["master_weights"] = masters * 4
        target["optimizer_states"] = optimizer_bytes
        target["gradients"] = held.shard * 4  # the fp32 gradient slice the CPU optimizer steps
        if offload == "nvme":
            resident = min(held.shard, NVME_RESIDENT_SUBGROUPS * setup.zero.sub_group_size)
            host["master_weights"] = host["gradients"] = resident * 4
            host["optimizer_states"] = resident * 4 * states.per_element
    if offload == "nvme":
        # offload/nvme_grads.py: each reduced slice is copied to a private fp32 device tensor that lives until its
        # write to the file lands, at most `buffer_count` (default NVME_RESIDENT_SUBGROUPS) at once.
        device["communication_buffers"] += NVME_RESIDENT_SUBGROUPS * held.largest_shard * 4
    if offload_params:
        (nvme if offload == "nvme" else host)["parameters"] = held.unit_params * c
    for kinds in (device, host, nvme):
        kinds["total"] = sum(kinds.values())
    return MemoryEstimate(stage=stage, offload=offload, device=device, host=host, nvme=nvme)


# ------------------------------------------------------------------------------------------- activations
def activation_bytes(
    architecture: Architecture,
    *,
    micro_batch: int,
    seq_len: int,
    compute_bytes: int,
    gradient_checkpointing: bool = False,
    eager_attention: bool = False,
    sequence_parallel: int = 1,
    tile_tokens: int | None = None,
) -> int:
    """Rough activation bytes of one rank's forward + backward ([Note: activations]). `sequence_parallel`: the
    rank holds 1/p of each sequence and the scores of 1/p of the heads over all of it; `tile_tokens`: the MLP's
    intermediates (15 of the 34 s b h) and the logits exist for one tile at a time (accelerate_zero/sequence)."""
    b, h = micro_batch, architecture.hidden_size
    s, a = -(-seq_len // sequence_parallel), architecture.num_heads / sequence_parallel
    per_layer = (34 - (15 if tile_tokens else 0)) * s * b * h + (
        5 * a * seq_len * seq_len * b if eager_attention else 0
    )
    if gradient_checkpointing:
        layers = architecture.num_layers * 2 * s * b * h + per_layer
    else:
        layers = architecture.num_layers * per_layer
    logits = min(s, tile_tokens or s) * b * architecture.vocab_size * (compute_bytes + 8)
    return int(layers * compute_bytes / 2) + logits


# -------------------------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Budget:
    """What one node offers; None means not checked."""

    gpu_bytes: int | None
    """Usable bytes per GPU (after headroom)."""
    cpu_bytes: int | None = None
    """CPU RAM per node."""
    nvme_bytes: int | None = None
    """NVMe space per node."""
    gpus_per_node: int = 1


def fits(estimate: MemoryEstimate, activations: int, budget: Budget) -> bool | None:
    """Whether the GPU total plus `activations`, and the node's CPU RAM and NVMe, stay within `budget`.

    Returns:
        None when `budget.gpu_bytes` is None (nothing to compare with).
    """
    if budget.gpu_bytes is None:
        return None
    checks = [(estimate.device["total"] + activations, budget.gpu_bytes)]
    checks.append((estimate.host["total"] * budget.gpus_per_node, budget.cpu_bytes))
    checks.append((estimate.nvme["total"] * budget.gpus_per_node, budget.nvme_bytes))
    return all(limit is None or need <= limit for need, limit in checks)


def recommend(verdicts: dict[tuple[int, str], bool | None]) -> tuple[int, str] | None:
    """The first (stage, offload) of `LADDER` whose verdict is True; None when none fits or none was checked."""
    return next((key for key in LADDER if verdicts.get(key) is True), None)
