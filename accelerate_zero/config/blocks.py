"""The blocks of a DeepSpeed config (`fp16`, `zero_optimization`, `offload_optimizer`, ...): one `kw_only` dataclass
each, whose attribute names are the JSON keys users write. Defaults and the deliberate differences from DeepSpeed
are listed in config/schema.py, which assembles them into `ZeroConfig`."""

from __future__ import annotations

import copy
import dataclasses
import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from accelerate_zero.config.fields import normalize_fields
from accelerate_zero.config.values import ZeroConfigError


# [Note: gradient reduction overlaps backward by default] (module docstring)
DEFAULT_REDUCE_BUCKET_SIZE = 50_000_000


def default_overlap_comm(stage: int) -> bool:
    """`overlap_comm` when the config does not set it: on at every stage (DeepSpeed: stage 3 only)."""
    del stage  # the same at every stage; kept so that callers say which stage they ask for
    return True


OffloadDevice = Literal["none", "cpu", "nvme"]
DataType = Literal["fp32", "fp16", "bf16"]


def _f(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **constraints: Any) -> Any:
    """A dataclass field whose `metadata` holds its constraints (ge, le, gt, case, inf_is_none)."""
    if factory is not None:
        return field(default_factory=factory, metadata=constraints)
    return field(default=default, metadata=constraints)


class KeyPolicy(enum.Enum):
    """How DeepSpeed 0.19.8 reads a block, which decides what an unknown key and an unfilled "auto" mean in it
    ([Note: DeepSpeed's config rule] in config/deepspeed_keys.py)."""

    DEEPSPEED_MODEL = "model"
    """A pydantic model (`DeepSpeedConfigModel`): an unknown key is an error; an "auto" nothing fills is dropped,
    so the key takes its default."""
    DEEPSPEED_DICT = "dict"
    """Read key by key with `.get`: an unknown key is never read (here: accepted, named in a note); "auto" stays a
    string DeepSpeed would use as a value (here: an error until something fills it)."""
    OURS = "ours"
    """Not a DeepSpeed block, or one we check strictly on purpose: unknown keys and unfilled "auto" are errors."""


class Block:
    """Base of every config block: validates fields on construction, converts to DeepSpeed JSON form."""

    _PATH: ClassVar[str] = ""
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_MODEL

    def __post_init__(self) -> None:
        problems = normalize_fields(self)
        if problems:
            raise ZeroConfigError(problems)

    def to_dict(self) -> dict[str, Any]:
        """This block in DeepSpeed JSON form: every key, nested blocks as dicts."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Block) else copy.deepcopy(value)
        return out


@dataclass(kw_only=True)
class FP16Config(Block):
    """`fp16`: fp16 mixed precision with a dynamic (or static) loss scale."""

    _PATH: ClassVar[str] = "fp16"

    enabled: bool = False
    """Train with fp16 parameters and an fp32 master copy."""
    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16."""
    loss_scale: float = _f(0.0, ge=0)
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale is doubled."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved (every overflowing step is still skipped)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every step without overflow."""
    min_loss_scale: int = 1
    """Lowest dynamic scale; overflowing again at it stops the run."""
    fp16_master_weights_and_grads: bool = False
    """DeepSpeed-only fp16 master weights; refused (see `config.schema.REFUSED_FEATURES`)."""


@dataclass(kw_only=True)
class BF16Config(Block):
    """`bf16` (old block name `bfloat16`): bf16 mixed precision."""

    _PATH: ClassVar[str] = "bf16"

    enabled: bool = False
    """Train with bf16 parameters and an fp32 master copy."""
    immediate_grad_update: bool = True
    """Accumulate each gradient into fp32 as soon as it is produced (True here; DeepSpeed 0.19.6 code: False)."""
    check_grad_overflow: bool = True
    """Skip the optimizer step when a gradient is inf/nan (JSON key `check_grad_overflow`, alias `check_overflow`)."""
    bf16_master_weights_and_grads: bool = False
    """DeepSpeed-only bf16 master weights; refused."""
    bf16_optimizer_states: bool = False
    """DeepSpeed-only bf16 optimizer states; refused."""

    @property
    def check_overflow(self) -> bool:
        """Alias of `check_grad_overflow` (the name used in our integration notes)."""
        return self.check_grad_overflow


