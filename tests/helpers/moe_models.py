"""Every mixture-of-experts model type of the installed transformers, as a tiny model, and what expert parallelism
does with it (tests/distributed/test_expert_parallel_models.py).

`moe_model_types()` lists the model types whose modeling code speaks of experts; each must appear in exactly one
of the split ones (every type not in `REFUSED`: its experts are split at ep 2 and the model computes what the
unsplit one does) or of `REFUSED` (initialize refuses it, naming the module; the value is part of the message), so
a model type added to transformers later fails the walk until its tiny config (`OVERRIDES`) builds and it splits
exactly, or it is refused by name. `tiny_moe(model_type)` builds the text model of a type from its config class with small sizes.
"""

from __future__ import annotations

import importlib
import math
import pathlib
from typing import Any

import torch
from torch import nn


SMALL: dict[str, int] = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=20, head_dim=8,
    max_position_embeddings=64, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_topk=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8,
    q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, num_experts_per_token=2, moe_k=2, top_k_experts=2, num_expert_group=1, n_shared_experts=1,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, num_dense_layers=1,
)  # fmt: skip
"""Sizes every tiny model gets where its config has the key (an int there)."""

_MLA = {"head_dim": 4}  # multi-head latent attention: the rotary part is qk_rope_head_dim wide
_MLA_INDEXED = {"head_dim": 4, "num_key_value_heads": 4}  # and an indexer with as many key heads as query heads
OVERRIDES: dict[str, dict[str, Any]] = {
    "axk1": _MLA, "axk2": _MLA_INDEXED, "deepseek_v2": _MLA, "deepseek_v3": _MLA, "deepseek_v32": _MLA_INDEXED,
    "glm_moe_dsa": _MLA_INDEXED, "mistral_large4": _MLA_INDEXED, "kimi_linear": _MLA, "hy_v4": _MLA_INDEXED,
    "bailing_hybrid": _MLA_INDEXED, "dots3_note": _MLA_INDEXED,
    "glm5_next": {"num_key_value_heads": 4, "qk_rope_head_dim": 0, "mlp_layer_types": ["dense", "sparse"]},
    "zaya": {"num_experts_per_tok": 1},
    "lfm2_moe": {"layer_types": ["full_attention", "full_attention"]},
    "step3p7": {"sliding_window": 16, "mlp_layer_types": ["dense", "sparse"]},
    "deepseek_ocr2": {"mlp_layer_types": ["dense", "sparse"]},
    "ernie4_5_vl_moe": {
        "moe_intermediate_size": [24, 24],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [1, 1, 2]},
    },
    "glm4v_moe": {
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 0, 1],
        },
    },
    "hy_v4_vl": {**_MLA_INDEXED, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 0, 1]}},
    "longcat_flash": {
        "num_layers": 1, "ffn_hidden_size": 40, "expert_ffn_hidden_size": 24, "moe_topk": 2, "zero_expert_num": 2,
        "head_dim": 4, "qk_head_dim": 8,
    },
    "dbrx": {
        "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64, "vocab_size": 64,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "switch_transformers": {
        "d_model": 32, "d_kv": 8, "d_ff": 40, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
        "encoder_sparse_step": 2, "decoder_sparse_step": 2,
    },
    "nllb-moe": {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 40, "decoder_ffn_dim": 40,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_sparse_step": 2, "decoder_sparse_step": 2,
    },
    "vitpose_backbone": {"num_experts": 2, "part_features": 8},
    "flint": {"mlp_only_layers": [0]},
    "beam": {"mlp_layer_types": ["dense", "sparse"]},
    "gemma4": {
        "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24,
        "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8, "per_layer_config": {},
    },
    "doge": {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 2},
}  # fmt: skip
"""Per model type, what the generic sizes get wrong."""

REFUSED: dict[str, str] = {
    "jetmoe": "is called as forward('inputs', 'expert_size')",  # tokens pre-sorted by expert, with their counts
    "longcat_flash": "holds experts but is not a fused experts module",  # routed experts beside "zero experts"
    "nllb-moe": "holds its experts as a dict of",
    "switch_transformers": "holds its experts as a dict of",
    "vitpose_backbone": "holds its experts as a list of",
    "doge": "no fused experts module",  # retrieval experts held as embeddings
    "bamba": "no fused experts module",  # a dense hybrid: no MoE layer at all
}
"""Model types expert parallelism refuses at `initialize`, and part of the message (it names the module)."""


def moe_model_types() -> list[str]:
    """Model types (CONFIG_MAPPING keys) whose modeling code mentions experts."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    root = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        folder = root / model_type.replace("-", "_")
        if any("experts" in f.read_text() for f in sorted(folder.glob("modeling_*.py"))):
            found.append(model_type)
    return found


def text_config(model_type: str) -> Any:
    """The tiny config of `model_type`'s text model (a multimodal model's `text_config`), built by its config class
    from small sizes (so that what it derives from them, per-layer lists included, follows)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    thinker = getattr(config, "thinker_config", None)  # Qwen3-Omni: the text model is the thinker's
    text = getattr(thinker if thinker is not None else config, "text_config", None)
    config_class = type(text) if text is not None and not isinstance(text, dict) else type(config)
    known = config_class().to_dict()
    sizes = {key: value for key, value in SMALL.items() if key in known and not isinstance(known[key], bool)}
    return config_class(**{**sizes, **OVERRIDES.get(model_type, {})})


def tiny_moe(model_type: str, seed: int = 0) -> nn.Module:
    """The causal LM (or base model) of `model_type`'s text config, tiny, fp32, every weight drawn with std 0.2
    (transformers initialises expert tensors small: every path must count)."""
    config = text_config(model_type)
    model_class = _model_class(config)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.normal_(std=0.2)
    return model.float().eval()


def _model_class(config: Any) -> type[nn.Module]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    kind = config.model_type
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind) or MODEL_MAPPING_NAMES.get(kind)
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    if name is None:  # a text config no auto class maps: the modeling module's class built from it
        candidates = [
            obj for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, nn.Module) and getattr(obj, "config_class", None) is type(config)
        ]  # fmt: skip
        causal = [c for c in candidates if c.__name__.endswith("ForCausalLM")]
        return (causal or sorted(candidates, key=lambda c: c.__name__))[0]
    return getattr(module, name) if hasattr(module, name) else getattr(importlib.import_module("transformers"), name)


def held_expert_share(engine: Any) -> float:
    """The share of the model's expert elements this rank keeps between steps: its 1/ep whole, or at stage 3 with
    ep < W the shards of the experts' units cut over their peers ([Note: experts below 1/ep at stage 3] in
    engine/experts/gather_units.py), 1/W."""
    split = {id(p): p for layer in engine.experts.layers for p in layer.params()}
    whole = sum(math.prod(shape) for shape in engine.experts.shapes.values()) * engine.layout.expert.world_size
    flats = [f for u in engine.units for f in u.flats if all(id(p) in split for p in f.params)]
    in_units = {id(p) for f in flats for p in f.params}
    kept = sum(p.numel() for key, p in split.items() if key not in in_units)  # held whole (else gathered, maybe)
    return (sum(f.plan.shard_numel for f in flats) + kept) / whole
