"""Tiny models with uneven shapes, their data, and the single-process reference every ZeRO run must match."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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
    lose: tuple[int, int] | None = None,
) -> list[float]:
    """Plain single-process training on the full batch; returns the loss of every micro-step.

    `lose`: (step, micro-step) whose backward is skipped (the bug "a lost micro-step", for sizing tolerances)."""
    losses = []
    for step, (step_inputs, step_targets) in enumerate(zip(batches.inputs, batches.targets, strict=True)):
        grad_accum = len(step_inputs)
        for micro, (x, y) in enumerate(zip(step_inputs, step_targets, strict=True)):
            if (step, micro) == lose:
                continue
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


def train_causal_lm(model: nn.Module, tokens: torch.Tensor, lr: float, steps: int) -> None:
    """One process, the full batch: `steps` AdamW steps of a transformers causal LM on `tokens`, clipped to 1.0."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def update_error(
    weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float:
    """||weights - reference|| / ||reference - start|| over the keys of `start`: an error relative to the size of
    the training update (how bf16 runs are compared with an fp32 reference; [Note: the bf16 bound at stage 3] in
    tests/distributed/test_stage3_llama.py)."""
    error = torch.cat([(weights[k].float() - reference[k].float()).reshape(-1) for k in start]).norm()
    return (error / torch.cat([(reference[k].float() - start[k]).reshape(-1) for k in start]).norm()).item()


def round_to_bf16(model: nn.Module) -> nn.Module:
    """The model's weights rounded to bf16 and back: where a bf16 run starts from."""
    for param in model.parameters():
        param.data = param.data.bfloat16().float()
    return model


def train_steps(engine: Any, batches: Batches, rank: int, world_size: int, steps: Iterable[int]) -> None:
    """`engine` trains the toy model on this rank's slice of `batches` (first micro-step of each step), MSE loss."""
    for step in steps:
        x, y = batches.rank_slice(step, 0, rank, world_size)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def gathered_flat(model: nn.Module) -> torch.Tensor:
    """Every parameter, gathered (stage 3) and flattened in fp32: a copy that outlives the gather."""
    import accelerate_zero

    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


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


def tiny_t5_config(**overrides: object) -> object:
    """A T5Config of a few thousand parameters (shared, tied embeddings; relative attention bias in block 0)."""
    from transformers import T5Config

    values = dict(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=24,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5Config(**{**values, **overrides})


def tiny_bart_config(**overrides: object) -> object:
    """A BartConfig of a few thousand parameters (shared, tied embeddings; learned positions)."""
    from transformers import BartConfig

    values = dict(
        vocab_size=64,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return BartConfig(**{**values, **overrides})


@dataclass(frozen=True)
class ZooModel:
    """One architecture of the model zoo: how to build it (random weights) and what it is."""

    build: Callable[[], nn.Module]
    kind: str
    """"causal" (decoder-only LM), "seq2seq", "classify" (token sequence -> label) or "vision"."""
    skew: bool = False
    """MoE routing skewed so that the two halves of the vocabulary (one per rank) use disjoint experts."""


ZOO_VOCAB, ZOO_LABELS, ZOO_IMAGE = 64, 3, 8

# Shared by the decoder-only configs: hidden 32 (4 heads of 8, 2 key-value heads), 2 layers, vocabulary 64.
_DECODER = dict(
    vocab_size=ZOO_VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_qwen2_config(**overrides: object) -> object:
    """A Qwen2Config of the zoo's decoder shape (4 heads, 2 key/value heads), no sliding window, untied."""
    from transformers import Qwen2Config

    values = dict(_DECODER, tie_word_embeddings=False, use_sliding_window=False)
    return Qwen2Config(**{**values, **overrides})


def tiny_mistral_config(**overrides: object) -> object:
    """A MistralConfig of the zoo's decoder shape, with Mistral's default sliding window (4096)."""
    from transformers import MistralConfig

    return MistralConfig(**{**_DECODER, **overrides})


def _build(model_class: str, config_class: str, **values: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, config_class)(**values)
        return getattr(transformers, model_class)(config)

    return build


def _zoo() -> dict[str, ZooModel]:
    moe = dict(_DECODER, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8)
    lm = {
        "llama": _build("LlamaForCausalLM", "LlamaConfig", **_DECODER),
        "mistral": _build("MistralForCausalLM", "MistralConfig", **_DECODER, sliding_window=None),
        "qwen2": _build("Qwen2ForCausalLM", "Qwen2Config", **_DECODER),
        "qwen3": _build("Qwen3ForCausalLM", "Qwen3Config", **_DECODER, head_dim=8),
        "gemma": _build("GemmaForCausalLM", "GemmaConfig", **_DECODER, head_dim=8),
        "gemma2": _build("Gemma2ForCausalLM", "Gemma2Config", **_DECODER, head_dim=8, sliding_window=16),
        "phi3": _build("Phi3ForCausalLM", "Phi3Config", **_DECODER),
        "gpt2-tied": _build(
            "GPT2LMHeadModel", "GPT2Config", vocab_size=ZOO_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64
        ),
        "gpt-neox": _build(
            "GPTNeoXForCausalLM",
            "GPTNeoXConfig",
            **{k: v for k, v in _DECODER.items() if k != "num_key_value_heads"},
            rotary_pct=0.5,
        ),
        "opt": _build(
            "OPTForCausalLM",
            "OPTConfig",
            vocab_size=ZOO_VOCAB,
            hidden_size=32,
            ffn_dim=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            pad_token_id=0,
        ),
        "bloom": _build("BloomForCausalLM", "BloomConfig", vocab_size=ZOO_VOCAB, hidden_size=32, n_layer=2, n_head=4),
        "falcon": _build(
            "FalconForCausalLM",
            "FalconConfig",
            vocab_size=ZOO_VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
        "mixtral": _build(
            "MixtralForCausalLM", "MixtralConfig", **_DECODER, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen3-moe": _build("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **moe),
        "qwen2-moe": _build("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **moe, shared_expert_intermediate_size=16),
    }
    zoo = {name: ZooModel(build, "causal") for name, build in lm.items()}
    zoo["qwen3-moe-skewed"] = ZooModel(lm["qwen3-moe"], "causal", skew=True)
    zoo["mixtral-skewed"] = ZooModel(lm["mixtral"], "causal", skew=True)
    zoo["t5"] = ZooModel(_from_config("T5ForConditionalGeneration", tiny_t5_config), "seq2seq")
    zoo["bart"] = ZooModel(_from_config("BartForConditionalGeneration", tiny_bart_config), "seq2seq")
    zoo["bert"] = ZooModel(
        _build(
            "BertForSequenceClassification",
            "BertConfig",
            vocab_size=ZOO_VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
            num_labels=ZOO_LABELS,
        ),
        "classify",
    )
    zoo["vit"] = ZooModel(
        _build(
            "ViTForImageClassification",
            "ViTConfig",
            image_size=ZOO_IMAGE,
            patch_size=4,
            num_channels=3,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=32,
            num_labels=ZOO_LABELS,
        ),
        "vision",
    )
    return zoo


def _from_config(model_class: str, config: Callable[[], object]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model_class)(config())

    return build


ZOO = _zoo()
"""Tiny random configs of transformers architectures (hidden 16-32, 2 layers, vocabulary 64), by name."""
