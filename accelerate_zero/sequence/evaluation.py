"""Evaluation over cut sequences: each rank's evaluation batch scored by its sequence-parallel group, and its loss
(and, asked for, its whole logits) handed back to it.

[Note: evaluation under sequence parallelism]
Without it each rank evaluates its own batches whole, which is what runs out of memory first at long lengths. With
`sequence_parallel_evaluation=True` the group scores its members' batches one owner at a time, cut as the training
loader cuts them ([Note: batches of a sequence-parallel group] in sequence/loader.py): every rank takes part in every
member's forward and keeps, for its own batch, the loss the group computed over the cut sequences (the batch's token
mean: the value `model(**batch).loss` has without sp) and, when predictions are asked for, the whole logits (its
slices gathered from the group). The Trainer's evaluation loop therefore sees on each rank what it sees without sp:
its own batch, once. eval_loss is neither multiplied nor divided by sp, and the loop's gathering over ranks, its
trimming of the last batch and its predictions are as without sp. The forwards run under no_grad in training mode
(the Ulysses attention cuts only then, sequence/model_mode.py); a model with dropout is refused, as training mode
would turn its dropout on. Only the logits asked for by a prediction exist whole, one batch at a time; at padded
positions they differ from a forward with a padding mask (the padding is cut as the sequence's continuation), where
no label is.
"""

from __future__ import annotations

from typing import Any

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence.batch import sequence_parallel_loss
from accelerate_zero.sequence.loader import cut_for_group
from accelerate_zero.sequence.model_mode import has_dropout, training_mode


def evaluate_over_group(
    model: torch.nn.Module,
    batch: dict[str, Any],
    group: DataParallelGroup,
    stats: CommStats,
    with_logits: bool = False,
    tile_tokens: int | None = None,
    pad_token_id: int = 0,
    seq_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's evaluation `batch` scored by `group` over cut sequences ([Note: evaluation under sequence
    parallelism]). Every rank of `group` must call it at the same time, each with its own batch (right-padded, with
    `labels`, as the training loader takes them).

    Args:
        model: the model (training or not: its forwards run in training mode, without gradients).
        with_logits: also return the batch's whole logits (`[rows, length, vocabulary]`); the LM head then runs
            whole on each slice, never tiled.
        tile_tokens: the LM head and the loss in tiles of this many positions when no logits are asked for.
        pad_token_id, seq_length: as for `cut_for_group`.

    Returns:
        (the batch's token-mean loss, its logits or None).

    Raises:
        ValueError: `model` has dropout (training mode would turn it on).
    """
    if group.world_size > 1 and has_dropout(model):
        raise ValueError(
            "sequence_parallel_evaluation=True with a model that has dropout: its forwards over cut sequences run in "
            "training mode (the Ulysses attention cuts only then), which would turn the dropout on; set the model's "
            "dropout rates to 0 (attention_dropout, hidden dropout), or set sequence_parallel_evaluation=False"
        )
    length = batch["input_ids"].shape[1]
    pieces = cut_for_group(batch, group, stats, pad_token_id, seq_length)
    loss, logits = None, None
    with torch.no_grad(), training_mode(model):
        for owner, piece in enumerate(pieces):  # every rank in every member's forward, one member at a time
            piece_loss, outputs = sequence_parallel_loss(
                model,
                piece,
                group,
                stats,
                tile_tokens=None if with_logits else tile_tokens,
                return_outputs=True,
                data_parallel_size=1,  # the normaliser is the piece's own tokens: its token mean
            )
            whole = _gathered_along_sequence(outputs.logits, group, stats)[:, :length] if with_logits else None
            if owner == group.rank:
                loss, logits = piece_loss.detach(), whole
    return loss, logits


def _gathered_along_sequence(piece: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """`[rows, L/p, ...]` slices of the group's ranks, in rank order: `[rows, L, ...]`."""
    piece = piece.contiguous()
    every = torch.empty(group.world_size * piece.numel(), dtype=piece.dtype, device=piece.device)
    collectives.all_gather(every, piece.reshape(-1), group, stats, kind="all_gather_sequence_logits")
    rows, width, *rest = piece.shape
    whole = every.view(group.world_size, rows, width, *rest).transpose(0, 1)
    return whole.reshape(rows, group.world_size * width, *rest)
