"""The parallel Hugging Face export ([Note: parallel Hugging Face export] in accelerate_zero/checkpoint/hf_export.py).

A tiny Llama (tied embeddings) at stage 3 on 2 ranks, trained one step, is exported with files of at most 8 KB: each
rank writes the files i % 2 == rank, rank 0 the index; `from_pretrained` loads the folder to exactly the weights the
rank-0 path (`full_state_dict`) gathers, and the index lists every key once (no tied alias).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config


def _export(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import accelerate_zero
    from accelerate_zero.checkpoint.hf_export import save_pretrained_parallel

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10}
    engine = accelerate_zero.initialize(model, optimizer, config={"zero_optimization": zero})
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    written = save_pretrained_parallel(engine, folder, max_shard_bytes=8000, dtype=torch.float32)
    reference = engine.full_state_dict(dtype=torch.float32)
    if rank == 0:
        model.config.save_pretrained(folder)
    return {"written": written, "reference": reference}


def test_every_rank_writes_its_files_and_from_pretrained_loads_them(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    results = run_distributed(_export, 2, str(tmp_path))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    for rank, result in enumerate(results):
        assert sorted(result["written"]) == [name for i, name in enumerate(files) if i % 2 == rank], rank
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: written once
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).state_dict()
    reference = results[0]["reference"]
    assert set(loaded) == set(reference)
    for key, value in reference.items():
        assert torch.equal(loaded[key], value), key
