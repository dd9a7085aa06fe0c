"""Restoring an engine of any stage and world size from another framework's checkpoint ([Note: foreign checkpoints
through our fragments] in pieces.py).

[Note: a foreign checkpoint fails on every rank]
A foreign folder has no checksums, and every rank reads the files its ranges need: a missing or damaged file is
found by the ranks that read it. Each rank therefore reads and restores its ranges locally (no collective), catches
what went wrong, and the ranks exchange their problems (one small all-gather) before the first collective of the
load (publishing the parameters): every rank raises the first problem, naming the file, and none is left waiting
in a collective that the failed rank never joins.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from accelerate_zero.checkpoint.foreign import ForeignCheckpoint
from accelerate_zero.checkpoint.fragment_load import load_frozen, load_trainable, names_of
from accelerate_zero.engine import collectives
from accelerate_zero.engine.checkpoint_state import CheckpointState, StepCounters


if TYPE_CHECKING:
    from accelerate_zero.checkpoint.engine_view import ZeroEngine


T = TypeVar("T")
_STATE_KINDS = {
    "Adam": {"exp_avg", "exp_avg_sq", "step"},
    "AdamW": {"exp_avg", "exp_avg_sq", "step"},
    "SGD": {"momentum_buffer"},
}
"""The optimizer state a foreign folder's kinds must match, by our optimizer's class (amsgrad adds max_exp_avg_sq)."""


def on_every_rank(engine: ZeroEngine, work: Callable[[], T]) -> T:
    """`work()` on this rank; if it raised ValueError/FileNotFoundError on any rank, every rank raises the first
    rank's error ([Note: a foreign checkpoint fails on every rank]). Every rank must call it."""
    result, problem = None, None
    try:
        result = work()
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        problem = f"{type(error).__name__}: {error}"
    found = collectives.all_gather_object(problem, engine.layout.world)
    first = next(((rank, p) for rank, p in enumerate(found) if p is not None), None)
    if first is not None:
        kind, _, message = first[1].partition(": ")
        error_type = FileNotFoundError if kind == "FileNotFoundError" else ValueError
        raise error_type(message if first[0] == engine.layout.world.rank else f"{message} (found by rank {first[0]})")
    return result  # type: ignore[return-value]


def load_foreign(
    engine: ZeroEngine,
    read: Callable[[], ForeignCheckpoint],
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
) -> tuple[Path, dict[str, Any]]:
    """Restores weights, fp32 masters, optimizer state, step counters, the loss scale and the scheduler from the
    folder `read()` reads; every rank must call it.

    Returns:
        (the checkpoint folder, its client state).

    Raises:
        ValueError: on every rank, naming the file or parameter: a file is missing or damaged, the model differs
            from the checkpoint's, or the optimizer keeps other state than the checkpoint holds.
    """
    checkpoint = on_every_rank(engine, read)
    state = engine.checkpoint_state()
    from_model = _check_model(state, checkpoint, load_optimizer_states)
    if load_optimizer_states:
        _check_optimizer(state, checkpoint)
    names = names_of(state)

    def restore() -> None:
        with torch.no_grad():
            load_trainable(state, checkpoint.reader, names, load_optimizer_states)
            load_frozen(state, checkpoint.reader, names, from_model)

    on_every_rank(engine, restore)
    state.finish_load()
    if load_optimizer_states:
        if checkpoint.param_groups is not None:
            for group, saved in zip(state.optimizer.param_groups, checkpoint.param_groups, strict=True):
                group.update({k: v for k, v in saved.items() if k in group})
        if state.loss_scaler is not None and checkpoint.loss_scaler is not None:
            state.loss_scaler.load_state_dict({**state.loss_scaler.state_dict(), **checkpoint.loss_scaler})
    if load_lr_scheduler_states and engine.lr_scheduler is not None and checkpoint.scheduler:
        engine.lr_scheduler.load_state_dict(checkpoint.scheduler)
    accumulation = engine.config.gradient_accumulation_steps
    accumulation = accumulation if isinstance(accumulation, int) else 1
    steps = checkpoint.global_steps
    state.restore_counters(StepCounters(steps, steps * accumulation, checkpoint.skipped_steps))
    engine.zero_grad()
    return checkpoint.folder, checkpoint.client_state


def _check_model(state: CheckpointState, checkpoint: ForeignCheckpoint, with_optimizer: bool) -> set[str]:
    """The frozen parameters whose values stay the model's (the checkpoint left them out, as DeepSpeed's
    `exclude_frozen_parameters` does), after checking every other parameter is in the checkpoint with its shape."""
    model = state.param_shapes()
    trainable = {name for name, p in state.module.named_parameters() if p.requires_grad}
    saved = checkpoint.param_shapes
    problems = [
        f"{name}: checkpoint {saved[name]}, model {shape}"
        for name, shape in model.items()
        if name in saved and list(saved[name]) != list(shape)
    ]
    absent = sorted(name for name in model if name not in saved and name in trainable)
    if absent:
        problems.append(f"no values for the trained parameter(s) {', '.join(absent[:10])}")
    untrained = sorted(trainable & set(saved) - set(checkpoint.trained))
    if untrained and with_optimizer:
        problems.append(f"no optimizer state for {', '.join(untrained[:10])} (frozen in the run that saved it)")
    if problems:
        raise ValueError(
            f"{checkpoint.folder} ({checkpoint.source}) was saved from another model: "
            + "; ".join(problems[:10])
            + ". Build the model the checkpoint was trained with (the same config, the same adapters)"
        )
    kept = sorted(name for name in model if name not in saved)
    if kept:
        warnings.warn(
            f"{checkpoint.folder} ({checkpoint.source}) holds no values for {len(kept)} frozen parameters "
            f"({', '.join(kept[:5])}{', ...' if len(kept) > 5 else ''}; saved with exclude_frozen_parameters): they "
            "keep the model's values, which must be the base weights it was trained from",
            stacklevel=4,
        )
    known = {name for name, _ in state.module.named_parameters(remove_duplicate=False)}
    known |= {name for name, _ in state.module.named_buffers()}
    extra = sorted(set(saved) - set(model) - known)  # tied aliases and buffers are not extra
    if extra:
        warnings.warn(f"{checkpoint.folder} holds parameters the model lacks, not loaded: {extra[:10]}", stacklevel=4)
    return set(kept)


def _check_optimizer(state: CheckpointState, checkpoint: ForeignCheckpoint) -> None:
    optimizer = state.optimizer
    name = type(optimizer).__name__
    groups = checkpoint.param_groups
    if groups is not None and len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{checkpoint.folder} ({checkpoint.source}) holds {len(groups)} optimizer param groups; this engine's "
            f"{name} has {len(optimizer.param_groups)}: build the optimizer with the same groups (the Trainer makes "
            "two: with and without weight decay), or pass load_optimizer_states=False"
        )
    saved = set().union(*(checkpoint.reader.kinds_of(n) for n in checkpoint.trained[:1])) - {"master", "param"}
    expected = set(_STATE_KINDS.get(name, saved))
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        expected.add("max_exp_avg_sq")
    if name not in _STATE_KINDS or saved != expected:
        raise ValueError(
            f"{checkpoint.folder} ({checkpoint.source}) holds optimizer state {sorted(saved)}; this engine's "
            f"optimizer is a {name}, which keeps {sorted(expected) if name in _STATE_KINDS else 'another state'}: "
            "build the optimizer the run used (DeepSpeed's Adam/AdamW are torch.optim.AdamW), or pass "
            "load_optimizer_states=False to load the weights only"
        )
