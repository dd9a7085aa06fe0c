"""Per-token log-probabilities of whole sequences computed by a sequence-parallel group: each rank holds a slice of
every row, and each row's values come back whole to the rank that owns it.

[Note: per-token values under sequence parallelism]
GRPO's and DPO's losses are functions of per-token log-probabilities (a sequence's sum or mean, a ratio to the old
policy's, a KL to the reference's, a normalisation by tokens, a completion, a batch or a generation batch). Rather than
writing each of those reductions again over a group (TRL offers many `loss_type` values, and adds more), the group
computes only the per-token values over cut sequences and hands every rank its own rows' values whole, as
`[rows, tokens]` tensors: the trainer's own loss then runs on them unchanged, on the rank that generated or read
those rows, as it does without sequence parallelism. A `[rows, tokens]` tensor is small; what must not be whole at
long lengths (the activations, the attention, the `[rows, tokens, vocabulary]` logits) never is.

1. Each rank's rows are made one causal sequence each: the real tokens (`attention_mask` 1) moved to the front in
   order, so a left-padded prompt and a right-padded completion become one sequence padded at its end; what each
   position predicts (`shift_labels`) is the next real token where that token is scored, -100 elsewhere. Position
   ids then count from 0 at the first real token, where the one-process forward counts from the first column: a
   rotary embedding (every model Ulysses runs here) depends on the difference of two positions only, so the
   attention and every log-probability are the same (within rounding); a model with absolute position embeddings
   would differ.
2. The group pads its rows to one length (the longest over the group, a multiple of p) and cuts them as the loader
   does ([Note: batches of a sequence-parallel group] in sequence/loader.py): each rank holds slice k of every
   member's rows. The group runs one forward (Ulysses attention) per member's rows, each under activation
   checkpointing: autograd keeps only the `[rows, L/p]` values, and backward recomputes one member's forward at a
   time. So a rank's peak is one member's slice (its rows x L/p tokens), as at sp 1 with L/p tokens: a forward of
   all members' rows at once would keep p x rows x L/p = rows x L tokens' activations, what sp 1 keeps, and the
   longest trainable completion would not grow with p. The cost is one more forward per training step.
3. One all-to-all returns member j's rows to member j, each rank's slice in its place (`_ToOwners`); its backward is
   the all-to-all the other way, so the gradient of a rank's own loss reaches every slice of its rows, on every rank
   of the group. A rank's parameter gradient is then the sum, over the group's rows, of its slices' parts of each
   owner's loss, and the engine's mean over all ranks is the mean over all ranks of each rank's own loss's
   gradient: exactly what the trainer's loss gives without sequence parallelism, whatever that loss is.
4. Values are mapped back to the trainer's columns: a token's value at its original column, 0 where nothing is
   scored (TRL's fused LM head gives 0 there too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence.loader import IGNORE_INDEX, cut_for_group


Scorer = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor | None]]
"""Runs the model on one stacked slice (`input_ids`, `position_ids`, `shift_labels`, each `[rows, L/p]`) and returns
per-token values by name: the log-probability of each position's `shift_labels` token (0 where -100), and any others
(an entropy, ...), each `[rows, L/p]`, or None."""


def _justified(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's real tokens moved to its front, in order: (input_ids, shift_labels, mask), right-padded."""
    keep = attention_mask.to(torch.bool)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # kept columns first, in order
    ids = input_ids.gather(1, order).masked_fill(~keep.gather(1, order), 0)
    targets = torch.where(scored & keep, input_ids, IGNORE_INDEX).gather(1, order)
    shift = torch.full_like(targets, IGNORE_INDEX)
    shift[:, :-1] = targets[:, 1:]  # position q predicts the real token at q + 1
    return ids, shift, keep.gather(1, order)


