"""The Trainer's evaluation and resumed epochs under sequence parallelism (`ZeroTrainerMixin` inherits these).

* `prediction_step` with `sequence_parallel_evaluation=True`: each rank's evaluation batch is scored by its group
  over cut sequences and its loss (and logits, for predictions) handed back whole ([Note: evaluation under sequence
  parallelism] in sequence/evaluation.py), before `train()` too (with the engine the model is prepared with for
  inference).
* `_run_epoch` of a run resumed inside an epoch: the cut loader skipped by its own rule ([Note: resuming inside an
  epoch of a cut loader]).
"""

from __future__ import annotations

from typing import Any

import torch

from accelerate_zero.sequence.evaluation import evaluate_over_group
from accelerate_zero.sequence.loader import SequenceShardedLoader


class SequenceParallelStepsMixin:
    """Evaluation over cut sequences and resuming a cut loader, for `ZeroTrainerMixin` (it reads `self.args` and
    `self.accelerator`, a `ZeroAccelerator`)."""

    def _check_sequence_parallel_evaluation(self) -> None:
        if getattr(self.args, "sequence_parallel_evaluation", False) and self.accelerator.sequence_parallel_size <= 1:
            raise ValueError(
                "sequence_parallel_evaluation=True without sequence parallelism: nothing is cut; turn it on "
                "(ParallelismConfig sp_size, or sequence_parallel_size in the ZeRO config) or set it to False"
            )

    def _cuts_evaluation_batches(self) -> bool:
        """Whether `prediction_step` scores each batch over cut sequences (`sequence_parallel_evaluation` under sp);
        the TRL trainers that score sequences themselves say no (they cut inside their scoring)."""
        return bool(getattr(self.args, "sequence_parallel_evaluation", False)) and (
            self.accelerator.sequence_parallel_size > 1
        )

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        if not self._cuts_evaluation_batches():
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)  # type: ignore[misc]
        inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(
                "sequence_parallel_evaluation=True: an evaluation batch without 'labels' (keys "
                f"{sorted(inputs)}); the group scores labelled tokens only: give labels, or set it to False"
            )
        # Before train() the model is prepared for inference: its engine has the same sequence-parallel group.
        engine = self.accelerator._evaluation_engine(model)
        group, stats = self.accelerator._sequence_group(engine)
        tiling = engine.config.sequence_tiling
        loss, logits = evaluate_over_group(
            model,
            inputs,
            group,
            stats,
            with_logits=not prediction_loss_only,
            tile_tokens=tiling.logits_tile_tokens,
            seq_length=self.accelerator._sequence_settings["seq_length"],
        )
        return (loss, None, None) if prediction_loss_only else (loss, logits, labels.detach())

    # [Note: resuming inside an epoch of a cut loader]
    # transformers skips into a resumed epoch with accelerate's module-level `skip_first_batches`, which rebuilds the
    # loader it is given from its dataset and sampler: a `SequenceShardedLoader` would come back uncut. Its own skip
    # (`ZeroAccelerator.skip_first_batches`: whole batches of the loader under it unread, then pieces of the next) is
    # taken first, and the Trainer is handed a torch `DataLoader` over the epoch's micro-batch positions
    # (`_ResumedMicroBatches`): accelerate's skip drops the first positions without reading them, and each position
    # read after is the next micro-batch of the skipped loader. Every count and step of the Trainer's resumed epoch
    # (the steps already done, the accumulation boundaries, the RNG restored after the first batches) is then its own.
    def _run_epoch(self, **kwargs: Any) -> Any:
        loader, skipped = kwargs["train_dataloader"], kwargs["steps_trained_in_current_epoch"]
        resumed = kwargs["epoch"] == kwargs["epochs_trained"] and kwargs["resume_from_checkpoint"] is not None
        if isinstance(loader, SequenceShardedLoader) and resumed and skipped > 0 and not self.args.ignore_data_skip:
            loader.set_epoch(kwargs["epoch"])  # before the skip: the loader under it is rebuilt with its epoch
            rest = self.accelerator.skip_first_batches(loader, skipped)
            kwargs["train_dataloader"] = _resumed_loader(rest, skipped)
        return super()._run_epoch(**kwargs)  # type: ignore[misc]


class _ResumedMicroBatches(torch.utils.data.Dataset):
    """Position i of a resumed epoch: the next micro-batch of `rest` (the epoch's loader, its first `skipped`
    micro-batches skipped), read in order from position `skipped` ([Note: resuming inside an epoch of a cut
    loader])."""

    def __init__(self, rest: SequenceShardedLoader, skipped: int) -> None:
        self.rest, self.skipped, self.next = rest, skipped, skipped
        self.iterator: Any = None

    def __len__(self) -> int:
        return self.skipped + len(self.rest)

    def __getitem__(self, position: int) -> dict[str, Any]:
        if position != self.next:
            raise RuntimeError(
                f"a resumed epoch read micro-batch {position}, where {self.next} comes next: its loader reads the "
                f"micro-batches after the {self.skipped} skipped ones once, in order"
            )
        if self.iterator is None:
            self.iterator = iter(self.rest)
        self.next += 1
        return next(self.iterator)


def _only(items: list[dict[str, Any]]) -> dict[str, Any]:
    return items[0]


def _resumed_loader(rest: SequenceShardedLoader, skipped: int) -> torch.utils.data.DataLoader:
    """A torch `DataLoader` over the positions of a resumed epoch, one micro-batch per position."""
    positions = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(skipped + len(rest))), 1, False)
    return torch.utils.data.DataLoader(_ResumedMicroBatches(rest, skipped), batch_sampler=positions, collate_fn=_only)
