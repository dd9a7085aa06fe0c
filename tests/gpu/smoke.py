"""The first-GPU-machine smoke test: every check a multi-GPU run must pass, runnable unchanged on CPU/gloo.

Usage (from the repository root; N = the GPUs of the machine, or processes on a CPU):
    accelerate-zero launch --num_processes N tests/gpu/smoke.py [--out results.json]
    PYTHONPATH=. torchrun --nproc_per_node N tests/gpu/smoke.py

Each rank computes on `cuda:LOCAL_RANK` when CUDA is available, else on the CPU; the script never calls
`torch.cuda.set_device` (the engine must bind the device itself). Rank 0 prints one line per check and the script
exits 1 if any failed. Checks (a CUDA-only check is reported as skipped on the CPU):
- every stage 0-3 with gradient accumulation 1 and 2 equals an fp32 one-process reference on the full batch;
- bf16 stays within bf16 rounding of the fp32 reference (fp32 master weights);
- CPU optimizer offload (stages 2, 3), CPU parameter offload and NVMe parameter offload (every shard in a file,
  with the optimizer on the CPU or on NVMe) equal the reference;
- checkpoint resume is bit-identical at the same world size and stage; on CUDA the device memory the save allocates
  beyond what the engine holds is at most one fragment (host copies made piecewise);
- an fp16 overflow on the last rank skips the same step on every rank;
- `offload_states()` leaves at most 1 MiB (or 1%) of the training state's device memory allocated, and training
  after `reload_states()` equals the reference (stages 1 and 3);
- stage 3: the peak of gathered parameter elements does not grow with accumulation, and with a prefetch budget of
  one unit the next unit's gather is issued ahead of its use;
- CUDA, checked first in the fresh process: the engine bound this rank's device (`torch.cuda.current_device() ==
  LOCAL_RANK`); the host syncs per optimizer step (`torch.cuda.set_sync_debug_mode`) stay within a bound;
- the offloaded host step cut into chunks (each chunk's upload beside the next chunk's step) trains bit for bit like
  one step over everything, at stages 2 and 3, and at stage 3 run across the step boundary like the synchronous
  step (tests/gpu/smoke_pipelined.py);
- `from_pretrained` under CPU and NVMe parameter offload, a >= 100M-parameter Llama's memory per phase and time per
  step, and (last) the CUDA contexts this process holds: tests/gpu/smoke_offload.py.
tests/gpu/test_smoke.py runs the same checks on 2 gloo ranks in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import accelerate_zero


REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make tests.helpers importable
    sys.path.insert(0, str(REPO))

from tests.gpu.smoke_offload import (  # noqa: E402
    check_cuda_contexts,
    check_loading,
    check_medium,
    check_refused_pinning,
)
from tests.gpu.smoke_pipelined import check_pipelined_step  # noqa: E402
from tests.helpers.models import make_batches, make_model, train_reference  # noqa: E402


STEPS, PER_RANK = 3, 4
SKIPPED = "skipped"


def _device() -> torch.device:
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference must be fp32
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _config(stage: int, accumulation: int, **extra: Any) -> dict[str, Any]:
    zero = {"stage": stage, **extra.pop("zero", {})}
    if stage == 3:  # shard even this tiny model's tensors
        zero.setdefault("stage3_param_persistence_threshold", 0)
    return {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        **extra,
    }


def _flat(model: torch.nn.Module) -> torch.Tensor:
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def _train(engine: Any, batches: Any, rank: int, world_size: int, steps: range, inject: int | None = None) -> None:
    for step in steps:
        for micro in range(len(batches.inputs[step])):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            out = engine(x.to(engine.device, engine.compute_dtype))  # fp16 casts only with auto_cast
            loss = torch.nn.functional.mse_loss(out.float(), y.to(engine.device))
            if inject == step:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()


def _reference(accumulation: int, world_size: int, device: torch.device, optimizer: str = "adamw") -> torch.Tensor:
    batches = make_batches(STEPS, accumulation, PER_RANK * world_size)
    model = make_model().to(device)
    opt = _optimizer(model, optimizer)
    moved = type(batches)(
        [[x.to(device) for x in step] for step in batches.inputs],
        [[y.to(device) for y in step] for step in batches.targets],
    )
    train_reference(model, opt, moved, clip=1.0)
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":  # Adam's sign-like update turns bf16 noise on tiny gradients into full steps
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _run(config: dict, rank: int, world_size: int, device: torch.device, optimizer: str = "adamw") -> Any:
    accumulation = config["gradient_accumulation_steps"]
    model = make_model()
    engine = accelerate_zero.initialize(model, _optimizer(model, optimizer), config=config, device=device)
    _train(engine, make_batches(STEPS, accumulation, PER_RANK * world_size), rank, world_size, range(STEPS))
    return engine, model


# ------------------------------------------------------------------------------------------------------ checks
def check_stages(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    out = {}
    for accumulation in (1, 2):
        expected = _reference(accumulation, world_size, device)
        for stage in (0, 1, 2, 3):
            _, model = _run(_config(stage, accumulation), rank, world_size, device)
            diff = (_flat(model) - expected).abs().max().item()
            out[f"stage {stage}, accumulation {accumulation}: max |param - fp32 reference|"] = (diff, diff < 1e-5)
    return out


def check_bf16(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    expected = _reference(1, world_size, device, "sgd")
    out = {}
    for stage in (2, 3):
        _, model = _run(_config(stage, 1, bf16={"enabled": True}), rank, world_size, device, "sgd")
        diff = (_flat(model) - expected).abs().max().item()
        out[f"bf16 stage {stage}: max |param - fp32 reference|"] = (diff, diff < 2e-2)
    return out


def check_offload(rank: int, world_size: int, device: torch.device, nvme_dir: str) -> dict[str, Any]:
    expected = _reference(2, world_size, device)
    out = {}
    cases = {
        "cpu optimizer offload, stage 2": (2, {"offload_optimizer": {"device": "cpu"}}),
        "cpu optimizer offload, stage 3": (3, {"offload_optimizer": {"device": "cpu"}}),
        "nvme optimizer + parameter offload, stage 3": (
            3,
            {
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir},
                # max_in_cpu 0: every shard goes to a file (DeepSpeed's default 1e9 would keep this model in memory)
                "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0},
            },
        ),
        "cpu optimizer + nvme parameter offload, stage 3": (
            3,
            {
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0},
            },
        ),
        "cpu optimizer + parameter offload, stage 3": (
            3,
            {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        ),
    }
    for name, (stage, zero) in cases.items():
        engine, model = _run(_config(stage, 2, zero=zero), rank, world_size, device)
        diff = (_flat(model) - expected).abs().max().item()
        out[f"{name}: max |param - fp32 reference|"] = (diff, diff < 1e-5)
        if zero.get("offload_param", {}).get("device") == "nvme":
            swapped, flats = len(engine.shard_store.shards), sum(len(u.flats) for u in engine.units)
            out[f"{name}: shards in files / flat buffers"] = ((swapped, flats), 0 < swapped == flats)
        if device.type == "cuda" and engine.offload.optimizer:
            # [Note: threads for host work]: the offloaded step runs on this rank's share of the cores
            threads = engine.sharded_optimizer.host_threads
            out[f"{name}: host step threads (reported)"] = (threads.threads, True)
        if device.type == "cuda" and "cpu optimizer offload" in name:
            # [Note: pinned memory at its size]: the host masters are page-locked, at their size (no rounding)
            memory = engine.host_memory
            pinned = all(s.master.is_pinned() for s in engine.sharded_optimizer.slices)
            out[f"{name}: host masters page-locked"] = (pinned, pinned)
            out[f"{name}: pinned bytes / requested"] = (
                (memory.pinned_bytes, memory.requested_bytes),
                memory.requested_bytes
                <= memory.pinned_bytes
                <= memory.requested_bytes + 256 * 2**20 * len(memory.chunks),
            )
        engine.destroy()
    return out


def check_resume(rank: int, world_size: int, device: torch.device, folder: str) -> dict[str, Any]:
    out = {}
    batches = make_batches(4, 1, PER_RANK * world_size)
    for stage in (2, 3):
        model = make_model()
        engine = accelerate_zero.initialize(model, _optimizer(model, "adamw"), config=_config(stage, 1), device=device)
        _train(engine, batches, rank, world_size, range(2))
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        engine.save_checkpoint(f"{folder}/stage{stage}")
        if device.type == "cuda":
            extra = torch.cuda.max_memory_allocated(device) - before
            largest = max(p.numel() for p in make_model().parameters()) * 4
            out[f"stage {stage}: device bytes the save allocated (bound: one fragment, {largest})"] = (
                extra,
                extra <= largest + 4096,
            )
        else:
            out[f"stage {stage}: device bytes the save allocated"] = (SKIPPED, True)
        _train(engine, batches, rank, world_size, range(2, 4))
        uninterrupted = _flat(model)
        fresh = make_model(seed=7)
        resumed = accelerate_zero.initialize(
            fresh, _optimizer(fresh, "adamw"), config=_config(stage, 1), device=device
        )
        resumed.load_checkpoint(f"{folder}/stage{stage}")
        _train(resumed, batches, rank, world_size, range(2, 4))
        same = torch.equal(_flat(fresh), uninterrupted)
        out[f"stage {stage}: resume bit-identical"] = (same, same)
    return out


def check_fp16_overflow(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    model = make_model()
    engine = accelerate_zero.initialize(
        model, _optimizer(model, "adamw"), config=_config(2, 1, fp16=fp16), device=device
    )
    batches = make_batches(STEPS, 1, PER_RANK * world_size)
    # the overflow happens on the last rank only: every rank must skip that step
    _train(engine, batches, rank, world_size, range(STEPS), inject=1 if rank == world_size - 1 else None)
    return {
        "fp16 overflow on the last rank: skipped steps on this rank": (engine.skipped_steps, engine.skipped_steps == 1)
    }


def check_stage3_schedule(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    peaks = {}
    engine = None
    unit = max(p.numel() for p in make_model().parameters())
    for accumulation in (1, 2):
        zero = {"stage3_prefetch_bucket_size": unit, "stage3_max_live_parameters": 4 * unit}
        engine, _ = _run(_config(3, accumulation, zero=zero), rank, world_size, device)
        peaks[accumulation] = engine.scheduler.peak_live_numel
    assert engine is not None
    return {
        "stage 3 peak gathered elements, accumulation 1 and 2": (peaks, peaks[1] == peaks[2]),
        "stage 3 gathers issued ahead (prefetched)": (
            engine.scheduler.gathers_prefetched,
            engine.scheduler.gathers_prefetched > 0,
        ),
    }


def check_sleep(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """`offload_states()` between steps leaves (almost) nothing on the device; after `reload_states()` training
    equals the reference ([Note: sleeping moves storages, not tensors] in accelerate_zero/engine/sleep.py)."""
    expected = _reference(1, world_size, device)
    batches = make_batches(STEPS, 1, PER_RANK * world_size)
    out: dict[str, Any] = {}
    for stage in (1, 3):
        model = make_model()
        engine = accelerate_zero.initialize(model, _optimizer(model, "adamw"), config=_config(stage, 1), device=device)
        _train(engine, batches, rank, world_size, range(1))
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        engine.offload_states()
        name = f"stage {stage}: device bytes allocated asleep (awake: {held})"
        if device.type == "cuda":
            left = torch.cuda.memory_allocated(device)
            out[name] = (left, left <= max(1 << 20, held // 100))
        else:
            out[name] = (SKIPPED, True)
        engine.reload_states()
        _train(engine, batches, rank, world_size, range(1, STEPS))
        diff = (_flat(model) - expected).abs().max().item()
        out[f"stage {stage}: slept a step, max |param - fp32 reference|"] = (diff, diff < 1e-5)
    return out


def check_cuda_binding(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {
            "device bound without set_device in the script": (SKIPPED, True),
            "host syncs per step": (SKIPPED, True),
        }
    model = make_model()
    # device=None: the engine picks and binds cuda:LOCAL_RANK itself
    engine = accelerate_zero.initialize(model, _optimizer(model, "adamw"), config=_config(3, 1))
    bound = torch.cuda.current_device() == int(os.environ.get("LOCAL_RANK", "0"))
    batches = make_batches(STEPS, 1, PER_RANK * world_size)
    # The batches go to the device first: only the engine's own syncs are counted.
    batches = type(batches)(
        [[x.to(engine.device) for x in step] for step in batches.inputs],
        [[y.to(engine.device) for y in step] for step in batches.targets],
    )
    _train(engine, batches, rank, world_size, range(1))  # warm-up
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(engine, batches, rank, world_size, range(1, STEPS))
    torch.cuda.set_sync_debug_mode("default")
    syncs = len(caught) / (STEPS - 1)
    where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in caught})
    engine.destroy()
    # The step reads the gradient norm (clipping, the overflow check); with several ranks every rank's micro-step
    # counter comes beside it, and each backward reads the ranks' positions ([Note: ranks out of step]).
    allowed = 1 if world_size == 1 else 3
    return {
        "device bound without set_device in the script": (
            str(engine.device),
            bound and engine.device.index == torch.cuda.current_device(),
        ),
        f"host syncs per step (bound {allowed}), at {where}": (syncs, syncs <= allowed),
    }


CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "cuda_binding": check_cuda_binding,  # first: nothing else may have bound the device yet
    "stages": check_stages,
    "bf16": check_bf16,
    "offload": check_offload,
    "pipelined_step": check_pipelined_step,
    "resume": check_resume,
    "fp16_overflow": check_fp16_overflow,
    "stage3_schedule": check_stage3_schedule,
    "sleep": check_sleep,
    "refused_pinning": check_refused_pinning,
    "loading": check_loading,
    "medium": check_medium,
    "cuda_contexts": check_cuda_contexts,  # last: every thread the other checks started has run
}
FOLDER_CHECKS = {"offload": "nvme", "resume": "checkpoints", "loading": "loading", "medium": "medium"}


def run_all(rank: int, world_size: int, folder: str) -> dict[str, tuple[Any, bool]]:
    """Every check on this rank; `folder` is shared by the ranks (checkpoints, NVMe swap files under rank folders)."""
    device = _device()
    results: dict[str, tuple[Any, bool]] = {}
    for name, check in CHECKS.items():
        if name in FOLDER_CHECKS:
            results.update(check(rank, world_size, device, f"{folder}/{FOLDER_CHECKS[name]}"))
        else:
            results.update(check(rank, world_size, device))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write rank 0's results as JSON")
    parser.add_argument("--workdir", type=Path, default=None, help="shared folder (default: a temporary one)")
    args = parser.parse_args()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # One folder for every rank of the run (checkpoints are read back by all ranks): on several machines pass
    # --workdir on a shared filesystem.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "local")
    folder = str(args.workdir or Path(tempfile.gettempdir()) / f"accelerate_zero_smoke_{run_id}")
    results = run_all(rank, world_size, folder)
    failed = [name for name, (_, ok) in results.items() if not ok]
    if rank == 0:
        print(f"accelerate_zero GPU smoke test: {world_size} ranks on {_device().type}")
        for name, (value, ok) in results.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}: {value}")
        if args.out is not None:
            args.out.write_text(json.dumps({k: [str(v), ok] for k, (v, ok) in results.items()}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
