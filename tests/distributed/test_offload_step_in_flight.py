"""[Note: the host step across the step boundary]: at stage 3 the offloaded host step runs on a worker thread while
the next forward runs, and trains bit for bit like the synchronous step, at an odd world size, with clipping
active, bf16, gradient accumulation, two param groups and an LR scheduler stepping right after `engine.step()`,
with the optimizer in host memory (parameters on the device or in host memory) and on NVMe; a checkpoint saved
right after a step and an eval forward right after a step see the stepped values. Every optimizer step sleeps a
little (a step pre-hook), so a read that did not wait for its slices would see the values before the step. At stage 2
(parameters read directly) the step stays synchronous even when asked to overlap."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accelerate_zero.engine.step_in_flight import OVERLAP_ENV
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model, param_groups


STEPS, ACCUMULATION, PER_RANK_BATCH, CHUNK = 3, 3, 2, 40


def _config(device: str, nvme: str) -> dict[str, Any]:
    stage = 2 if device.startswith("stage2") else 3
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "sub_group_size": CHUNK}
    zero["reduce_bucket_size"] = 64
    # the last Linear (48 elements) and the LayerNorm stay gathered: stepped before the step returns, the rest after
    zero["stage3_param_persistence_threshold"] = 50
    if device == "cpu+param":
        zero["offload_param"] = {"device": "cpu"}
    if device == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    return {
        "bf16": {"enabled": True},
        "gradient_clipping": 0.05,  # below the gradients' norm: every step clips
        "train_micro_batch_size_per_gpu": PER_RANK_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": zero,
    }


def _weights(model: nn.Module) -> torch.Tensor:
    import accelerate_zero

    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).clone()


def _train(rank: int, world_size: int, config: dict[str, Any], folder: str) -> dict[str, Any]:
    import accelerate_zero

    batches = make_batches(STEPS, ACCUMULATION, PER_RANK_BATCH * world_size)
    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model, lr=1e-2, decay=0.1))
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.002))  # a slow host: the next forward outruns it
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    engine = accelerate_zero.initialize(
        model, optimizer, config=config, lr_scheduler=scheduler, unit_classes=[nn.Linear]
    )
    norms, evals, ahead = [], [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            engine.backward(nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
        ahead.append(sum(unit.state.value != "sharded" for unit in engine.units))  # gathered across the boundary
        if step == 0:
            engine.save_checkpoint(folder, tag="after_step")  # right after the step, the host step maybe running
        else:
            model.eval()
            with torch.no_grad():
                evals.append(engine(batches.rank_slice(0, 0, rank, world_size)[0].to(torch.bfloat16)).float())
            model.train()
    flight = engine.sharded_optimizer.in_flight
    waits = flight.waits if flight is not None else -1
    weights = _weights(model)
    engine.zero_grad()  # settles the step: the optimizer's state is read directly below
    slices = engine.sharded_optimizer.slices  # the worker made the state in its own order
    state = [v.clone() for s in slices for v in optimizer.state[s.master].values() if torch.is_tensor(v)]
    engine.load_checkpoint(folder, tag="after_step")
    saved = _weights(model)
    engine.destroy()
    return {
        "weights": weights,
        "norms": norms,
        "evals": evals,
        "state": state,
        "saved": saved,
        "waits": waits,
        "ahead": ahead,
    }


def _matrix(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out = {}
    for device in ("cpu", "cpu+param", "nvme", "stage2-cpu"):
        runs = {}
        for overlap in ("0", "1"):
            os.environ[OVERLAP_ENV] = overlap  # pytest's environment comes back for the next test body
            folder = str(Path(root) / f"{device}-{overlap}")
            runs[overlap] = _train(rank, world_size, _config(device, folder + "-nvme"), folder)
        out[device] = runs
    return out


def test_host_step_across_the_boundary_is_bit_identical(tmp_path: Path) -> None:
    for result in run_distributed(_matrix, 3, str(tmp_path), timeout=300):
        for key, runs in result.items():
            sync, overlapped = runs["0"], runs["1"]
            assert sync["waits"] == -1, key  # synchronous: no worker made
            if key == "stage2-cpu":  # parameters are read directly at stage 2: the step stays synchronous
                assert overlapped["waits"] == -1, key
            else:
                assert overlapped["waits"] > 0, (key, overlapped["waits"])  # a forward ran while the step did
                assert all(overlapped["ahead"][1:]), (key, overlapped["ahead"])  # gathered ahead
            assert sync["ahead"] == [0] * 3, (key, sync["ahead"])
            assert all(norm > 0.05 for norm in sync["norms"]), (key, sync["norms"])  # clipping was active
            assert sync["norms"] == overlapped["norms"], key
            assert torch.equal(sync["weights"], overlapped["weights"]), key
            assert torch.equal(sync["saved"], overlapped["saved"]), key
            assert not torch.equal(sync["saved"], sync["weights"]), key  # the checkpoint is of step 1, not the end
            assert all(torch.equal(a, b) for a, b in zip(sync["evals"], overlapped["evals"], strict=True)), key
            if key != "nvme":  # under NVMe the state lives in files between steps
                assert len(sync["state"]) == len(overlapped["state"]) > 0, key
                assert all(torch.equal(a, b) for a, b in zip(sync["state"], overlapped["state"], strict=True)), key
