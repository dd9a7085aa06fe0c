"""TRL's SFT, DPO and GRPO trainers composed with `ZeroTrainerMixin`, plus what TRL only does for DeepSpeed.

TRL keys two things on DeepSpeed ZeRO-3 (`trl.distributed.DistributedBackend.is_zero3`, which reads accelerate's
DeepSpeed plugin and imports deepspeed):

* gathering parameters (`DistributedBackend.gather_params`, e.g. to merge a PEFT adapter or to sync vLLM):
  `ZeroDistributedBackend` gathers with our `GatheredParameters` instead, keeping `is_zero3` False so no path
  that imports deepspeed is taken;
* gathering the whole model once per generate call (`unwrap_model_for_generation(...,
  gather_deepspeed3_params=args.ds3_gather_for_generation)`): `ZeroGRPOTrainer._generate_single_turn` runs TRL's
  generation inside one `GatheredParameters` over the policy when `ds3_gather_for_generation` is true (TRL's
  default) at stage 3. Otherwise every decoding step gathers each unit again (less memory, many more collectives).

Frozen reference and reward models are prepared for inference (sharded at stage 3) and stay so for the whole run
([Note: side models survive free_memory] in integrations/accelerate/accelerator.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.distributed import DistributedBackend
from trl.generation.vllm_generation import VLLMGeneration

from accelerate_zero.engine.gathered import GatheredParameters, register_external_parameter
from accelerate_zero.integrations.accelerate.parallelism import parallelism_from_launch
from accelerate_zero.integrations.transformers.trainer import ZeroTrainerMixin
from accelerate_zero.integrations.transformers.training_args import ZeroArgumentsMixin
from accelerate_zero.integrations.trl.sequence_parallel import SequenceParallelDPOMixin, SequenceParallelGRPOMixin
from accelerate_zero.sequence.loader import TOKEN_MASK


class ZeroDistributedBackend(DistributedBackend):
    """TRL's backend facts with our gather: `gather_params` gathers parameters the ZeRO engine sharded (any stage;
    unsharded parameters are left as they are). `is_zero3` stays False: TRL's ZeRO-3 paths import deepspeed."""

    @contextlib.contextmanager
    def gather_params(self, params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
        with GatheredParameters(list(params)):
            yield


class ZeroVLLMGeneration(VLLMGeneration):
    """TRL's vLLM generation whose weight sync (colocate and server modes alike) reads the engine's stream ([Note:
    streaming full weights to a generator] in engine/full_weights.py): each unit gathered once, a few at a time
    within `sync_max_bytes`, a PEFT adapter merged layer by layer, where TRL gathers once per parameter (its whole
    unit every time) or, with PEFT, the whole model at once. Before the engine exists, TRL's own path (with our
    gather) runs."""

    engine_of: Callable[[], Any]
    """The trainer's engine, looked up at each sync (the Trainer builds it in `train()`, after this object)."""
    sync_max_bytes: int | None = None

    def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        engine = self.engine_of()
        if engine is None:
            yield from super()._iter_named_params()
            return
        for name, tensor in engine.named_full_parameters(max_bytes=self.sync_max_bytes):
            yield self._fix_param_name_to_vllm(name), tensor


def use_zero_weight_sync(generation: VLLMGeneration, accelerator: Any, engine_of: Callable[[], Any]) -> None:
    """Makes TRL's `VLLMGeneration` (built inside GRPOTrainer's `__init__`, which offers no hook) a
    `ZeroVLLMGeneration`: the subclass only overrides how parameters are read for a sync."""
    generation.__class__ = ZeroVLLMGeneration
    generation._dist = ZeroDistributedBackend(accelerator)
    generation.engine_of = engine_of


# [Note: TRL's fused LM head at stage 3]
# TRL's SFT, DPO and GRPO trainers replace their models' forward on the instance (`add_fused_lm_head`): the backbone
# runs, then `lm_head.weight` goes straight into a chunked log-softmax kernel, and `lm_head` itself is never called.
# TRL gathers that weight for DeepSpeed only (`maybe_gather_lm_head_ctx`). Under stage 3 an untied head is a unit of
# its own, gathered by its module's hooks, so the kernel would read its empty placeholder (found automatically only
# when the first forward is a training one; GRPO's first is generation, inside a gather of the whole policy). A tied
# head lives in the root unit and is gathered for the whole forward anyway. So the head's parameters are declared
# used by the model's own forward (DeepSpeed's `register_external_parameter`): its unit is gathered with the root
# unit, before every forward and its backward.
def gather_fused_lm_head(model: torch.nn.Module | None) -> None:
    """Declares a TRL fused head's parameters used by its model's forward ([Note: TRL's fused LM head at stage 3]);
    nothing for a model whose forward is its class's."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or "forward" not in vars(base):
        return
    for param in head.parameters():
        register_external_parameter(base, param)


class ZeroTRLMixin(ZeroTrainerMixin):
    """`ZeroTrainerMixin` for TRL trainers: TRL's distributed backend gets our gather (`ZeroDistributedBackend`), and
    a fused LM head is gathered with its model ([Note: TRL's fused LM head at stage 3])."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if hasattr(self, "_dist"):
            self._dist = ZeroDistributedBackend(self.accelerator)
        for model in (self.model, getattr(self, "ref_model", None)):
            gather_fused_lm_head(model)

    @contextlib.contextmanager
    def gathered_for_generation(self) -> Iterator[None]:
        """The whole policy gathered once (stage 3, `args.ds3_gather_for_generation` true): generate's decoding steps
        then run without collectives. Every rank must enter it (TRL generates on every rank at the same step)."""
        engine = self.zero_engine
        gather = getattr(self.args, "ds3_gather_for_generation", True)
        if engine is None or engine.stage != 3 or not gather or getattr(self, "use_vllm", False):
            yield
            return
        with torch.no_grad(), GatheredParameters(list(self.model.parameters())):
            yield


@dataclass
class ZeroSFTConfig(ZeroArgumentsMixin, SFTConfig):
    """TRL's `SFTConfig` with `zero_config` (see `accelerate_zero.TrainingArguments`)."""


class ZeroSFTTrainer(ZeroTRLMixin, SFTTrainer):
    """TRL's `SFTTrainer` on the ZeRO engine; under sequence parallelism its own loss and metrics run on the cut
    micro-batches (`sequence_parallel_compute_loss`)."""

    def sequence_parallel_compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
    ) -> Any:
        """TRL's `compute_loss` on this rank's slice, so that its metrics (`entropy`, `mean_token_accuracy`,
        `num_tokens`), gathered over every rank, are the whole batches' as without sp. TRL divides the slice's token
        losses by the count it is given (times the ranks, with `average_tokens_across_devices`), which is given
        as the normaliser of [Note: loss normalisation under sequence parallelism]: the engine's gradient is then
        the same as through `sequence_parallel_loss` (no group sum is needed for it; each rank logs its slice's
        share, and the Trainer logs their mean)."""
        normalizer = self.accelerator.sequence_parallel_normalizer(inputs, num_items_in_batch)
        if not self.args.average_tokens_across_devices:
            normalizer = normalizer / self.accelerator.num_processes
        tokens = inputs.pop(TOKEN_MASK)
        counted = self._total_train_tokens
        host = self.accelerator.zero_config.sequence_tiling.activations_on_host
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if host else nullcontext():
            out = SFTTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch=normalizer)
        # TRL counts a batch without attention_mask by its width, the padding to the group size included
        self._total_train_tokens = counted + int(self.accelerator.gather_for_metrics(tokens.sum()).sum().item())
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return out


@dataclass
class ZeroDPOConfig(ZeroArgumentsMixin, DPOConfig):
    """TRL's `DPOConfig` with `zero_config` (see `accelerate_zero.TrainingArguments`)."""


class ZeroDPOTrainer(SequenceParallelDPOMixin, ZeroTRLMixin, DPOTrainer):
    """TRL's `DPOTrainer` on the ZeRO engine; the reference model stays sharded at stage 3 for the whole run. Under
    sequence parallelism the chosen and rejected sequences are scored over cut sequences
    (`SequenceParallelDPOMixin`)."""


# What sleeps while GRPO generates: everything but the parameters, which the policy (or the vLLM sync before it)
# reads to generate ([Note: sleeping moves storages, not tensors] in engine/sleep.py).
ASLEEP_DURING_GENERATION = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")


@dataclass
class ZeroGRPOConfig(ZeroArgumentsMixin, GRPOConfig):
    """TRL's `GRPOConfig` with `zero_config` (see `accelerate_zero.TrainingArguments`) and
    `offload_states_during_generation`."""

    offload_states_during_generation: bool = field(
        default=False,
        metadata={
            "help": (
                "Move the optimizer state, the fp32 master weights and the gradients off the device while completions "
                "are generated (engine.offload_states), and back before training: the device then holds the "
                "parameters only, memory the generation (its KV cache, or a colocated vLLM) can use."
            )
        },
    )

    def __post_init__(self) -> None:
        # TRL's GRPOConfig refuses sp_size > 1 (it cannot cut a generation batch); ours cuts the scoring instead
        # ([Note: GRPO under sequence parallelism]): TRL's check sees no sequence dimension, the config keeps it.
        from accelerate.parallelism_config import ParallelismConfig

        if self.parallelism_config is None:
            self.parallelism_config = parallelism_from_launch()
        kept = self.parallelism_config
        if kept is not None and kept.sp_enabled and not kept.cp_enabled:
            self.parallelism_config = ParallelismConfig()
        try:
            super().__post_init__()
        finally:
            self.parallelism_config = kept


class ZeroGRPOTrainer(SequenceParallelGRPOMixin, ZeroTRLMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` on the ZeRO engine: generation gathers the policy once per call at stage 3 (TRL's
    `ds3_gather_for_generation`, default true); the reference model stays sharded; with vLLM, weights reach it
    streamed unit by unit (`ZeroVLLMGeneration`); under sequence parallelism the log-probabilities are computed over
    cut sequences ([Note: GRPO under sequence parallelism] in integrations/trl/sequence_parallel.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "vllm_generation", None) is not None:
            use_zero_weight_sync(self.vllm_generation, self.accelerator, lambda: self.zero_engine)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        with self.asleep_for_generation(), self.gathered_for_generation():
            return super()._generate_single_turn(*args, **kwargs)

    @contextlib.contextmanager
    def asleep_for_generation(self) -> Iterator[None]:
        """The training state other than the parameters off the device while generating
        (`args.offload_states_during_generation`); back, unchanged, before the step that follows."""
        engine = self.zero_engine
        if engine is None or not getattr(self.args, "offload_states_during_generation", False):
            yield
            return
        engine.offload_states(include=ASLEEP_DURING_GENERATION)
        try:
            yield
        finally:
            engine.reload_states()
