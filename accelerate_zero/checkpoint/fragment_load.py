"""Restoring an engine's ranges from a reader of saved fragments: what loading our own checkpoints and those of other
frameworks share ([Note: universal checkpoints] in fragments.py; [Note: foreign checkpoints through our fragments] in
pieces.py).

A reader answers `read_range(name, kind, start, end)` (elements of a parameter's `master`, `param` or optimizer
state), `read_scalar(name, kind, ...)` (a 0-d state: `step`), `read_whole(key)` (`<name>/full`, `<name>/buffer`) and
`kinds_of(name)`: checkpoint/io.py's `FragmentReader` over our rank files, pieces.py's `PieceReader` over a foreign
folder.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from accelerate_zero.checkpoint.fragments import Fragment, range_fragments, whole_key
from accelerate_zero.checkpoint.shaped_state import shaped_state
from accelerate_zero.engine.checkpoint_state import CheckpointState, ShardRange


class SavedFragments(Protocol):
    """What loading reads of a checkpoint (see the module docstring)."""

    def read_range(self, name: str, kind: str, start: int, end: int) -> torch.Tensor | None: ...

    def read_scalar(self, name: str, kind: str, start: int, end: int) -> torch.Tensor | None: ...

    def read_whole(self, key: str) -> torch.Tensor | None: ...

    def kinds_of(self, name: str) -> set[str]: ...


def names_of(state: CheckpointState) -> dict[int, str]:
    return {id(p): n for n, p in state.module.named_parameters()}


def _fragments(shard_range: ShardRange, names: dict[int, str]) -> list[Fragment]:
    return range_fragments(
        shard_range.plan, shard_range.params, names, shard_range.lo, shard_range.hi, shard_range.offsets
    )


def check_shapes(state: CheckpointState, meta: dict[str, Any], folder: Path) -> None:
    """Every model parameter is in the checkpoint with the same shape; checkpoint extras only warn."""
    saved: dict[str, list[int] | None] = meta["param_shapes"]
    model = state.param_shapes()
    wrong = [
        f"{name}: checkpoint {saved[name]}, model {shape}"
        for name, shape in model.items()
        if name in saved and saved[name] is not None and list(saved[name]) != list(shape)
    ]
    if wrong:
        raise ValueError(
            f"{folder} was saved from a model with other parameter shapes ({len(wrong)} differ): "
            + "; ".join(wrong[:10])
            + ("; ..." if len(wrong) > 10 else "")
            + ". Build the model with the checkpoint's config."
        )
    absent = sorted(set(model) - set(saved))
    if absent:
        raise ValueError(
            f"{folder} has no values for {len(absent)} parameters of the model ({', '.join(absent[:10])}): it was "
            "saved from another model"
        )
    extra = sorted(set(saved) - set(model))
    if extra:
        warnings.warn(
            f"{folder} holds {len(extra)} parameters the model lacks, not loaded: {', '.join(extra[:20])}",
            stacklevel=4,
        )


def check_optimizer(state: CheckpointState, meta: dict[str, Any], folder: Path) -> None:
    saved, current = meta["optimizer"], type(state.optimizer).__name__
    groups, saved_groups = len(state.optimizer.param_groups), len(meta["param_groups"])
    if saved != current or groups != saved_groups:
        raise ValueError(
            f"{folder} holds the state of a {saved} optimizer with {saved_groups} param groups; this engine's "
            f"optimizer is a {current} with {groups}: build the same optimizer, or pass load_optimizer_states=False "
            "to load the weights (and counters) only"
        )


def _values(reader: SavedFragments, frag: Fragment) -> torch.Tensor:
    for kind in ("master", "param"):
        found = reader.read_range(frag.name, kind, frag.start, frag.end)
        if found is not None:
            return found
    full = reader.read_whole(whole_key(frag.name, "full"))
    if full is None:
        raise ValueError(f"the checkpoint has no values for parameter {frag.name!r}: was it saved from this model?")
    return full.reshape(-1)[frag.start : frag.end]


def load_trainable(state: CheckpointState, reader: SavedFragments, names: dict[int, str], with_state: bool) -> None:
    optimizer = state.optimizer
    for batch in state.trainable_batches(write_back=True):
        for trainable in batch:
            master = trainable.master
            fragments = _fragments(trainable.range, names)
            for frag in fragments:
                trainable.flat_master[frag.offset : frag.offset + frag.numel].copy_(_values(reader, frag))
            state.write_trainable([trainable])
            if with_state and fragments:
                group = next(g for g in optimizer.param_groups if any(p is master for p in g["params"]))
                optimizer.state[master] = _slice_state(reader, fragments, master, group, trainable.whole)


def _slice_state(
    reader: SavedFragments, fragments: list[Fragment], master: torch.Tensor, group: dict[str, Any], whole: bool
) -> dict[str, torch.Tensor]:
    kinds = set().union(*(reader.kinds_of(f.name) for f in fragments)) - {"master", "param"}
    state = {}
    # As torch.optim's load_state_dict: fused and capturable kernels keep their scalars (`step`) as fp32 on the
    # parameter's device; the others keep them on the CPU.
    scalar_device = master.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    for kind in sorted(kinds):
        scalar = reader.read_scalar(fragments[0].name, kind, fragments[0].start, fragments[0].end)
        if scalar is not None and scalar.ndim == 0:
            dtype = torch.float32 if kind == "step" else scalar.dtype
            state[kind] = scalar.to(device=scalar_device, dtype=dtype, copy=True)
            continue
        shaped = shaped_state(reader, fragments[0], kind, whole)  # [Note: state in a parameter's own shape]
        if shaped is not None:
            state[kind] = shaped.to(master.device, copy=True)
            continue
        dtype = scalar.dtype if scalar is not None else master.dtype
        values = torch.zeros(master.shape, dtype=dtype, device=master.device)
        flat = values.view(-1)
        for frag in fragments:
            piece = reader.read_range(frag.name, kind, frag.start, frag.end)
            if piece is None:  # a fragment the plan needs is missing by name: never a silent zero state
                raise ValueError(
                    f"the checkpoint has no {kind!r} optimizer state for {frag.name}[{frag.start}:{frag.end}] "
                    "although other parameters have it: a rank file is corrupted or foreign"
                )
            flat[frag.offset : frag.offset + frag.numel].copy_(piece)
        state[kind] = values
    return state


def load_frozen(state: CheckpointState, reader: SavedFragments, names: dict[int, str], from_model: set[str]) -> None:
    """Frozen shards and the parameters no rank shards; those in `from_model` (checked) keep the model's values."""
    for frozen in state.frozen_shards():
        if all(names[id(p)] in from_model for p in frozen.range.params):
            continue
        shard = state.read_frozen(frozen)
        for frag in _fragments(frozen.range, names):
            if frag.name not in from_model:
                shard[frag.offset : frag.offset + frag.numel].copy_(_values(reader, frag))
        state.write_frozen(frozen, shard)
    covered = state.sharded_parameters()
    for name, param in state.module.named_parameters():
        if id(param) in covered or name in from_model:
            continue
        offset = state.part_of_whole(param)
        if offset is not None:  # a frozen split expert: its range of the whole tensor, however it was saved
            param.data.copy_(_values(reader, Fragment(name, offset, offset + param.numel(), 0)).reshape(param.shape))
            continue
        full = reader.read_whole(whole_key(name, "full"))
        if full is None:
            full = _values(reader, Fragment(name, 0, param.numel(), 0)).reshape(param.shape)
        param.data.copy_(full)
    for name, buffer in state.module.named_buffers():
        saved = reader.read_whole(whole_key(name, "buffer"))
        if saved is not None:
            buffer.copy_(saved)
