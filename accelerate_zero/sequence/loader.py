"""A data loader for Ulysses: every rank's batch becomes p micro-batches, each a slice of one group member's batch.

[Note: batches of a sequence-parallel group]
The loader under it is sharded over every rank as usual (each rank reads its own samples). The p ranks of a
sequence-parallel group then take turns: micro-batch i is group rank i's batch, and each rank holds slice j (its
group rank) of it. One all-to-all per key does it: each rank cuts its own batch into p slices and sends slice j to
rank j, so it receives slice j of every member's batch, 1/p of what an all-gather of whole batches would move.
Before cutting, each rank's batch is made one causal sequence per row: labels shifted on the whole row
(`shift_labels`: what each position predicts, so the last position of a slice predicts the first of the next),
position ids of the whole row, the row padded at its end to a multiple of p (pads predict and are predicted
nothing). A right-padded `attention_mask` becomes `ulysses_token_mask` (1: a real token; without a mask every
position before the padding to p), kept only to count tokens: a padding mask built for a slice would mean nothing
to the Ulysses attention, and one of s x s positions would not fit at long lengths. The group's ranks thus iterate p times per batch of the loader under it, as DeepSpeed's
`UlyssesSPDataLoaderAdapter` does; a data-parallel step is unchanged (each group still consumes one batch per
member), so the engine's batch rule counts world size / p ranks. When the model is not training, batches pass
whole: attention is then plain (evaluation and generation see whole sequences on each rank).

A row may hold several sequences (packing, padding-free collators): its position ids restart at 0 for each; they
are kept, and each piece of such a batch carries the sequences' bounds over the whole row (`ulysses_sequences`)
for the attention ([Note: packed rows under Ulysses] in sequence/ulysses.py). A padding-free collator's own
boundary keys (`cu_seq_lens_*`, `max_length_*`, `seq_idx`) are derived from the positions and would be wrong once
cut: they are dropped.

Refused by name, before any exchange: a batch without labels, position ids that do not count 0, 1, 2, ... within
each sequence, left padding or holes in `attention_mask` (only padding at the end can be dropped), a padded
position whose label is not -100, values that are not `[batch, sequence, ...]` tensors, and a length other than
the one fixed by accelerate's `sp_seq_length` when `sp_seq_length_is_variable` is False.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup


IGNORE_INDEX = -100
PACKING_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
"""A padding-free batch's boundary keys (TRL's collator, transformers' `DataCollatorWithFlattening`)."""
TOKEN_MASK = "ulysses_token_mask"
"""A cut batch's real tokens (1) and padding (0), for counting tokens (TRL's `num_tokens`); the model never reads it
(the Ulysses attention takes no padding mask: [Note: batches of a sequence-parallel group])."""
GroupSource = Callable[[], tuple[DataParallelGroup, CommStats]]