@dataclass(kw_only=True)
class OffloadOptimizerConfig(Block):
    """`zero_optimization.offload_optimizer`: optimizer states (and the optimizer step) on CPU or NVMe."""

    _PATH: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: OffloadDevice = "none"
    """"none", "cpu" or "nvme"; at stages 1/2 "nvme" behaves as "cpu" (as in DeepSpeed)."""
    nvme_path: str | None = None
    """Folder for the swap files when device is "nvme" (required then)."""
    buffer_count: int = _f(4, ge=0)
    """Swap buffers; at least the tensors per parameter the optimizer keeps (Adam: 4)."""
    pin_memory: bool = True
    """Use page-locked host memory (DeepSpeed 0.16.5 default: False)."""
    pipeline_read: bool = False
    """Overlap the NVMe read of the next sub-group with the current step. accelerate_zero always reads one sub-group
    ahead (offload/nvme.py), so either value runs the same overlapped schedule; the results are identical to a
    serial one."""
    pipeline_write: bool = False
    """Overlap the NVMe write of the previous sub-group with the current step; always done, as `pipeline_read`."""
    fast_init: bool = False
    """DeepSpeed's faster start with NVMe offload. accelerate_zero always starts the fast way (each sub-group is
    written once, straight from the parameters), so either value starts the same way."""
    ratio: float = _f(1.0, ge=0, le=1)
    """Fraction of the optimizer states offloaded; < 1 needs stage 3."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload for Superchips; refused (config/schema.py REFUSED_FEATURES)."""
    cpuadam_cores_perc: float | None = _f(None, ge=0, le=1)
    """Share of the rank's cores the host optimizer step uses ([Note: threads for host work] in
    offload/host_threads.py), at least one core; None (DeepSpeed: 0.8, read only under `super_offload`): all of
    them. Below 1 it leaves cores to the process's other threads while the step runs."""


