"""What each rank runs for tests/integration/test_zero_accelerator.py (one spawned group runs every check).

The ranks get a torchrun-style environment only (RANK, WORLD_SIZE, MASTER_*; no ACCELERATE_* variable), so every
`ZeroAccelerator` here also checks that it forms the gloo group itself. Results are tensors and plain values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.dist import plain_torchrun_environment
from tests.helpers.models import tiny_llama_config


STEPS, GRAD_ACCUM, MICRO, SEQ, VOCAB = 3, 2, 2, 10, 61
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """Uneven shapes (vocab 61, intermediate 45), so shards and buckets never divide evenly."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, intermediate_size=45))


def tokens(world_size: int) -> torch.Tensor:
    """Every micro-batch of every rank: (STEPS * GRAD_ACCUM * world_size * MICRO, SEQ)."""
    return torch.randint(
        0, VOCAB, (STEPS * GRAD_ACCUM * world_size * MICRO, SEQ), generator=torch.Generator().manual_seed(3)
    )


def reference(world_size: int) -> tuple[torch.nn.Module, list[float]]:
    """One process on the full batch: what the ranks' training must match (SGD, fp32, clipping at 1.0).

    accelerate's dataloader gives rank r the batches r, r + W, ...: micro-step j of the group covers the rows
    [j * W * MICRO, (j + 1) * W * MICRO) of `tokens`.
    """
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, norms, rows = tokens(world_size), [], world_size * MICRO
    for step in range(STEPS):
        for micro in range(GRAD_ACCUM):
            batch = data[(step * GRAD_ACCUM + micro) * rows :][:rows]
            (model(input_ids=batch, labels=batch).loss / GRAD_ACCUM).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    return model, norms


def run_part(rank: int, world_size: int, folder: str, part: str) -> Any:
    """Runs one check (stage1..3, resume, save_model, bf16) on this rank; each is its own body on the shared ranks."""
    plain_torchrun_environment()
    if part.startswith("stage"):
        return _parity(rank, world_size, int(part.removeprefix("stage")))
    if part == "resume":
        return _resume(rank, world_size, Path(folder))
    if part == "save_model":
        return _save_model(rank, world_size, Path(folder) / "model")
    if part == "bf16":
        return _bf16(world_size)
    raise ValueError(f"{part=} is not stage1, stage2, stage3, resume, save_model or bf16")


def zero_config(stage: int, **zero: Any) -> dict[str, Any]:
    """A DeepSpeed config whose batch sizes and bucket sizes are "auto" (filled by prepare; the persistence
    threshold 10 * hidden_size = 320 makes stage 3 shard every matrix of the tiny Llama)."""
    autos = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage, **dict.fromkeys(autos, "auto"), **zero},
    }


def _accelerator(**plugin: Any) -> Any:
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    return ZeroAccelerator(ZeroPlugin(**plugin), gradient_accumulation_steps=GRAD_ACCUM)


def _loader(world_size: int) -> DataLoader:
    return DataLoader(TensorDataset(tokens(world_size)), batch_size=MICRO)


