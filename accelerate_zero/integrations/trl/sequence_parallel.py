"""GRPO under Ulysses sequence parallelism: completions generated whole on every rank (generation is not sequence-
parallel), the policy's and the reference model's per-token log-probabilities computed by the sequence-parallel
group over cut sequences and returned whole to each rank ([Note: per-token values under sequence parallelism] in
sequence/token_logps.py), then TRL's own loss on them: its clipped objective, KL and every `loss_type`'s
normalisation run as without sequence parallelism, so sp changes no number.

[Note: GRPO under sequence parallelism]
Each rank keeps its own prompts and completions (TRL's sampler, rewards and advantages are untouched), so the
Trainer's batch arithmetic is TRL's: the train loader is not cut, the total batch counts every rank, and a run
resumes inside an epoch as without sp. The group cuts while the policy trains (the Ulysses attention is on then,
[Note: Ulysses attention]) and, with `sequence_parallel_evaluation=True`, while it evaluates; otherwise every rank
scores its own whole sequences in evaluation, as TRL does. Either way eval_loss is TRL's arithmetic on whole values,
never multiplied or divided by sp. A model scored outside training mode (the frozen reference, prepared without an
optimizer, which gets the policy's Ulysses attention at its first cut forward; the policy evaluating) runs that
forward in training mode, which changes nothing but the attention when the model has no dropout; one with dropout is
refused (TRL's `disable_dropout=True` removes it). DPO follows the same scheme (DPO's `_compute_loss` calls the
policy and `self.ref_model`; both are scored through `CutScoring`). TRL's fused LM head scores the slice's positions
in chunks, so the logits of a long completion never exist whole (neither do the slice's: its chunks are recomputed
in backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from accelerate_zero.sequence.loader import IGNORE_INDEX
from accelerate_zero.sequence.model_mode import has_dropout, training_mode
from accelerate_zero.sequence.tiled_values import tiled_token_values
from accelerate_zero.sequence.token_logps import check_same_calls, sequence_parallel_token_values
from accelerate_zero.sequence.ulysses import register_ulysses_attention


ULYSSES_PREFIX = "accelerate_zero_ulysses_"


@contextlib.contextmanager
def whole_sequence_attention(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s attention transformers' SDPA (each rank its own whole sequences) while generating: TRL generates with
    the policy in training mode, where the Ulysses attention would cut; its own attention back after."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = str(getattr(getattr(inner, "config", None), "_attn_implementation", ""))
    if not name.startswith(ULYSSES_PREFIX):
        yield
        return
    inner.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        inner.set_attn_implementation(name)


FUSED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token fields of TRL's fused LM head (`FusedCausalLMOutput`), all returned whole when the head gives them."""


class CutScoring:
    """Stands in for a model that TRL calls as `model(input_ids=..., attention_mask=..., labels=...,
    fused_lm_head=True)` (TRL's fused LM head): the same output, its per-token fields computed by the sequence-parallel
    group on cut sequences and returned whole ([Note: per-token values under sequence parallelism] in
    sequence/token_logps.py), so TRL's own loss code runs on them unchanged.

    Args:
        trainer: the ZeRO TRL trainer (its accelerator gives the group).
        model: the policy (training) or the frozen reference model; it must carry TRL's fused LM head.
    """

    def __init__(self, trainer: Any, model: Any) -> None:
        self.trainer, self.model = trainer, model

    @property
    def training(self) -> bool:
        return self.model.training

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        fused_lm_head: bool = False,
        use_cache: bool | None = None,
        **rest: Any,
    ) -> Any:
        from trl.trainer.utils import FusedCausalLMOutput

        accelerator = self.trainer.accelerator
        given = sorted(key for key, value in rest.items() if value is not None and value is not False)
        if not fused_lm_head or labels is None or given:
            raise ValueError(
                f"{type(self.trainer).__name__} with sequence_parallel_size={accelerator.sequence_parallel_size}: "
                "only text scored through TRL's fused LM head (labels, fused_lm_head=True) is cut along the "
                f"sequence; got fused_lm_head={fused_lm_head}, labels {'given' if labels is not None else 'None'}, "
                f"and {given or 'nothing else'}: train text-only models without the MoE router's auxiliary loss, or "
                "without sequence parallelism"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        scored = labels != IGNORE_INDEX
        model = self.model

        tile_tokens = accelerator._trained_engine().config.sequence_tiling.logits_tile_tokens
        temperature = getattr(self.trainer, "temperature", 1.0)  # GRPO's; DPO scores at 1

        def score(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
            with accelerator.autocast():
                if tile_tokens is not None:  # the config's tiles, where TRL's fused head chunks by 32K positions
                    labels = batch.pop("shift_labels")
                    return tiled_token_values(
                        accelerator.unwrap_model(model),
                        batch.pop("input_ids"),
                        labels,
                        tile_tokens,
                        temperature,
                        **batch,
                    )
                out = model(**batch, fused_lm_head=True)
            return {name: getattr(out, name, None) for name in FUSED_FIELDS}

        ulysses = accelerator.sequence_parallel_size > 1  # at sp 1 (tiling alone) nothing is exchanged
        if ulysses and not model.training and has_dropout(accelerator.unwrap_model(model)):
            raise ValueError(
                f"{type(self.trainer).__name__} with sequence_parallel_size={accelerator.sequence_parallel_size}: a "
                "model not training (the reference model, or the policy evaluating) is scored over cut sequences in "
                "training mode (its Ulysses attention on), and it has dropout: set disable_dropout=True in the config"
            )
        if ulysses and not self.trainer._is_trained_policy(model):
            self.trainer._ulysses_on(model)
        group, stats = accelerator._sequence_group()
        with training_mode(model) if ulysses else contextlib.nullcontext():
            values = sequence_parallel_token_values(score, input_ids, attention_mask, scored, group, stats)
        # TRL's fused head: position t holds the value for the token at t + 1
        fields = {name: None if value is None else value[:, 1:] for name, value in values.items()}
        mask = scored[:, 1:]
        loss = -fields["log_probs"].sum() / mask.sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=None, **fields)


class SequenceParallelTRLMixin:
    """What `ZeroGRPOTrainer` and `ZeroDPOTrainer` share under sequence parallelism ([Note: GRPO under sequence
    parallelism]): the loader, the total batch and the loss stay TRL's, and the models are scored through
    `CutScoring` while the policy trains (and evaluates, with `sequence_parallel_evaluation`)."""

    def _cuts_evaluation_batches(self) -> bool:
        return False  # TRL's evaluation scores its sequences through `CutScoring` (`_cuts_for_scoring`)

    def _cuts_for_scoring(self) -> bool:
        """Under sp or `sequence_tiling` (at sp 1: a one-rank group, the tiles alone), while the policy trains, or
        while it evaluates with `sequence_parallel_evaluation`."""
        asked = self.model.training or getattr(self.args, "sequence_parallel_evaluation", False)
        return self.accelerator.cuts_sequences and asked

    def _is_trained_policy(self, model: Any) -> bool:
        return model is self.model or model is self.model_wrapped

    def _ulysses_on(self, model: torch.nn.Module) -> None:
        """`model` (the frozen reference) with the policy's Ulysses attention, once."""
        inner = self.accelerator.unwrap_model(model)
        if str(getattr(inner.config, "_attn_implementation", "")).startswith(ULYSSES_PREFIX):
            return
        group, stats = self.accelerator._sequence_group()
        inner.set_attn_implementation(register_ulysses_attention(group, stats))

    # The Trainer's sequence path (cut loader, group loss, total batch / sp) is for token losses; TRL's loss is kept
    def get_train_dataloader(self) -> Any:
        return self._trl_class().get_train_dataloader(self)

    def get_total_train_batch_size(self, args: Any) -> int:
        return self._trl_class().get_total_train_batch_size(self, args)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, **kwargs: Any) -> Any:
        return self._trl_class().compute_loss(self, model, inputs, return_outputs=return_outputs, **kwargs)

    def _trl_class(self) -> type:
        raise NotImplementedError


