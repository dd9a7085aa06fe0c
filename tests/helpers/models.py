"""Tiny models with uneven shapes, their data, and the single-process reference every ZeRO run must match."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


IN_FEATURES, HIDDEN, OUT_FEATURES = 7, 15, 3


class ToyModel(nn.Module):
    """Uneven shapes (7 -> 15 -> 15 -> 3), biases and a LayerNorm, so buckets and shards never divide evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.norm(self.inp(x))))))


def make_model(seed: int = 0) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel()


@dataclass(frozen=True)
class Batches:
    """`inputs[step][micro]` holds the full batch (all ranks) of one micro-step."""

    inputs: list[list[torch.Tensor]]
    targets: list[list[torch.Tensor]]

    def rank_slice(self, step: int, micro: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inputs[step][micro], self.targets[step][micro]
        per_rank = x.shape[0] // world_size
        return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def make_batches(steps: int, grad_accum: int, global_batch: int, seed: int = 1) -> Batches:
    gen = torch.Generator().manual_seed(seed)
    inputs = [[torch.randn(global_batch, IN_FEATURES, generator=gen) for _ in range(grad_accum)] for _ in range(steps)]
    targets = [
        [torch.randn(global_batch, OUT_FEATURES, generator=gen) for _ in range(grad_accum)] for _ in range(steps)
    ]
    return Batches(inputs, targets)


def param_groups(model: nn.Module, lr: float, decay: float) -> list[dict]:
    """Weight decay on matrices only, and a different lr for norms and biases (as LLM recipes do)."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [
        {"params": matrices, "weight_decay": decay},
        {"params": vectors, "weight_decay": 0.0, "lr": lr * 0.5},
    ]


def train_reference(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    *,
    clip: float,
    scheduler: object | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
) -> list[float]:
    """Plain single-process training on the full batch; returns the loss of every micro-step."""
    losses = []
    for step_inputs, step_targets in zip(batches.inputs, batches.targets, strict=True):
        grad_accum = len(step_inputs)
        for x, y in zip(step_inputs, step_targets, strict=True):
            loss = loss_fn(model(x), y)
            (loss / grad_accum).backward()
            losses.append(loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (pa.detach().float() - pb.detach().float()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


class TwistyModel(nn.Module):
    """A block called twice, a weight used outside its module's forward, and a branch that appears later."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.alt = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)
        self.use_alt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(torch.tanh(self.block(torch.tanh(self.inp(x))))))
        if self.use_alt:
            h = torch.tanh(self.alt(h))
        # self.out's weight used again by the root, outside self.out's own forward
        return self.out(h) + 0.5 * nn.functional.linear(h, self.out.weight)


def tiny_llama_config(**overrides: object) -> object:
    """A LlamaConfig of a few thousand parameters with tied embeddings (uneven enough to pad)."""
    from transformers import LlamaConfig

    values = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaConfig(**{**values, **overrides})
