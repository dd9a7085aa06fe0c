"""A batch cut along the sequence for Ulysses ([Note: Ulysses attention] in sequence/ulysses.py), and the loss of
the whole sequence from every rank's slice.

[Note: the loss over a sequence-parallel group]
Labels are shifted on the whole sequence before it is cut (`shift_labels`: the token each position predicts, so
the last token of a slice predicts the first of the next), padded with -100 to a multiple of the group size. Each
rank computes the sum of its tokens' losses, and `group_loss` (sequence/normalization.py) divides it and adds the
group's parts, so every rank holds the same loss and the engine's gradient is the sum of every token loss over
the normaliser ([Note: loss normalisation under sequence parallelism]): the step's labelled tokens when
`num_items_in_batch` is given (the Trainer's rule), else this micro-batch's (its token mean, as `model(**batch).loss`
is without sp).
"""

from __future__ import annotations

from typing import Any

import torch

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence.loader import TOKEN_MASK, whole_rows
from accelerate_zero.sequence.normalization import group_loss, normalizer_for
from accelerate_zero.sequence.tiling import tiled_causal_lm_loss


def shard_sequence(
    input_ids: torch.Tensor, labels: torch.Tensor, group: DataParallelGroup, pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's slice of `[batch, sequence]` tokens: `input_ids`, `position_ids` (the whole sequence's) and
    `shift_labels`, the sequence padded at its end to a multiple of the group size (the loader's rule,
    `whole_rows`)."""
    rows = whole_rows({"input_ids": input_ids, "labels": labels}, group.world_size, pad_token_id)
    width = rows["input_ids"].shape[1] // group.world_size
    return {key: value[:, group.rank * width : (group.rank + 1) * width] for key, value in rows.items()}


def sequence_parallel_loss(
    model: torch.nn.Module,
    shard: dict[str, torch.Tensor],
    group: DataParallelGroup,
    stats: CommStats | None = None,
    tile_tokens: int | None = None,
    activations_on_host: bool = False,
    return_outputs: bool = False,
    num_items_in_batch: torch.Tensor | float | None = None,
    data_parallel_size: int | None = None,
) -> Any:
    """The loss of this micro-batch's whole sequences, on every rank of `group`, from this rank's slice
    (`shard_sequence`, or a batch of `SequenceShardedLoader`: `shift_labels` and the model's inputs) ([Note: the loss
    over a sequence-parallel group]).

    Args:
        tile_tokens: the LM head and the loss run in tiles of this many positions ([Note: tiling along the
            sequence] in sequence/tiling.py); None: the model's own loss.
        activations_on_host: what autograd keeps for backward (with gradient checkpointing, each layer's input)
            waits in host memory (torch's `save_on_cpu`, page-locked beside a GPU) and comes back for backward.
        return_outputs: (loss, the model's outputs); the outputs are None when tiled.
        num_items_in_batch: the labelled tokens of the whole optimizer step on every rank (transformers' argument
            of that name): the engine's gradient is then the sum of every token loss of the step over it, as the
            Trainer's without sp. None: this micro-batch's token mean ([Note: loss normalisation under sequence
            parallelism]).
        data_parallel_size: the number of sequence-parallel groups; None: torch's world size / the group's size.
    """
    if activations_on_host:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return sequence_parallel_loss(
                model, shard, group, stats, tile_tokens, False, return_outputs, num_items_in_batch, data_parallel_size
            )
    if not model.training:
        raise RuntimeError(
            "sequence_parallel_loss on a model that is not training: its Ulysses attention is off (whole sequences "
            "per rank while evaluating); call model.train() first"
        )
    inputs = model_inputs(shard)
    stats = stats if stats is not None else CommStats()
    labels = shard["shift_labels"]
    dp = data_parallel_size if data_parallel_size is not None else data_parallel_groups(group)
    normalizer = normalizer_for(labels, num_items_in_batch, group, stats, dp)
    one = torch.ones((), dtype=torch.float64, device=labels.device)  # the model's loss is then the sum of its tokens'
    outputs = None
    if tile_tokens is not None:
        input_ids = inputs.pop("input_ids")
        local_sum = tiled_causal_lm_loss(model, input_ids, labels, one, tile_tokens, **inputs)
    else:
        outputs = model(**inputs, labels=labels, shift_labels=labels, num_items_in_batch=one)
        local_sum = outputs.loss
    loss = group_loss(local_sum, normalizer.to(local_sum.device), group, stats, dp)
    return (loss, outputs) if return_outputs else loss


def model_inputs(shard: dict[str, Any]) -> dict[str, Any]:
    """What of a cut micro-batch the model takes: all but the labels and `ulysses_token_mask` (kept for counting
    tokens, [Note: batches of a sequence-parallel group] in sequence/loader.py).

    Raises:
        ValueError: the micro-batch has an `attention_mask` (the Ulysses attention takes none).
    """
    if "attention_mask" in shard:
        raise ValueError(
            "sequence_parallel_loss takes no attention_mask: each row is one causal sequence, padded at its end with "
            "labels -100 (SequenceShardedLoader checks a mask and drops it)"
        )
    return {key: value for key, value in shard.items() if key not in ("shift_labels", "labels", TOKEN_MASK)}


def data_parallel_groups(group: DataParallelGroup) -> int:
    """torch's world size / `group`'s size: the number of sequence-parallel groups (1 without torch.distributed)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else group.world_size
    return max(1, world // group.world_size)