class SequenceParallelGRPOMixin(SequenceParallelTRLMixin):
    """`ZeroGRPOTrainer`'s sequence-parallel part ([Note: GRPO under sequence parallelism])."""

    def _trl_class(self) -> type:
        from trl import GRPOTrainer

        return GRPOTrainer

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        with whole_sequence_attention(self.model):
            return super()._generate_single_turn(*args, **kwargs)  # type: ignore[misc]

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, *args: Any, batch_size: int | None = None, **kwargs: Any
    ) -> Any:
        """TRL's, its model scored over cut sequences (`CutScoring`) when `_cuts_for_scoring`. TRL scores the rows
        `batch_size` at a time: every rank of the group must make as many calls (`check_same_calls`)."""
        if not self._cuts_for_scoring():
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, batch_size=batch_size, **kwargs)  # type: ignore[misc]
        if self.accelerator.sequence_parallel_size > 1:
            group, stats = self.accelerator._sequence_group()
            check_same_calls(input_ids.shape[0], batch_size, group, stats, input_ids.device, type(self).__name__)
        scoring = CutScoring(self, model)
        return super()._get_per_token_logps_and_entropies(scoring, input_ids, *args, batch_size=batch_size, **kwargs)  # type: ignore[misc]


class SequenceParallelDPOMixin(SequenceParallelTRLMixin):
    """`ZeroDPOTrainer`'s sequence-parallel part: chosen and rejected sequences cut across the group, their per-token
    log-probabilities returned whole, and TRL's loss (every `loss_type`) on them ([Note: GRPO under sequence
    parallelism]: the same scheme)."""

    def _trl_class(self) -> type:
        from trl import DPOTrainer

        return DPOTrainer

    def _compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
        if not self._cuts_for_scoring():
            return super()._compute_loss(model, inputs, return_outputs)  # type: ignore[misc]
        with self._reference_scored_cut():
            return super()._compute_loss(CutScoring(self, model), inputs, return_outputs)  # type: ignore[misc]

    def compute_ref_log_probs(self, model: Any, inputs: dict[str, Any]) -> Any:
        scoring = CutScoring(self, model) if self._cuts_for_scoring() else model
        return super().compute_ref_log_probs(scoring, inputs)  # type: ignore[misc]

    @contextlib.contextmanager
    def _reference_scored_cut(self) -> Iterator[None]:
        """TRL's DPO calls `self.ref_model` itself: a `CutScoring` of it for the step. A PEFT policy whose reference
        is its own base (no `ref_model`) is refused: TRL calls `self.model` for it, under an adapter switch."""
        ref = self.ref_model
        if ref is None:
            if self.precompute_ref_logps:
                yield
                return
            raise ValueError(
                f"{type(self).__name__} with sequence_parallel_size={self.accelerator.sequence_parallel_size} and no "
                "ref_model (a PEFT policy scored with its adapter off): pass ref_model, or precompute_ref_logps=True"
            )
        self.ref_model = CutScoring(self, ref)
        try:
            yield
        finally:
            self.ref_model = ref
