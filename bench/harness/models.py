"""The workloads questions share: the Linear stack every peer trains, its data and the ZeRO config it runs under.

`llama_config` / `llama` build the LlamaForCausalLM most other questions train, from a config (no download).
The stack's size is 16 x Linear(1024, 1024) unless the launcher sets `SIZE_ENV`'s variables (bench/report runs a
smaller stack to fit its time budget); every rank reads them, DeepSpeed's included. `AZ_BENCH_BATCH`: the rows
of each micro-batch (default 8: activations are negligible beside the weights; at 1024 each saved activation is
4 MB, and the peak under gradient accumulation shows what lives across micro-steps).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


SIZE_ENV = {"hidden": "AZ_BENCH_HIDDEN", "layers": "AZ_BENCH_LAYERS", "batch": "AZ_BENCH_BATCH"}
HIDDEN = int(os.environ.get(SIZE_ENV["hidden"], "1024"))
LAYERS = int(os.environ.get(SIZE_ENV["layers"], "16"))
MICRO_BATCH, LR = int(os.environ.get(SIZE_ENV["batch"], "8")), 1e-4
MODEL_SEED, DATA_SEED = 0, 1000

STAGE3_KEYS: dict[str, Any] = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 2100000,
    "stage3_max_live_parameters": 4200000,
}
"""Stage 3 as the Linear-stack questions measure it: every Linear its own gather unit, released right after use."""


def build_model(hidden: int = HIDDEN, layers: int = LAYERS) -> nn.Sequential:
    """`layers` x `nn.Linear(hidden, hidden)` with a ReLU between them, the same on every rank.

    The default, 16 x Linear(1024, 1024), has 16.8M fp32 parameters.
    """
    torch.manual_seed(MODEL_SEED)
    modules: list[nn.Module] = []
    for index in range(layers):
        modules.append(nn.Linear(hidden, hidden))
        if index < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def make_batch(rank: int, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed random micro-batch (input, target) per rank, reused at every step."""
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    return torch.randn(MICRO_BATCH, hidden, generator=gen), torch.randn(MICRO_BATCH, hidden, generator=gen)


def engine_config(stage: int, reduce_bucket_size: int | None = None, grad_accum: int = 1) -> dict[str, Any]:
    """The config every ZeRO peer gets on the stack (DeepSpeed's too): defaults except clipping off."""
    zero: dict[str, Any] = {"stage": stage, **(STAGE3_KEYS if stage == 3 else {})}
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "zero_optimization": zero,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    if grad_accum != 1:
        config["gradient_accumulation_steps"] = grad_accum
    return config


def llama_config(
    hidden: int,
    layers: int,
    *,
    vocab: int = 32000,
    intermediate: int | None = None,
    heads: int = 8,
    kv_heads: int | None = None,
    seq: int = 2048,
    tied: bool = False,
    **extra: Any,
) -> Any:
    """A `LlamaConfig` (intermediate default 3 x hidden, key/value heads default `heads`, untied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, max_position_embeddings=seq,
        tie_word_embeddings=tied, **extra,
    )  # fmt: skip


def llama(config: Any, *, seed: int = 0, device: str | torch.device | None = None, dtype: Any = None) -> nn.Module:
    """`LlamaForCausalLM(config)` with seed `seed` (the same on every rank), built on `device`, cast to `dtype`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = LlamaForCausalLM(config)
    return model if dtype is None else model.to(dtype)


def tokens(rows: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """`rows` x `length` random token ids below `vocab`, from their own generator seeded `seed`."""
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
