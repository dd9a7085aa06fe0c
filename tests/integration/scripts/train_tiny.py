"""Train a tiny nn.Linear for 3 steps with the ZeRO config `accelerate-zero launch` handed to this rank.

Usage (what tests/integration/test_launch.py runs):
    accelerate-zero launch --config_file accelerate_configs/zero2.yaml tests/integration/scripts/train_tiny.py \
        --out OUT_DIR [--fail_rank R]

Each rank writes OUT_DIR/started_rank<R> first, then OUT_DIR/rank<R>.json with what the test checks: world size,
ZeRO stage, the losses, the environment variables it received and the distributed type accelerate sees.
`--fail_rank R` makes rank R raise after the engine is built, so the others wait in a collective.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import accelerate_zero
from accelerate_zero.integrations.accelerate import ZeroPlugin


MICRO_BATCH, STEPS = 4, 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fail_rank", type=int, default=None)
    args = parser.parse_args()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"started_rank{rank}").touch()
    torch.set_num_threads(1)

    config = ZeroPlugin().zero_config()
    config = config.fill_auto(
        {
            "train_batch_size": MICRO_BATCH * world_size,
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
        }
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank} fails on purpose (--fail_rank)")

    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        inputs, targets = (
            torch.randn(MICRO_BATCH, 7, generator=generator),
            torch.randn(MICRO_BATCH, 3, generator=generator),
        )
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    from accelerate import Accelerator  # after initialize: accelerate reuses the engine's process group

    accelerator = Accelerator()  # raises ImportError if the launcher made accelerate think DeepSpeed is in use

    result = {
        "rank": rank,
        "world_size": engine.dp.world_size,
        "stage": engine.stage,
        "losses": losses,
        "config": config.to_dict(),
        "env": {key: value for key, value in os.environ.items() if key.startswith("ACCELERATE_")},
        "accelerate_distributed_type": str(accelerator.distributed_type),
        "accelerate_num_processes": accelerator.num_processes,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