def _parity(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """Training with `accumulate()` + one frozen reference model prepared in the same call (stage 3: sharded)."""
    from accelerate.utils import DistributedType

    accelerator = _accelerator(config=zero_config(stage), zero3_save_16bit_model=True)
    model, frozen = tiny_llama(), tiny_llama(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepared, wrapper, loader, frozen_prepared = accelerator.prepare(model, optimizer, _loader(world_size), frozen)
    engine, frozen_engine = accelerator.zero_engines
    timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    norms, norms_match = [], True
    for (batch,) in loader:
        with accelerator.accumulate(prepared):
            loss = prepared(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(prepared.parameters(), 1.0).item())
                unclipped = accelerator.clip_grad_norm_(prepared.parameters(), float("inf"))  # the Trainer's read
                norms_match = norms_match and unclipped.item() == norms[-1]
            wrapper.step()
            wrapper.zero_grad()
    with torch.no_grad():
        frozen_logits = frozen_prepared(input_ids=PROBE).logits
    state = accelerator.get_state_dict(prepared)
    out = {
        "setup": {
            "distributed_type": accelerator.distributed_type == DistributedType.MULTI_CPU,
            "num_processes": accelerator.num_processes,
            "engine_world_size": engine.dp.world_size,
            "timeout_s": timeout.total_seconds(),
            "same_objects": prepared is model and frozen_prepared is frozen,
            "unwrap": accelerator.unwrap_model(prepared) is model,
            "wrapper": type(wrapper).__name__,
            "config": [
                accelerator.zero_config.train_batch_size,
                accelerator.zero_config.gradient_accumulation_steps,
                accelerator.zero_config.zero_optimization.reduce_bucket_size,
            ],
        },
        "norms": norms,
        "norms_match": norms_match,
        "engine_steps": engine.global_steps,
        "state": state,
        "frozen_logits": frozen_logits,
        "frozen_memory": frozen_engine.memory_breakdown(),
        "frozen_trainable": sum(p.requires_grad for p in frozen.parameters()),
        "frozen_stage": frozen_engine.stage,
    }
    accelerator.free_memory()
    return out


def _resume(rank: int, world_size: int, folder: Path) -> dict[str, Any]:
    """fp16 (from ACCELERATE_MIXED_PRECISION) at stage 3, AdamW + LambdaLR: run 8 micro-steps saving after 4, then
    a new accelerator loads the state and runs the last 4; both must end bit-identical. The same with
    `save_state(..., async_save=True)` (the load waits for the writers)."""
    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
    try:
        first = _resume_run(rank, world_size, folder / "state", save=True)
        second = _resume_run(rank, world_size, folder / "state", save=False)
        first_async = _resume_run(rank, world_size, folder / "state_async", save=True, async_save=True)
        second_async = _resume_run(rank, world_size, folder / "state_async", save=False)
    finally:
        del os.environ["ACCELERATE_MIXED_PRECISION"]
    return {"first": first, "second": second, "first_async": first_async, "second_async": second_async}


def _resume_run(rank: int, world_size: int, folder: Path, save: bool, async_save: bool = False) -> dict[str, Any]:
    from accelerate_zero import GatheredParameters

    config = zero_config(3)
    config["fp16"] = {"enabled": "auto", "initial_scale_power": 20, "hysteresis": 1, "loss_scale_window": 2}
    accelerator = _accelerator(config=config)
    model = tiny_llama(seed=0 if save else 7)  # the second run's weights come from the checkpoint
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    model, optimizer, _, scheduler = accelerator.prepare(model, optimizer, _loader(world_size), scheduler)
    data = torch.randint(0, VOCAB, (8 * world_size * MICRO, SEQ), generator=torch.Generator().manual_seed(5))
    batches = [data[(j * world_size + rank) * MICRO :][:MICRO] for j in range(8)]
    out: dict[str, Any] = {"fp16": next(model.parameters()).dtype == torch.float16}
    if save:
        try:
            accelerator.get_state_dict(model)
        except ValueError as error:
            out["error"] = str(error)
        _run(accelerator, model, optimizer, scheduler, batches[:4])
        out["skipped_at_save"] = accelerator.zero_engines[0].skipped_steps
        accelerator.save_state(str(folder), **({"async_save": True} if async_save else {}))
        out["files"] = sorted(p.name for p in folder.iterdir())
    else:
        accelerator.load_state(str(folder))
    out["rng"] = torch.rand(3)
    _run(accelerator, model, optimizer, scheduler, batches[4:])
    engine = accelerator.zero_engines[0]
    with GatheredParameters(list(model.parameters())):
        out["params"] = [p.detach().clone() for p in model.parameters()]
    out["masters"] = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
    out["adam"] = [v.clone() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    out.update(loss_scale=engine.loss_scale, skipped=engine.skipped_steps, steps=engine.global_steps)
    out.update(lr=scheduler.get_last_lr()[0], accelerator_step=accelerator.step)
    accelerator.free_memory()
    return out


def _run(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def _save_model(rank: int, world_size: int, folder: Path) -> dict[str, Any]:
    """Stage 3 with the 16-bit flag: accelerate's own save_model (sharded, with an index) -> from_pretrained."""
    from transformers import LlamaForCausalLM

    accelerator = _accelerator(config=zero_config(3, stage3_gather_16bit_weights_on_model_save=True))
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(world_size))
    (batch,) = next(iter(loader))
    accelerator.backward(model(input_ids=batch, labels=batch).loss)
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    accelerator.save_model(model, str(folder), max_shard_size="40KB")
    state = accelerator.get_state_dict(model)  # every rank calls it: stage 3 gathers
    out: dict[str, Any] = {"main_only": {t.device.type for t in state.values()} == {"cpu" if rank == 0 else "meta"}}
    if rank == 0:
        model.config.save_pretrained(folder)
        out["files"] = sorted(p.name for p in folder.iterdir())
        with torch.no_grad():
            loaded = LlamaForCausalLM.from_pretrained(folder)(input_ids=PROBE).logits
        out["max_diff"] = (loaded - logits).abs().max().item()
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return out


def _bf16(world_size: int) -> dict[str, Any]:
    """mixed_precision="bf16": bf16 weights, fp32 masters, and accelerate neither autocasts nor scales."""
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    accelerator = ZeroAccelerator(ZeroPlugin(zero_stage=2), mixed_precision="bf16")
    model = tiny_llama()
    seen: dict[str, Any] = {}

    def record(module: torch.nn.Module, args: tuple, output: Any) -> None:
        seen.update(autocast=torch.is_autocast_enabled("cpu"), dtype=output.logits.dtype)

    model.register_forward_hook(record)
    loader = accelerator.prepare(_loader(world_size))  # the micro-batch size comes from an earlier prepare call
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    (batch,) = next(iter(loader))
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    out = {
        "accelerate_mixed_precision": accelerator.mixed_precision,
        "native_amp": accelerator.native_amp,
        "scaler": accelerator.scaler is None,
        "bf16_enabled": accelerator.zero_config.bf16.enabled,
        "micro_batch": accelerator.zero_config.train_micro_batch_size_per_gpu,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "master_dtypes": sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]}),
        "loss_finite": bool(torch.isfinite(loss)),
        **seen,
    }
    accelerator.free_memory()
    return out
