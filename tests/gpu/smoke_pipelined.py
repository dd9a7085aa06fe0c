"""The smoke test's check of [Note: the pipelined host step] (accelerate_zero/offload/pipelined_step.py) on the
machine's own copies: on CUDA each chunk's upload is an asynchronous copy from pinned memory that runs while the next
chunk steps, so a chunk whose masters were written before its copy finished, or a copy read before it landed, would
show here as a difference from the one-chunk step. Stages 2 and 3 (3 also with parameter offload), bf16, clipping,
gradient accumulation 2: the chunked step must train bit for bit like one step over everything. At stage 3 the host
step run across the step boundary (engine/step_in_flight.py; its uploads on a stream of their own on CUDA, each
gather waiting for its unit's event) must train bit for bit like the synchronous one."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.helpers.models import tiny_llama_config


CHUNKS = {"one chunk": 1_000_000_000, "chunks of 64": 64}


def _train(
    rank: int, world_size: int, device: torch.device, zero: dict[str, Any], overlap: str | None = None
) -> tuple[torch.Tensor, int, int]:
    """`overlap`: ACCELERATE_ZERO_OVERLAP_STEP for this run (None: the default, on beside a GPU at stage 3)."""

    from accelerate_zero.engine.step_in_flight import OVERLAP_ENV

    previous = os.environ.pop(OVERLAP_ENV, None)
    if overlap is not None:
        os.environ[OVERLAP_ENV] = overlap
    try:
        return _train_with(rank, device, zero)
    finally:
        os.environ.pop(OVERLAP_ENV, None)
        if previous is not None:
            os.environ[OVERLAP_ENV] = previous


def _train_with(rank: int, device: torch.device, zero: dict[str, Any]) -> tuple[torch.Tensor, int, int]:
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
    flight = engine.sharded_optimizer.in_flight
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        weights = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    engine.destroy()
    return weights, chunks, flight.launches if flight is not None else 0


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
        (whole, one, _), (chunked, many, _) = runs["one chunk"], runs["chunks of 64"]
        out[f"pipelined host step, {name}: chunks, max |difference| to one chunk"] = (
            (many, float((whole - chunked).abs().max())),
            one == 1 and many > 2 and torch.equal(whole, chunked),
        )
        if zero["stage"] == 3:  # [Note: the host step across the step boundary], on this machine's streams
            chunked_zero = {**zero, "sub_group_size": CHUNKS["chunks of 64"]}
            synchronous, _, none = _train(rank, world_size, device, chunked_zero, overlap="0")
            overlapped, _, launches = _train(rank, world_size, device, chunked_zero, overlap="1")
            out[f"host step across the boundary, {name}: steps overlapped, max |difference| to synchronous"] = (
                (launches, float((synchronous - overlapped).abs().max())),
                none == 0 and launches == 3 and torch.equal(synchronous, overlapped),
            )
    return out
