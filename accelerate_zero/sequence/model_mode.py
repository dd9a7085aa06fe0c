"""A model scored over cut sequences while it is not training: the Ulysses attention cuts only in training mode
([Note: Ulysses attention] in sequence/ulysses.py), so a frozen reference model, or a model evaluating over cut
sequences, runs its forward in training mode; that changes nothing else when the model has no dropout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether training mode would change `model`'s forward beyond its attention (a dropout of positive rate)."""
    config = getattr(model, "config", None)
    if config is not None and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


@contextlib.contextmanager
def training_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in training mode (its Ulysses attention on), every module's own mode back after."""
    modes = {module: module.training for module in model.modules()}
    model.train()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode
