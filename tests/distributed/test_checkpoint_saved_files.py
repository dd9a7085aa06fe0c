"""Saved folders hold what `model.save_pretrained` writes for the same model: the same keys (one tensor for a tied
embedding, no non-persistent rotary buffers), and `consolidate` keeps the user's own config files."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
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
    for _ in range(2):  # trained weights, so the masters are not the initial values
        tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    engine.save_checkpoint(f"{root}/engine", tag="last")
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}} if rank == 0 else {}


def _zero_to_fp32(folder: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own zero_to_fp32 reading `folder` (in a rank: it imports deepspeed, which the suite keeps out of
    pytest's process)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(folder))


def _read_by_deepspeed(rank: int, world_size: int, folder: str) -> dict[str, torch.Tensor]:
    return _zero_to_fp32(folder)


def test_deepspeed_zero_to_fp32_reads_our_checkpoint(tmp_path: Path) -> None:
    """DeepSpeed out (issue 49): `accelerate-zero consolidate CKPT OUT --format deepspeed` writes a folder
    DeepSpeed's zero_to_fp32 turns into the trained weights, bit for bit."""
    from accelerate_zero.cli.main import main

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed (the test extra)")
    weights = run_distributed(_save, 2, str(tmp_path))[0]["weights"]
    assert main(["consolidate", str(tmp_path / "engine"), str(tmp_path / "ds"), "--format", "deepspeed"]) == 0
    assert (tmp_path / "ds" / "latest").read_text() == "global_step2"
    read = run_distributed(_read_by_deepspeed, 1, str(tmp_path / "ds"))[0]
    assert set(read) >= set(weights) - {"lm_head.weight"}  # tied: one entry, as save_pretrained writes
    worst = max((read[name] - weights[name]).abs().max().item() for name in weights if name in read)
    assert worst == 0.0, worst
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    initial = dict(LlamaForCausalLM(tiny_llama_config()).named_parameters())
    assert max((weights[n] - initial[n]).abs().max().item() for n in weights) > 1e-4  # trained, not the start


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