@dataclass(kw_only=True)
class OffloadParamConfig(Block):
    """`zero_optimization.offload_param`: parameter shards on CPU or NVMe (stage 3 only)."""

    _PATH: ClassVar[str] = "zero_optimization.offload_param"

    device: OffloadDevice = "none"
    """"none", "cpu" or "nvme"."""
    nvme_path: str | None = None
    """Folder for the swap files when device is "nvme" (required then)."""
    buffer_count: int = _f(5, ge=0)
    """Buffers in the NVMe parameter swap pool."""
    buffer_size: int = _f(100_000_000, ge=0)
    """Elements per swap buffer; must hold the largest parameter shard."""
    max_in_cpu: int = _f(1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when offloading to NVMe."""
    pin_memory: bool = True
    """Use page-locked host memory (DeepSpeed 0.16.5 default: False)."""


_DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


@dataclass(kw_only=True)
class LeafModuleConfig(Block):
    """`zero_optimization.leaf_module`: stage-3 modules gathered as one unit (no hooks on their children)."""

    _PATH: ClassVar[str] = "zero_optimization.leaf_module"

    classes: list[str] = _f(factory=lambda: list(_DEFAULT_LEAF_CLASSES))
    """Fully qualified class names (default: the Mixtral / Qwen2-MoE / Qwen3-MoE sparse MoE blocks)."""
    names: list[str] = _f(factory=list)
    """Module names (as in `named_modules()`)."""
    name_suffixes: list[str] = _f(factory=list)
    """Module name suffixes."""


@dataclass(kw_only=True)
class ZeroOptimizationConfig(Block):
    """`zero_optimization`: the ZeRO stage and its buckets, prefetching and offload."""

    _PATH: ClassVar[str] = "zero_optimization"

    stage: int = _f(0, ge=0, le=3)
    """0 plain data parallel, 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    contiguous_gradients: bool = True
    """Copy gradients into a contiguous buffer as they are produced."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter instead of all-reduce."""
    reduce_bucket_size: int = _f(DEFAULT_REDUCE_BUCKET_SIZE, ge=0)
    """Gradient elements reduced at a time (transformers' "auto": hidden_size**2)."""
    use_multi_rank_bucket_allreduce: bool = True
    """DeepSpeed's stage 1/2 bucket all-reduce; `false` is refused."""
    allgather_partitions: bool = True
    """Rebuild parameters after the step with all-gather (not broadcasts)."""
    allgather_bucket_size: int = _f(500_000_000, ge=0)
    """Parameter elements all-gathered at a time after the step (stages 1/2)."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; None until resolved (`default_overlap_comm`)."""
    load_from_fp32_weights: bool = True
    """On load, initialize fp32 master weights from the checkpoint's fp32 copy (else from the 16-bit model)."""
    elastic_checkpoint: bool = False
    """DeepSpeed's legacy elastic checkpoint; refused."""
    offload_param: OffloadParamConfig | None = None
    """Parameter offload (stage 3 only); None means no offload."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer state offload (stages 1-3); None means no offload."""
    sub_group_size: int = _f(1_000_000_000, ge=0)
    """Stage 3: elements per optimizer-step tile (the NVMe swapping unit)."""
    stage3_prefetch_bucket_size: int = _f(50_000_000, ge=0)
    """Stage 3: parameter elements fetched ahead of use (alias `prefetch_bucket_size`)."""
    stage3_param_persistence_threshold: int = _f(100_000, ge=0)
    """Stage 3: parameters with at most this many elements stay unpartitioned (alias `param_persistence_threshold`)."""
    stage3_model_persistence_threshold: int = _f(sys.maxsize, ge=0)
    """Stage 3: cap on all unpartitioned elements (alias `model_persistence_threshold`)."""
    stage3_max_live_parameters: int = _f(1_000_000_000, ge=0)
    """Stage 3: gathered elements kept per rank before releasing (alias `max_live_parameters`)."""
    stage3_max_reuse_distance: int = _f(1_000_000_000, ge=0)
    """Stage 3: keep a parameter reused within this many elements (alias `max_reuse_distance`)."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather full 16-bit weights on rank 0 when saving (alias `gather_16bit_weights_on_model_save`)."""
    stage3_module_granularity_threshold: int = _f(0, ge=0)
    """Stage 3: modules finer than this are fetched as one unit (alias `module_granularity_threshold`)."""
    stage3_use_all_reduce_for_fetch_params: bool = False
    """Stage 3: fetch parameters with all-reduce (alias `use_all_reduce_for_fetch_params`)."""
    stage3_allgather_sequential: bool = False
    """Stage 3: all-gather each parameter separately, without a flat buffer."""
    ignore_unused_parameters: bool = True
    """Stage 2: tolerate parameters that get no gradient."""
    legacy_stage1: bool = False
    """Removed DeepSpeed implementation; refused."""
    round_robin_gradients: bool = False
    """Stages 1/2 with CPU offload: interleave gradient ownership across ranks."""
    zero_hpz_partition_size: int = _f(1, ge=0)
    """ZeRO++ hpZ, stage 3: a secondary copy of the parameters partitioned over this many ranks (usually the ranks
    per node), which backward gathers from; 0 and 1: none ([Note: the three hierarchical layouts])."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ, stage 3: the parameter all-gathers of forward and backward move int8 blocks
    ([Note: qwZ, the quantized weight all-gather] in engine/quantized_comm.py)."""
    zero_quantized_nontrainable_weights: bool = False
    """Quantized frozen weights; refused."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ, stage 3: gradients reduce-scattered in int4 blocks, inside each node and then across nodes
    ([Note: qgZ, the quantized two-level reduce-scatter] in engine/quantized_comm.py)."""
    zeropp_loco_param: dict[str, Any] | None = None
    """LoCo-ZeRO++; refused."""
    mics_shard_size: int = -1
    """MiCS, stage 3: partition the state over groups of this many consecutive ranks and replicate it across the
    groups (FSDP2's HSDP); -1: over all ranks ([Note: the three hierarchical layouts])."""
    mics_hierarchical_params_gather: bool = False
    """MiCS's two-level gather for shard groups spanning nodes; `true` is refused."""
    memory_efficient_linear: bool = True
    """DeepSpeed's stage 3 linear autograd function; `false` is refused."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: load checkpoints serially."""
    override_module_apply: bool = True
    """DeepSpeed's `nn.Module.apply` patch; `false` is refused."""
    log_trace_cache_warnings: bool = False
    """Log stage 3 trace cache invalidations."""
    enable_sanity_checks: bool = False
    """Enable internal consistency checks (slow)."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Muon with NVMe offload: keep the momentum buffer in memory."""
    leaf_module: LeafModuleConfig = _f(factory=LeafModuleConfig)
    """Stage 3 modules fetched as one unit."""
    zenflow: dict[str, Any] | None = None
    """ZenFlow; refused."""


@dataclass(kw_only=True)
class OptimizerConfig(Block):
    """`optimizer`: the optimizer the engine builds (see `accelerate_zero.optim.factory`)."""

    _PATH: ClassVar[str] = "optimizer"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_DICT

    type: str
    """Optimizer name, e.g. "AdamW" (DeepSpeed names are case-insensitive)."""
    params: dict[str, Any] = _f(factory=dict, numeric_strings=True)
    """Keyword arguments of the optimizer; values may be "auto"; numeric strings ("3e-5") become numbers."""


@dataclass(kw_only=True)
class SchedulerConfig(Block):
    """`scheduler`: the LR scheduler the engine builds (see `accelerate_zero.optim.factory`)."""

    _PATH: ClassVar[str] = "scheduler"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_DICT

    type: str
    """Scheduler name, e.g. "WarmupLR"."""
    params: dict[str, Any] = _f(factory=dict, numeric_strings=True)
    """Keyword arguments of the scheduler; values may be "auto"; numeric strings become numbers."""


@dataclass(kw_only=True)
class CheckpointConfig(Block):
    """`checkpoint`: checkpoint tag validation and storage."""

    _PATH: ClassVar[str] = "checkpoint"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_DICT

    tag_validation: Literal["IGNORE", "WARN", "FAIL"] = _f("WARN", case="upper")
    """What to do when ranks save different tags (case-insensitive, stored upper-case)."""
    load_universal: bool = False
    """Load a universal checkpoint."""
    use_node_local_storage: bool = False
    """Every node saves to its own storage (transformers sets it with `save_on_each_node`)."""
    parallel_write: dict[str, Any] = _f(factory=lambda: {"pipeline_stage": False})
    """{"pipeline_stage": bool}: DeepSpeed's pipeline-parallel checkpoint writing."""
    writer: dict[str, Any] | None = None
    """DeepSpeed's checkpoint writer: `decoupled: true` makes every save asynchronous, `type` "fast" or "python"
    ([Note: DeepSpeed's checkpoint writer] in config/checkpoint_writer.py, which checks the keys)."""


@dataclass(kw_only=True)
class SequenceTilingConfig(Block):
    """`sequence_tiling` (ours; DeepSpeed's ALST tiles through its Python API): what `ZeroAccelerator` and the
    Trainer run in tiles along the sequence ([Note: tiling along the sequence] in sequence/tiling.py), with or
    without Ulysses (`sequence_parallel_size`)."""

    _PATH: ClassVar[str] = "sequence_tiling"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.OURS

    logits_tile_tokens: int | None = _f(None, ge=1)
    """The LM head and the loss run on this many positions at a time; None: the model's own loss, whole."""
    mlp_tile_tokens: int | None = _f(None, ge=1)
    """Each decoder layer's MLP runs on this many positions at a time; None: whole."""
    activations_on_host: bool = False
    """What autograd keeps for backward waits in host memory (torch's `save_on_cpu`)."""

    @property
    def enabled(self) -> bool:
        return self.logits_tile_tokens is not None or self.mlp_tile_tokens is not None or self.activations_on_host


@dataclass(kw_only=True)
class ActivationCheckpointingConfig(Block):
    """`activation_checkpointing` (DeepSpeed 0.19.8's keys and defaults): only `cpu_checkpointing` is implemented;
    the other keys drive DeepSpeed's own `deepspeed.checkpointing.checkpoint` function and are refused unless they
    keep their default (config/schema.py REFUSED_FEATURES says why for each)."""

    _PATH: ClassVar[str] = "activation_checkpointing"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_DICT

    partition_activations: bool = False
    """DeepSpeed: split each checkpoint across the tensor-model-parallel ranks; `true` is refused."""
    contiguous_memory_optimization: bool = False
    """DeepSpeed: copy partitioned checkpoints into one preallocated buffer; `true` is refused."""
    number_checkpoints: int | None = _f(None, ge=1)
    """DeepSpeed: the number of checkpoints, which only sizes that buffer; a number is refused."""
    cpu_checkpointing: bool = False
    """What autograd saves for backward during the model's forward waits in host memory (page-locked beside a
    GPU) until backward: with the model's gradient checkpointing on, the layer inputs ([Note: activations in host
    memory] in engine/activation_offload.py)."""
    synchronize_checkpoint_boundary: bool = False
    """DeepSpeed: synchronize the device around each checkpointed layer; `true` is refused."""
    profile: bool = False
    """DeepSpeed: log the time of each checkpointed layer; `true` is refused."""


# [Note: fp32 gradients under mixed precision]
# Under bf16 (or fp16) the engine accumulates gradients across micro-steps and ranks in fp32 unless the user sets
# `data_types.grad_accum_dtype`. bf16 keeps 8 bits of mantissa: summing 4 micro-steps or 8 ranks in bf16 rounds
# every partial sum, and the error grows with the number of terms, while one cast of each rank's bf16 gradient to
# fp32 costs a single rounding. The price is 2 more bytes per gradient element held (the full-size buffers at
# stages 0-1, the shard at stages 2-3, the transient buckets) and twice the bytes of a bf16 reduction: model states
# are 2+4+12 bytes per parameter with Adam instead of the ZeRO paper's 2+2+12. DeepSpeed's default is the model
# dtype; `"data_types": {"grad_accum_dtype": "bf16"}` gives its behaviour (memory and communication volume) back.
DEFAULT_GRAD_ACCUM_DTYPE = "fp32"


@dataclass(kw_only=True)
class DataTypesConfig(Block):
    """`data_types`: dtypes of engine buffers."""

    _PATH: ClassVar[str] = "data_types"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_DICT

    grad_accum_dtype: DataType | None = _f(None, case="lower")
    """Dtype gradients are accumulated (and, unless `communication_data_type` says otherwise, reduced) in; None
    means `DEFAULT_GRAD_ACCUM_DTYPE` ([Note: fp32 gradients under mixed precision])."""
    param_dtype: DataType | None = _f(None, case="lower")
    """DeepSpeed 0.19.8: the model's dtype, which must match the enabled precision (fp16, bf16, else fp32); None:
    follows it. A value that does not match is an error, as in DeepSpeed."""
    buffer_dtype: DataType | None = _f(None, case="lower")
    """DeepSpeed 0.19.8: cast the model's buffers to this dtype; None keeps them as loaded (only None is built)."""
    keep_in_fp32_modules: list[str] | None = None
    """DeepSpeed 0.19.8: name patterns of buffers kept in fp32 when `buffer_dtype` casts them; None, or "auto" as
    DeepSpeed's default writes it (taken as None by resolve_config): the model's `_keep_in_fp32_modules`. Without a
    buffer cast (only None is built) no buffer is touched, so any value keeps them as they are."""


@dataclass(kw_only=True)
class AioConfig(Block):
    """`aio`: asynchronous file IO for NVMe offload."""

    _PATH: ClassVar[str] = "aio"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.DEEPSPEED_DICT

    block_size: int = _f(1_048_576, ge=1)
    """Bytes per IO request."""
    queue_depth: int = _f(8, ge=1)
    """IO requests in flight."""
    intra_op_parallelism: int = _f(1, ge=1)
    """IO threads per request (old name `thread_count`)."""
    single_submit: bool = False
    """Submit requests one at a time instead of batched."""
    overlap_events: bool = True
    """Overlap submission and completion of requests."""
    use_gds: bool = False
    """Use GPUDirect Storage."""


@dataclass(kw_only=True)
class ExpertParallelConfig(Block):
    """`expert_parallel` (DeepSpeed 0.19.8's AutoEP block, its keys and defaults): `enabled`, `autoep_size` and
    `preset_model` are implemented ([Note: expert parallelism in the engine] in engine/experts/partition.py); every other
    key configures DeepSpeed's own MoE kernels, router or module patterns and is refused unless it keeps its default
    (config/schema.py REFUSED_FEATURES says why for each): the router, top-k and combine stay the model's."""

    _PATH: ClassVar[str] = "expert_parallel"
    _KEYS: ClassVar[KeyPolicy] = KeyPolicy.OURS

    enabled: bool = False
    """Split every fused MoE layer's experts over groups of `autoep_size` consecutive ranks."""
    autoep_size: int = _f(1, ge=1)
    """Ranks that split each layer's experts between them and exchange tokens (divides the world size and each
    layer's expert count); the experts' states are sharded over the world size / autoep_size ranks holding the same
    experts."""
    preset_model: str | None = None
    """DeepSpeed's name of the model family (mixtral, qwen3_moe, ...); checked against the model's `model_type`.
    The layers are found by structure whatever it says."""
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    async_split_plan: bool = False
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    """Accepted either way: accelerate_zero runs no Triton kernel (the model's own experts implementation runs)."""
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: str | None = None
    combine_impl: str | None = None
    row_weighting_impl: str | None = None
    gate_up_impl: str = "separate"
    comm_backend: str = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: str | None = None
    top_k: int | str | None = None
    load_balance_coeff: float | None = None
    routed_scaling_factor: float | str | None = None
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None


EXPERT_PARALLEL_AUTO_KEYS = ("score_apply", "combine_impl", "row_weighting_impl", "score_func", "top_k",
                             "routed_scaling_factor")  # fmt: skip
"""`expert_parallel` keys whose DeepSpeed default is "auto" (the model's value): here None, and "auto" as written
is taken as None by resolve_config."""
