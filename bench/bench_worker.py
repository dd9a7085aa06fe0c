"""One benchmark run of one system on every rank; started by engine_bench.py under torchrun (never alone).

Usage (what engine_bench.py runs):
    torchrun --standalone --nproc_per_node 4 bench/bench_worker.py --system az2 --steps 20 --warmup 3 --out r.json

Systems: ddp, ddp_bucket_view, ddp_zero_r (torch) and az0, az1, az2 (accelerate_zero stages 0-2). The process
group is created here, before the baseline reading, so every system's baseline holds the same things.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from bench_common import LR, ByteCounter, Measurement, build_model, finish, make_batch, run_steps, start_measurement
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


TORCH_SYSTEMS = ("ddp", "ddp_bucket_view", "ddp_zero_r")
ENGINE_SYSTEMS = ("az0", "az1", "az2")


def engine_config(stage: int, reduce_bucket_size: int | None) -> dict[str, Any]:
    """The config every ZeRO system gets (DeepSpeed's too): defaults except clipping off."""
    zero: dict[str, Any] = {"stage": stage}
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    return {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": zero,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }


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


def build_torch_system(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> System:
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
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return System(step, counter.as_dict, counter.reset)


def build_engine_system(
    name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduce_bucket_size: int | None
) -> tuple[System, Any]:
    import accelerate_zero

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = engine_config(int(name[-1]), reduce_bucket_size)
    engine = accelerate_zero.initialize(model, optimizer, config=config)

    def step() -> torch.Tensor:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return System(step, engine.comm_stats, engine.reset_comm_stats), engine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", required=True, choices=[*TORCH_SYSTEMS, *ENGINE_SYSTEMS])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes every rank's measurement to")
    parser.add_argument("--reduce_bucket_size", type=int, default=None, help="engine only; default: the engine's")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    measurement: Measurement = start_measurement()
    model = build_model()
    measurement.params = sum(p.numel() for p in model.parameters())
    x, y = make_batch(dist.get_rank())
    engine = None
    if args.system in ENGINE_SYSTEMS:
        system, engine = build_engine_system(args.system, model, x, y, args.reduce_bucket_size)
    else:
        system = build_torch_system(args.system, model, x, y)
    run_steps(measurement, system.step, warmup=args.warmup, steps=args.steps, reset_comm=system.reset_comm)
    measurement.comm = system.comm()
    if engine is not None:
        measurement.extra["memory_breakdown"] = engine.memory_breakdown()
    finish(measurement, args.out)


if __name__ == "__main__":
    main()
