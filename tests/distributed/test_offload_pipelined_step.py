"""[Note: the pipelined host step]: the offloaded optimizer step, cut into chunks whose uploads overlap the next
chunk's host step, trains bit for bit like one step over every slice (today's synchronous schedule), at an odd world
size, with clipping active, bf16, gradient accumulation and two param groups, at stages 1-3 (3 also with parameter
offload), in host memory and on NVMe (whose sub-groups follow `sub_group_size` the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model, param_groups


STEPS, ACCUMULATION, PER_RANK_BATCH = 3, 3, 2
ONE_CHUNK, SMALL_CHUNKS = 1_000_000_000, 40


def _config(stage: int, device: str, sub_group_size: int, nvme: str) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": device}
    if device == "nvme":
        offload["nvme_path"] = nvme
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": offload, "sub_group_size": sub_group_size}
    zero["reduce_bucket_size"] = 64
    if stage == 3 and device == "cpu+param":
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    return {
        "bf16": {"enabled": True},
        "gradient_clipping": 0.05,  # below the gradients' norm: every step clips
        "train_micro_batch_size_per_gpu": PER_RANK_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": zero,
    }


def _train(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    import accelerate_zero

    batches = make_batches(STEPS, ACCUMULATION, PER_RANK_BATCH * world_size)
    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model, lr=1e-2, decay=0.1))
    engine = accelerate_zero.initialize(model, optimizer, config=config, unit_classes=[nn.Linear])
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            engine.backward(nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    runner = engine.sharded_optimizer.step_runner
    chunks = len(getattr(runner, "chunks", None) or getattr(runner, "subgroups", []))
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).clone()
    state = [v.clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    engine.destroy()
    return {"weights": weights, "norms": norms, "chunks": chunks, "state": state}


def _matrix(rank: int, world_size: int, nvme_root: str) -> dict[str, Any]:
    out = {}
    cases = [(1, "cpu"), (2, "cpu"), (3, "cpu"), (3, "cpu+param"), (2, "nvme"), (3, "nvme")]
    for stage, device in cases:
        runs = {}
        for sub_group_size in (ONE_CHUNK, SMALL_CHUNKS):
            nvme = str(Path(nvme_root) / f"s{stage}-{sub_group_size}")
            runs[sub_group_size] = _train(rank, world_size, _config(stage, device, sub_group_size, nvme))
        out[f"stage{stage}-{device}"] = runs
    return out


def test_chunked_host_step_is_bit_identical_to_one_step(tmp_path: Path) -> None:
    for result in run_distributed(_matrix, 3, str(tmp_path), timeout=300):
        for key, runs in result.items():
            whole, chunked = runs[ONE_CHUNK], runs[SMALL_CHUNKS]
            assert whole["chunks"] == 1 and chunked["chunks"] > 2, (key, whole["chunks"], chunked["chunks"])
            assert all(norm > 0.05 for norm in whole["norms"]), (key, whole["norms"])  # clipping was active
            assert torch.equal(whole["weights"], chunked["weights"]), key
            assert whole["norms"] == chunked["norms"], key
            if "nvme" not in key:  # under NVMe the state lives in files between steps
                assert len(whole["state"]) == len(chunked["state"]) > 0, key
                assert all(torch.equal(a, b) for a, b in zip(whole["state"], chunked["state"], strict=True)), key
