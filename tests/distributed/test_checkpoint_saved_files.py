"""Saved folders hold what `model.save_pretrained` writes for the same model: the same keys (one tensor for a tied
embedding, no non-persistent rotary buffers), and `consolidate` keeps the user's own config files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as handle:
        return set(handle.keys())


def _save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import accelerate_zero

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    if rank == 0:
        model.save_pretrained(f"{root}/reference")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = accelerate_zero.initialize(model, optimizer, config={"zero_optimization": {"stage": 2}})
    engine.save_16bit_model(f"{root}/16bit")
    engine.save_checkpoint(f"{root}/engine", tag="last")
    return {}


def test_saved_files_match_save_pretrained(tmp_path: Path) -> None:
    from accelerate_zero.checkpoint.consolidate import consolidate

    run_distributed(_save, 2, str(tmp_path))
    reference = _keys(tmp_path / "reference" / "model.safetensors")
    assert "lm_head.weight" not in reference  # tied: transformers writes the embedding only
    assert _keys(tmp_path / "16bit" / "model.safetensors") == reference

    # Without config.json next to the checkpoint: the same keys (no rotary inv_freq buffers).
    bare = consolidate(tmp_path / "engine", tmp_path / "bare")
    assert _keys(bare / "model.safetensors") == reference

    # With the user's config and generation config: consolidate keeps their files as they were.
    checkpoint = tmp_path / "engine"
    for name in ("config.json", "generation_config.json"):
        (checkpoint / name).write_text((tmp_path / "reference" / name).read_text())
    user_generation = json.loads((checkpoint / "generation_config.json").read_text())
    user_generation["temperature"] = 0.3
    (checkpoint / "generation_config.json").write_text(json.dumps(user_generation))
    out = consolidate(checkpoint, tmp_path / "out")
    assert _keys(out / "model.safetensors") == reference
    assert json.loads((out / "generation_config.json").read_text()) == user_generation
    assert (out / "config.json").read_text() == (checkpoint / "config.json").read_text()