def whole_rows(batch: dict[str, Any], p: int, pad_token_id: int = 0, seq_length: int | None = None) -> dict:
    """`batch` made one causal sequence per row and padded to a multiple of `p`: `input_ids`, `position_ids`,
    `shift_labels` and the other `[batch, sequence, ...]` tensors ([Note: batches of a sequence-parallel group])."""
    # a padding-free collator's boundaries, derived from position_ids, would be wrong once cut: made again from them
    batch = {key: value for key, value in batch.items() if key not in PACKING_KEYS}
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.dim() < 2:
            raise ValueError(
                f"Ulysses sequence parallelism cuts every batch value along its sequence; '{key}' is "
                f"{type(value).__name__ if not torch.is_tensor(value) else f'a tensor of shape {tuple(value.shape)}'}"
                ": give only [batch, sequence, ...] tensors"
            )
    if "input_ids" not in batch:
        raise ValueError(f"Ulysses sequence parallelism needs 'input_ids' in every batch; got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    rows, length = input_ids.shape[:2]
    if seq_length is not None and length != seq_length:
        raise ValueError(
            f"a batch of {length} tokens per row, but sp_seq_length={seq_length} with sp_seq_length_is_variable="
            "False; pad the batches to that length or set sp_seq_length_is_variable=True"
        )
    for key, value in batch.items():
        if value.shape[:2] != (rows, length):
            raise ValueError(f"'{key}' has shape {tuple(value.shape)}; 'input_ids' has {tuple(input_ids.shape)}")
    out = dict(batch)
    if "shift_labels" in out:
        shift = out.pop("shift_labels")
        out.pop("labels", None)
    elif "labels" in out:
        labels = out.pop("labels")
        shift = torch.full_like(labels, IGNORE_INDEX)
        shift[:, :-1] = labels[:, 1:]
    else:
        raise ValueError(
            f"Ulysses sequence parallelism trains on 'labels' (or 'shift_labels'); the batch has {sorted(batch)}"
        )
    positions = out.pop("position_ids", None)
    if positions is None:
        positions = torch.arange(length, device=input_ids.device).expand(rows, length)
    elif not _counts_per_sequence(positions):
        raise ValueError(
            "position_ids that do not count 0, 1, 2, ... within each sequence of a row (a row may hold several "
            "sequences, each starting at 0): give the positions of each sample, as padding-free collators do"
        )
    mask = out.pop("attention_mask", None)
    if mask is not None:
        kept = mask.to(torch.bool)
        right_padded = torch.equal(kept, torch.arange(length, device=kept.device) < kept.sum(1, keepdim=True))
        if not right_padded:
            raise ValueError(
                "attention_mask with padding before or between tokens: Ulysses attention takes one causal sequence "
                "per row; pad at the end (tokenizer padding_side='right')"
            )
        labels_at_pads = torch.zeros_like(kept)
        labels_at_pads[:, :-1] = ~kept[:, 1:]  # shift_labels[i] is the label of token i + 1
        if bool((shift[labels_at_pads] != IGNORE_INDEX).any()):
            raise ValueError(
                "labels on padded positions (attention_mask 0) are not -100: set them to -100, as transformers' "
                "data collators do"
            )
    out[TOKEN_MASK] = (mask if mask is not None else torch.ones_like(input_ids)).to(torch.uint8)
    padded = -(-length // p) * p
    out["shift_labels"] = _pad(shift, padded, IGNORE_INDEX)
    out["input_ids"] = _pad(input_ids, padded, pad_token_id)
    # the padding joins the row's last sequence: after every real token, it changes none of them
    tail = positions[:, -1:] + torch.arange(1, padded - length + 1, device=positions.device)
    out["position_ids"] = torch.cat([positions, tail], dim=1)
    for key in [k for k in out if k not in ("input_ids", "shift_labels", "position_ids")]:
        out[key] = _pad(out[key], padded, 0)
    return out


def _counts_per_sequence(positions: torch.Tensor) -> bool:
    """Each row starts at 0, and each position is 0 (a new sequence) or the one before plus 1."""
    steps = positions[:, 1:] - positions[:, :-1]
    return bool((positions[:, 0] == 0).all() and ((steps == 1) | (positions[:, 1:] == 0)).all())


def sequences_of(positions: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Per row, the [start, end) of each sequence of a packed row (position ids restarting at 0); None when every row
    is one sequence (the attention's fast path)."""
    starts = positions == 0
    if not bool(starts[:, 1:].any()):
        return None
    length = positions.shape[1]
    out = []
    for row in starts.tolist():
        begins = [i for i, start in enumerate(row) if start]
        out.append(list(zip(begins, begins[1:] + [length], strict=True)))
    return out


def _pad(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    shape = (x.shape[0], length - x.shape[1], *x.shape[2:])
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim=1)


def _fingerprint(batch: dict[str, torch.Tensor]) -> int:
    """The keys, dtypes and trailing shapes of `batch`, as a number every rank of a group must share."""
    text = repr(sorted((k, str(v.dtype), tuple(v.shape[2:])) for k, v in batch.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def cut_for_group(
    batch: dict[str, Any],
    group: DataParallelGroup,
    stats: CommStats,
    pad_token_id: int = 0,
    seq_length: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """This rank's slice of each group member's batch, in group-rank order ([Note: batches of a sequence-parallel
    group]). Every rank of `group` must call it at the same time."""
    p = group.world_size
    rows = whole_rows(batch, p, pad_token_id, seq_length)
    device = rows["input_ids"].device
    # each member's rows, length, keys (a fingerprint) and whether its rows are packed, in one gather
    packed = sequences_of(rows["position_ids"]) is not None
    mine = torch.tensor([*rows["input_ids"].shape[:2], _fingerprint(rows), packed], device=device)
    every = torch.empty(p * 4, dtype=mine.dtype, device=device)
    collectives.all_gather(every, mine, group, stats, kind="all_gather_sequence_batch")
    every = every.view(p, 4).tolist()
    shapes = [(b, s) for b, s, _, _ in every]
    if any(fingerprint != every[group.rank][2] for _, _, fingerprint, _ in every):
        raise ValueError(
            "the ranks of a sequence-parallel group gave batches with other keys, dtypes or shapes; this rank's: "
            f"{ {k: (str(v.dtype), tuple(v.shape)) for k, v in rows.items()} }"
        )
    pieces: list[dict[str, Any]] = [{} for _ in range(p)]
    slice_len = rows["input_ids"].shape[1] // p
    for key in sorted(rows):
        value = rows[key]
        trailing = tuple(value.shape[2:])
        width = max(b * (s // p) for b, s in shapes) * max(1, int(torch.Size(trailing).numel()))
        send = torch.zeros(p, width, dtype=value.dtype, device=device)
        for j in range(p):
            part = value[:, j * slice_len : (j + 1) * slice_len].reshape(-1)
            send[j, : part.numel()] = part
        received = torch.empty_like(send)
        collectives.all_to_all(received, send, group, stats, kind="all_to_all_sequence_batch")
        for r, (b, s) in enumerate(shapes):
            numel = b * (s // p) * int(torch.Size(trailing).numel())
            pieces[r][key] = received[r, :numel].reshape(b, s // p, *trailing)
    if any(member_packed for *_, member_packed in every):
        _add_sequences(pieces, rows["position_ids"], shapes, group, stats)
    return pieces


def _add_sequences(
    pieces: list[dict[str, Any]], positions: torch.Tensor, shapes: list, group: DataParallelGroup, stats: CommStats
) -> None:
    """Gives each piece of a packed batch `ulysses_sequences` (`sequences_of` its whole rows), which reaches the
    attention through the model's keyword arguments ([Note: packed rows under Ulysses] in sequence/ulysses.py). Each
    rank holds a slice of another member's positions only, so the whole positions are gathered first."""
    p = group.world_size
    width = max(b * s for b, s in shapes)
    mine = torch.zeros(width, dtype=positions.dtype, device=positions.device)
    mine[: positions.numel()] = positions.reshape(-1)
    every = torch.empty(p * width, dtype=positions.dtype, device=positions.device)
    collectives.all_gather(every, mine, group, stats, kind="all_gather_sequence_batch")
    for r, (b, s) in enumerate(shapes):
        sequences = sequences_of(every.view(p, width)[r, : b * s].view(b, s))
        if sequences is not None:
            pieces[r]["ulysses_sequences"] = sequences


class SequenceShardedLoader:
    """Wraps a data loader for Ulysses ([Note: batches of a sequence-parallel group]): `len()` and iteration give p
    micro-batches per batch of the loader under it while `is_training()` is true, whole batches otherwise.

    Args:
        loader: any iterable of dict batches (accelerate's prepared loader, a torch `DataLoader`).
        size: the sequence-parallel group size p.
        group_source: returns the group and the traffic counter; called at the first batch, so the loader can be
            made before the engine that owns the group.
        is_training: whether the model trains now (None: always).
        pad_token_id: what pads `input_ids` at the end of a row.
        seq_length: the one length every batch must have (accelerate's `sp_seq_length` with
            `sp_seq_length_is_variable=False`); None: any.
        skip: micro-batches to drop from the start of the next iteration (a resumed epoch).
    """

    def __init__(
        self,
        loader: Any,
        size: int,
        group_source: GroupSource,
        is_training: Callable[[], bool] | None = None,
        pad_token_id: int = 0,
        seq_length: int | None = None,
        skip: int = 0,
    ) -> None:
        self.loader, self.size, self.group_source = loader, size, group_source
        self.is_training = is_training if is_training is not None else (lambda: True)
        self.pad_token_id, self.seq_length, self.skip = pad_token_id, seq_length, skip

    def __len__(self) -> int:
        return len(self.loader) * self.size - self.skip

    def __iter__(self) -> Iterator[Any]:
        to_drop, self.skip = self.skip, 0
        for batch in self.loader:
            if not self.is_training():
                yield batch
                continue
            group, stats = self.group_source()
            # accelerate's loader marks its last batch (`accumulate` then steps): only its last piece is the end
            end = getattr(self.loader, "end_of_dataloader", None)
            pieces = cut_for_group(batch, group, stats, self.pad_token_id, self.seq_length)
            for index, piece in enumerate(pieces):
                if to_drop:
                    to_drop -= 1
                    continue
                if end is not None:
                    self.loader.end_of_dataloader = end and index == len(pieces) - 1
                yield piece

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> Any:
        return getattr(self.loader, "batch_size", None)
