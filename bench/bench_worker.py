"""One benchmark run of one system on every rank; started by engine_bench.py under torchrun (never alone).

Usage (what engine_bench.py runs):
    torchrun --standalone --nproc_per_node 4 bench/bench_worker.py --system az2 --steps 20 --warmup 3 --out r.json
    torchrun --standalone --nproc_per_node 4 bench/bench_worker.py --system az3 --grad_accum 4 --steps 3 --out r.json

Systems: ddp, ddp_bucket_view, ddp_zero_r, fsdp2 (torch) and az0, az1, az2, az3 (accelerate_zero stages 0-3;
stage3_bench.py runs az3 and fsdp2). The process group is created here, before the baseline reading, so every
system's baseline holds the same things.
`--grad_accum N` makes each optimizer step N micro-steps, each its own forward and backward on the fixed batch
(see `MicroProbe` for how each system accumulates and what is read between micro-steps). `--load_dir DIR --system load_az3|load_hf` measures instead the peak RSS
of loading a saved LlamaForCausalLM (partitioned by accelerate_zero.from_pretrained, or whole by transformers).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    LR,
    ByteCounter,
    Measurement,
    build_model,
    finish,
    live_tensor_bytes,
    make_batch,
    proc_status,
    run_steps,
    start_measurement,
)
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


TORCH_SYSTEMS = ("ddp", "ddp_bucket_view", "ddp_zero_r", "fsdp2")
ENGINE_SYSTEMS = ("az0", "az1", "az2", "az3")
LOAD_SYSTEMS = ("load_az3", "load_hf")

# Set to "1" by stage3_bench.py --arena_whole: the engine's gradient arenas count whole from their allocation.
ARENA_WHOLE_ENV = "AZ_BENCH_ARENA_WHOLE"

# Stage 3 as stage3_bench.py measures it: every Linear is its own gather unit, released right after use.
STAGE3_KEYS: dict[str, Any] = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 2100000,
    "stage3_max_live_parameters": 4200000,
}


def engine_config(stage: int, reduce_bucket_size: int | None, grad_accum: int = 1) -> dict[str, Any]:
    """The config every ZeRO system gets (DeepSpeed's too): defaults except clipping off."""
    zero: dict[str, Any] = {"stage": stage, **(STAGE3_KEYS if stage == 3 else {})}
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": zero,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    if grad_accum != 1:
        config["gradient_accumulation_steps"] = grad_accum
    return config


@dataclass
class MicroProbe:
    """Readings taken right after every micro-step's backward, while the accumulated gradients are alive.

    How each system accumulates (what its users do): DDP and ZeRO-R run the non-boundary micro-steps under
    `no_sync()` (local accumulation into the full-size `.grad`, one all-reduce on the boundary); FSDP2 runs the
    default path, backward on every micro-step with no `set_requires_gradient_sync(False)`, so it reduce-scatters
    every micro-step and accumulates sharded gradients (its unsharded-gradient alternative trades memory for bytes);
    accelerate_zero sets `gradient_accumulation_steps` and calls `engine.backward` / `engine.step` every micro-step.
    The peak *during* the micro-steps is VmHWM at the end of the run (bench_common); these are the readings
    *between* them: VmRSS after each backward (before the optimizer step on the boundary), and for the engine
    `memory_breakdown()["gradients"]` and how many stage-3 units are still gathered.
    """

    baseline_rss: int
    engine: Any = None
    rss_between: list[int] = field(default_factory=list)
    rss_after_boundary_backward: list[int] = field(default_factory=list)
    engine_grad_bytes_between: list[int] = field(default_factory=list)
    gathered_units_between: list[int] = field(default_factory=list)

    def after_backward(self, boundary: bool) -> None:
        rss = proc_status()["VmRSS"] - self.baseline_rss
        if boundary:
            self.rss_after_boundary_backward.append(rss)
            return
        self.rss_between.append(rss)
        if self.engine is not None:
            self.engine_grad_bytes_between.append(self.engine.memory_breakdown()["gradients"])
            units = getattr(self.engine, "units", None) or []
            self.gathered_units_between.append(sum(u.state.name != "SHARDED" for u in units))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_rss_between": max(self.rss_between, default=None),
            "max_rss_after_boundary_backward": max(self.rss_after_boundary_backward, default=None),
            "max_engine_grad_bytes_between": max(self.engine_grad_bytes_between, default=None),
            "max_gathered_units_between": max(self.gathered_units_between, default=None),
        }
        engine = self.engine
        if engine is not None:
            scheduler = getattr(engine, "scheduler", None)
            out["scheduler_peak_live_numel"] = getattr(scheduler, "peak_live_numel", None)
            out["reducer_peak_transient_bytes"] = getattr(engine.reducer, "peak_transient_bytes", None)
            units = getattr(engine, "units", None) or []
            out["largest_unit_numel"] = max((u.numel for u in units), default=None)
        return out