def _group_length(length: int, group: DataParallelGroup, stats: CommStats, device: torch.device) -> int:
    """The longest row over `group`, rounded up to a multiple of its size."""
    mine = torch.tensor([length], dtype=torch.long, device=device)
    every = torch.empty(group.world_size, dtype=torch.long, device=device)
    collectives.all_gather(every, mine, group, stats, kind="all_gather_sequence_batch")
    longest = int(every.max().item())
    return -(-longest // group.world_size) * group.world_size


def _pad_to(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)


def _exchange(parts: list[torch.Tensor], group: DataParallelGroup, stats: CommStats) -> list[torch.Tensor]:
    """Part j (any shape) to rank j of `group`; returns what each rank k sent here, flat (padded)."""
    width = max(1, max(part.numel() for part in parts))  # the same on every rank: the parts are padded alike
    send = torch.zeros(len(parts), width, dtype=parts[0].dtype, device=parts[0].device)
    for j, part in enumerate(parts):
        send[j, : part.numel()] = part.reshape(-1)
    received = torch.empty_like(send)
    collectives.all_to_all(received, send, group, stats, kind="all_to_all_sequence_values")
    return list(received)


class _ToOwners(torch.autograd.Function):
    """`[rows of every member, L/p]` (this rank's slice of each member's rows, stacked in member order) ->
    `[this rank's rows, L]` (every slice of its own rows), and back in backward ([Note: per-token values under
    sequence parallelism], step 3)."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, counts: list[int], group: DataParallelGroup, stats: CommStats
    ) -> torch.Tensor:
        ctx.counts, ctx.group, ctx.stats = counts, group, stats
        width = local.shape[1]
        mine = counts[group.rank]
        # the exchange must have the same size on every rank: pad each part to the largest member's rows
        largest = max(counts)
        parts = [_pad_rows(part, largest) for part in local.split(counts, dim=0)]
        received = _exchange(parts, group, stats)
        slices = [part[: largest * width].view(largest, width)[:mine] for part in received]
        return torch.cat(slices, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        counts, group = ctx.counts, ctx.group
        largest, width = max(counts), grad.shape[1] // group.world_size
        parts = [_pad_rows(part, largest) for part in grad.contiguous().split(width, dim=1)]
        received = _exchange(parts, group, ctx.stats)
        rows = [
            part[: largest * width].view(largest, width)[:count] for part, count in zip(received, counts, strict=True)
        ]
        return torch.cat(rows, dim=0), None, None, None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if x.shape[0] < rows else x


def sequence_parallel_token_values(
    score: Scorer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    group: DataParallelGroup,
    stats: CommStats,
) -> dict[str, torch.Tensor | None]:
    """The per-token values `score` gives (log-probabilities, entropies, ...) at every column of this rank's rows,
    computed by `group` on cut sequences and returned whole, differentiable ([Note: per-token values under sequence
    parallelism]). Every rank of `group` must call it at the same time, the model in training mode (its Ulysses
    attention on), with the same names from `score`.

    Args:
        score: runs the model on the stacked slice (`Scorer`).
        input_ids: `[rows, columns]`, any padding (left, right or both) marked by `attention_mask`.
        attention_mask: 1 at real tokens.
        scored: `[rows, columns]` booleans: the tokens whose values are wanted (a completion's, a response's).

    Returns:
        By name, `[rows, columns]` values of each scored token at its own column (0 where not scored or not real);
        None where `score` gave None.
    """
    ids, shift, mask = _justified(input_ids, attention_mask, scored)
    length = _group_length(int(mask.sum(1).max().item()) if mask.numel() else 0, group, stats, ids.device)
    batch = {
        "input_ids": _pad_to(ids[:, :length], length, 0),
        "shift_labels": _pad_to(shift[:, :length], length, IGNORE_INDEX),
        "attention_mask": _pad_to(mask[:, :length].long(), length, 0),
    }
    pieces = cut_for_group(batch, group, stats)
    counts = [piece["input_ids"].shape[0] for piece in pieces]
    scored_pieces = [_score_member(score, piece) for piece in pieces]  # [Note: ...], step 2: one member at a time
    out: dict[str, torch.Tensor | None] = {}
    for name in scored_pieces[0]:
        if scored_pieces[0][name] is None:
            out[name] = None
            continue
        values = torch.cat([member[name] for member in scored_pieces])
        # the exchange moves floating-point values; a flag (TRL's `is_top1`) travels as one and comes back as itself
        owned = _ToOwners.apply(values if values.is_floating_point() else values.float(), counts, group, stats)
        out[name] = _at_columns(owned, attention_mask, scored).to(values.dtype)
    return out


def check_same_calls(
    rows: int, chunk: int | None, group: DataParallelGroup, stats: CommStats, device: torch.device, who: str
) -> None:
    """Raises on every rank of `group` when its members would score their rows in a different number of calls.

    Each call of `sequence_parallel_token_values` is a collective of the whole group, so a rank scoring its `rows`
    in more chunks than another would wait for it forever; the row counts may differ as long as the calls do not
    (each call exchanges every member's own rows).

    Args:
        rows: this rank's rows.
        chunk: the rows per call (TRL's `batch_size` chunking); None: all rows in one call.
        who: names the caller in the error (the trainer's class).

    Raises:
        ValueError: on every rank of the group, naming each member's rows and calls and the fix.
    """
    calls = -(-rows // chunk) if chunk else int(rows > 0)
    mine = torch.tensor([rows, calls], dtype=torch.long, device=device)
    every = torch.empty(2 * group.world_size, dtype=torch.long, device=device)
    collectives.all_gather(every, mine, group, stats, kind="all_gather_sequence_batch")
    members = every.view(group.world_size, 2).tolist()
    if len({member_calls for _, member_calls in members}) > 1:
        raise ValueError(
            f"{who} under sequence parallelism: the ranks of a sequence-parallel group hold {[r for r, _ in members]} "
            f"rows, scored {chunk or 'all'} at a time: {[c for _, c in members]} calls, and each call needs every "
            "rank of the group (the ranks would wait for one another forever); give every rank of the group as "
            "many rows (the same per-device batch size; for evaluation, a dataset whose size is a multiple of the "
            "number of processes x per_device_eval_batch_size), or let each rank score its rows in one call"
        )


def _score_member(score: Scorer, piece: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """`score` on one member's rows, under activation checkpointing while gradients are on: autograd keeps only the
    values, and backward recomputes this member's forward alone ([Note: per-token values under sequence
    parallelism], step 2)."""
    keys = ("input_ids", "position_ids", "shift_labels")
    names: list[str] = []
    given: list[bool] = []

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = score(dict(zip(keys, inputs, strict=True)))
        names[:], given[:] = list(out), [value is not None for value in out.values()]
        return tuple(value for value in out.values() if value is not None)

    inputs = [piece[key] for key in keys]
    values = iter(checkpoint(run, *inputs, use_reentrant=False) if torch.is_grad_enabled() else run(*inputs))
    return {name: next(values) if present else None for name, present in zip(names, given, strict=True)}


def _at_columns(values: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Justified values (position q: the token at q + 1) at the original columns; 0 where nothing is scored."""
    keep = attention_mask.to(torch.bool)
    predicted_at = keep.long().cumsum(1) - 2  # the justified position that predicts each real column's token
    take = scored & keep & (predicted_at >= 0)
    index = predicted_at.clamp(min=0, max=values.shape[1] - 1)
    return torch.where(take, values.gather(1, index), values.new_zeros(()))
