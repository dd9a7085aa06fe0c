"""The smoke test's check of [Note: the pipelined host step] (accelerate_zero/offload/pipelined_step.py) on the
machine's own copies: on CUDA each chunk's upload is an asynchronous copy from pinned memory that runs while the next
chunk steps, so a chunk whose masters were written before its copy finished, or a copy read before it landed, would
show here as a difference from the one-chunk step. Stages 2 and 3 (3 also with parameter offload), bf16, clipping,
gradient accumulation 2: the chunked step must train bit for bit like one step over everything."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.models import tiny_llama_config


CHUNKS = {"one chunk": 1_000_000_000, "chunks of 64": 64}


def _train(rank: int, world_size: int, device: torch.device, zero: dict[str, Any]) -> tuple[torch.Tensor, int]:
    from transformers import LlamaForCausalLM

    import accelerate_zero

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    config = {
        "bf16": {"enabled": True},
        "gradient_clipping": 0.05,  # below the gradients' norm: every step clips
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"reduce_bucket_size": 500, **zero},
    }
    if zero["stage"] == 3:  # shard even this tiny model's tensors
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3 * 2):
        tokens = torch.randint(0, 64, (2, 12), generator=generator).to(device)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    chunks = len(getattr(engine.sharded_optimizer.step_runner, "chunks", []))
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        weights = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    engine.destroy()
    return weights, chunks


def check_pipelined_step(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {
        "stage 2, offload_optimizer": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "stage 3, offload_optimizer": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "stage 3, offload_optimizer + offload_param": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    }
    for name, zero in cases.items():
        runs = {
            label: _train(rank, world_size, device, {**zero, "sub_group_size": size}) for label, size in CHUNKS.items()
        }
        (whole, one), (chunked, many) = runs["one chunk"], runs["chunks of 64"]
        out[f"pipelined host step, {name}: chunks, max |difference| to one chunk"] = (
            (many, float((whole - chunked).abs().max())),
            one == 1 and many > 2 and torch.equal(whole, chunked),
        )
    return out
