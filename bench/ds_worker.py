"""One benchmark run of DeepSpeed ZeRO on every rank; runs in DeepSpeed's own virtualenv, started by engine_bench.py.

Usage (what engine_bench.py runs; accelerate_zero is neither imported nor installed there):
    DS_ACCELERATOR=cpu .ds-venv/bin/torchrun --standalone --nproc_per_node 4 bench/ds_worker.py \
        --stage 2 --steps 20 --warmup 3 --out r.json

Bytes are counted by DeepSpeed's comms logger (every deepspeed.comm call, `prof_all`) and converted with the same
ring-volume convention as the other systems (bench_common.ring_factor).
"""

from __future__ import annotations

import argparse
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from bench_common import LR, build_model, finish, make_batch, ring_factor, run_steps, start_measurement, with_total
from deepspeed.comm.comm import comms_logger
from torch import nn


def ds_config(stage: int, reduce_bucket_size: int | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:  # as bench_worker.STAGE3_KEYS: every Linear a gather unit, released right after use
        zero.update(
            stage3_param_persistence_threshold=0,
            stage3_max_reuse_distance=0,
            stage3_prefetch_bucket_size=2100000,
            stage3_max_live_parameters=4200000,
        )
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    return {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": zero,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
    }


def logged_comm(world_size: int) -> dict[str, dict[str, float]]:
    """The comms logger's records as {op: calls, payload_bytes, bytes_per_rank}.

    The logger records the size of the argument named `tensor`: the full buffer of an all-reduce, reduce,
    broadcast or reduce-scatter, but one rank's input of an all-gather (the full buffer is W times that).
    """
    by_kind: dict[str, dict[str, float]] = {}
    for op, sizes in comms_logger.comms_dict.items():
        for msg_size, record in sizes.items():
            calls = record[0]
            payload = msg_size * (world_size if op.startswith("all_gather") else 1)
            entry = by_kind.setdefault(op, {"calls": 0, "payload_bytes": 0, "bytes_per_rank": 0.0})
            entry["calls"] += calls
            entry["payload_bytes"] += calls * payload
            entry["bytes_per_rank"] += calls * payload * ring_factor(op, world_size)
    return with_total(by_kind)


def reset_comms_logger() -> None:
    comms_logger.comms_dict = {}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reduce_bucket_size", type=int, default=None, help="default: DeepSpeed's")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    measurement = start_measurement()
    model = build_model()
    measurement.params = sum(p.numel() for p in model.parameters())
    x, y = make_batch(dist.get_rank())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config(args.stage, args.reduce_bucket_size)
    )

    def step() -> torch.Tensor:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    run_steps(measurement, step, warmup=args.warmup, steps=args.steps, reset_comm=reset_comms_logger)
    measurement.comm = logged_comm(dist.get_world_size())
    measurement.extra["deepspeed_version"] = deepspeed.__version__
    finish(measurement, args.out)


if __name__ == "__main__":
    main()
