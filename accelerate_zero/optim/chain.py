"""OptimizerChain: several torch optimizers over disjoint parameters, stepped as one (Muon + AdamW).

Muon is defined on the 2-D hidden weights only; the embeddings, the head, norms and biases go to AdamW. torch gives
two optimizers for that (`torch.optim.Muon` documents the pairing), but the engine, accelerate and the Trainer take
one. The chain is that one: its `param_groups` are the very group dicts of its optimizers, in order (an LR
scheduler bound to the chain sets every optimizer's learning rate), its `state` is one dict that every optimizer
shares (each reads only its own parameters' entries), and `step()` steps each optimizer in turn. The engine decides
the step layout per optimizer in the chain (optim/kinds.py): AdamW's groups step flat shards, Muon's whole matrices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch


class OptimizerChain(torch.optim.Optimizer):
    """Steps several optimizers over disjoint parameters as one optimizer.

    Args:
        optimizers: the optimizers, each over its own parameters (a parameter in two of them is refused when the
            engine adopts the chain, by name).

    Example::

        hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        optimizer = OptimizerChain(torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4))
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if len(optimizers) == 1 and isinstance(optimizers[0], (list, tuple)):
            optimizers = tuple(optimizers[0])
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(f"OptimizerChain takes torch optimizers, got {[type(o).__name__ for o in optimizers]}")
        if any(isinstance(o, OptimizerChain) for o in optimizers):
            raise TypeError("OptimizerChain takes optimizers, not other chains: pass their optimizers instead")
        self.optimizers = list(optimizers)
        state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for optimizer in self.optimizers:
            state.update(optimizer.state)
        # torch's own unpickling path: hook tables and the patched step without re-adding the groups (which would
        # copy them, and the chain must hold its optimizers' own dicts).
        self.__setstate__({"defaults": {}, "state": state, "param_groups": []})
        self._link()

    def _link(self) -> None:
        """Points the chain's groups at its optimizers' group dicts and every optimizer at the shared state."""
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        for optimizer in self.optimizers:
            optimizer.state = self.state

    def groups_of(self) -> list[tuple[torch.optim.Optimizer, int]]:
        """(optimizer, its number of param groups), in the order of `param_groups`."""
        return [(optimizer, len(optimizer.param_groups)) for optimizer in self.optimizers]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Steps every optimizer of the chain, in order (no closure: a chain cannot re-evaluate one loss for each)."""
        if closure is not None:
            raise ValueError("OptimizerChain.step() takes no closure: evaluate the loss before stepping")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading (groups matched by position over the whole chain), then the optimizers relinked: torch
        replaces the group dicts, which each optimizer must hold too."""
        sizes = [size for _, size in self.groups_of()]
        super().load_state_dict(state_dict)
        start = 0
        for optimizer, size in zip(self.optimizers, sizes, strict=True):
            optimizer.param_groups[:] = self.param_groups[start : start + size]
            start += size
        self._link()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "optimizers"):  # torch's constructor path, never taken (see __init__)
            super().add_param_group(param_group)
            return
        raise TypeError("add a param group to one of the chain's optimizers, then build the chain again")


def optimizers_in(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers a chain steps, or `[optimizer]`."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerChain) else [optimizer]


def group_owners(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """For each param group of `optimizer`, the optimizer (of a chain, or itself) that steps it."""
    if isinstance(optimizer, OptimizerChain):
        return [inner for inner, size in optimizer.groups_of() for _ in range(size)]
    return [optimizer] * len(optimizer.param_groups)


def chain_or_single(optimizers: Iterable[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """One optimizer for one, a chain for several."""
    listed = list(optimizers)
    return listed[0] if len(listed) == 1 else OptimizerChain(*listed)