@dataclass(frozen=True)
class System:
    """A model wrapped for training, and its own byte counter."""

    step: Callable[[], torch.Tensor]
    """Runs one full optimizer step on the fixed batch; returns the loss."""
    comm: Callable[[], dict[str, dict[str, float]]]
    """Bytes moved since the last `reset_comm()`, per collective kind and in total."""
    reset_comm: Callable[[], None]


def _counting_allreduce_hook(counter: ByteCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce hook (divide by W, all-reduce the bucket), counting the bucket's bytes."""
    buffer = bucket.buffer()
    counter.record("all_reduce", buffer.numel() * buffer.element_size())
    return default_hooks.allreduce_hook(None, bucket)


# DDP compares the hook's annotations with the real types; `from __future__ import annotations` made them strings.
_counting_allreduce_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


def _count_broadcasts(counter: ByteCounter) -> None:
    """Wraps torch.distributed.broadcast in this process so ZeroRedundancyOptimizer's broadcasts are counted."""
    original = dist.broadcast

    @functools.wraps(original)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.record("broadcast", tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.broadcast = counted


def _count_fsdp_collectives(counter: ByteCounter) -> None:
    """Wraps the two torch.distributed calls FSDP2 makes (`_fsdp_collectives` looks them up at call time).

    The full buffer of an all-gather is its output, of a reduce-scatter its input.
    """
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    @functools.wraps(all_gather)
    def counted_all_gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.record("all_gather", output.numel() * output.element_size())
        return all_gather(output, *args, **kwargs)

    @functools.wraps(reduce_scatter)
    def counted_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        full = kwargs["input"] if "input" in kwargs else args[1]
        counter.record("reduce_scatter", full.numel() * full.element_size())
        return reduce_scatter(*args, **kwargs)

    dist.all_gather_single = counted_all_gather  # type: ignore[assignment]
    dist.reduce_scatter_single = counted_reduce_scatter  # type: ignore[assignment]


def build_fsdp2_system(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, grad_accum: int, probe: MicroProbe
) -> System:
    """FSDP2: `fully_shard` on each Linear, then on the root, resharding after forward (ZeRO-3's layout).

    Accumulation takes FSDP2's default path: every micro-step reduce-scatters into the sharded `.grad`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    counter = ByteCounter(dist.get_world_size())
    _count_fsdp_collectives(counter)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(grad_accum):
            loss = nn.functional.mse_loss(model(x), y) / grad_accum
            loss.backward()
            probe.after_backward(boundary=micro == grad_accum - 1)
            total += loss.detach()
        optimizer.step()
        return total

    return System(step, counter.as_dict, counter.reset)


def build_torch_system(
    name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, grad_accum: int, probe: MicroProbe
) -> System:
    if name == "fsdp2":
        return build_fsdp2_system(model, x, y, grad_accum, probe)
    counter = ByteCounter(dist.get_world_size())
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=name == "ddp_bucket_view")
    ddp.register_comm_hook(counter, _counting_allreduce_hook)
    if name == "ddp_zero_r":
        _count_broadcasts(counter)
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
        )
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(grad_accum):
            boundary = micro == grad_accum - 1
            # Non-boundary micro-steps accumulate locally; the boundary's backward all-reduces the sum.
            with contextlib.nullcontext() if boundary else ddp.no_sync():
                loss = nn.functional.mse_loss(ddp(x), y) / grad_accum
                loss.backward()
            probe.after_backward(boundary=boundary)
            total += loss.detach()
        optimizer.step()
        return total

    return System(step, counter.as_dict, counter.reset)


def build_engine_system(
    name: str,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    reduce_bucket_size: int | None,
    grad_accum: int,
    probe: MicroProbe,
) -> tuple[System, Any]:
    import accelerate_zero

    if os.environ.get(ARENA_WHOLE_ENV) == "1":
        from user_load import count_gradient_arenas_whole

        count_gradient_arenas_whole()  # [Note: resident pages against allocated bytes] in user_load.py
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = engine_config(int(name[-1]), reduce_bucket_size, grad_accum)
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    probe.engine = engine

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for _ in range(grad_accum):
            boundary = engine.is_gradient_accumulation_boundary()
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)  # divides by gradient_accumulation_steps itself
            probe.after_backward(boundary=boundary)
            engine.step()
            total += loss.detach() / grad_accum
        return total

    return System(step, engine.comm_stats, engine.reset_comm_stats), engine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", required=True, choices=[*TORCH_SYSTEMS, *ENGINE_SYSTEMS, *LOAD_SYSTEMS])
    parser.add_argument("--load_dir", default=None, help="load_az3 / load_hf: the saved LlamaForCausalLM folder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes every rank's measurement to")
    parser.add_argument("--reduce_bucket_size", type=int, default=None, help="engine only; default: the engine's")
    parser.add_argument(
        "--grad_accum", type=int, default=1, help="micro-steps (forward + backward each) per optimizer step"
    )
    args = parser.parse_args()
    if args.grad_accum < 1:
        parser.error(f"--grad_accum {args.grad_accum}: needs at least 1 micro-step per optimizer step")
    return args


def measure_loading(measurement: Measurement, system: str, folder: str, model_class: Any) -> None:
    """Loads `folder` once; keeps VmHWM/VmRSS after it (the baseline was taken before) and what the rank holds."""
    import threading

    import accelerate_zero  # already imported before the baseline

    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample() -> None:  # VmHWM does not split anonymous from file-backed pages: poll both every 2 ms
        while not done.is_set():
            with open("/proc/self/status") as status:
                for line in status:
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if system == "load_az3":
        config = engine_config(3, None)
        model = accelerate_zero.from_pretrained(model_class, folder, config=config)
    else:
        model = model_class.from_pretrained(folder)
    done.set()
    sampler.join()
    gc.collect()
    measurement.after = proc_status()
    measurement.extra["sampled_peak"] = peaks
    # transformers may leave parameters as views of the mmap-ed safetensors file, not yet read: touch every one
    # (as the first forward would) and read again.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sum()
    measurement.extra["after_touch"] = proc_status()
    measurement.params = sum(p.numel() for p in model.parameters())
    measurement.live_tensor_bytes = live_tensor_bytes()
    dist.barrier()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.system in LOAD_SYSTEMS:
        # Both loaders import the same things before the baseline, the Llama modeling module and accelerate's
        # init_empty_weights included, so that the reading holds the loading alone.
        import accelerate  # noqa: F401
        from transformers import LlamaForCausalLM

        import accelerate_zero  # noqa: F401

        measurement = start_measurement()
        measure_loading(measurement, args.system, args.load_dir, LlamaForCausalLM)
        finish(measurement, args.out)
        return
    # Every system's libraries are imported before the baseline, so RSS above it is training state, not modules:
    # `import accelerate_zero` alone holds ~4 MB (its modules, yaml, safetensors), and FSDP2's modules are already
    # loaded by the DDP imports above.
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import accelerate_zero  # noqa: F401

    measurement: Measurement = start_measurement()
    model = build_model()
    measurement.params = sum(p.numel() for p in model.parameters())
    x, y = make_batch(dist.get_rank())
    engine = None
    probe = MicroProbe(baseline_rss=measurement.baseline["VmRSS"])
    if args.system in ENGINE_SYSTEMS:
        system, engine = build_engine_system(args.system, model, x, y, args.reduce_bucket_size, args.grad_accum, probe)
    else:
        system = build_torch_system(args.system, model, x, y, args.grad_accum, probe)
    run_steps(measurement, system.step, warmup=args.warmup, steps=args.steps, reset_comm=system.reset_comm)
    measurement.comm = system.comm()
    measurement.extra["grad_accum"] = args.grad_accum
    measurement.extra["micro"] = probe.as_dict()
    if engine is not None:
        measurement.extra["memory_breakdown"] = engine.memory_breakdown()
    finish(measurement, args.out)


if __name__ == "__main__":
    main()
    # The readings are written and the group destroyed: leave without interpreter teardown. Tearing down a DDP
    # module there can deadlock inside torch (seen once in ~30 runs: the main thread, holding the GIL, frees DDP's
    # reducer and joins gloo's threads while one of them waits for the GIL to release a finished collective's
    # tensor), which would hang the benchmark after its measurement.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
