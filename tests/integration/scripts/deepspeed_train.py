"""A DeepSpeed-style script for `accelerate-zero deepspeed` (tests/integration/test_deepspeed_launcher.py): records
what the launcher gave it (argv, environment) and takes one training step.

`--fail_rank N`: that rank exits with code 3 at once (before importing torch), to check that the launcher stops the
others and returns the code.
"""

import argparse
import json
import os
import sys


parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
parser.add_argument("--fail_rank", type=int, default=-1)
if parser.parse_known_args()[0].fail_rank == int(os.environ["RANK"]):
    sys.exit(3)

import torch  # noqa: E402

import accelerate_zero.deepspeed as deepspeed  # noqa: E402


parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
local_rank_given = args.local_rank
deepspeed.init_distributed()
model = torch.nn.Linear(4, 2)
engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
loss = engine(torch.ones(2, 4)).sum()
engine.backward(loss)
engine.step()
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR")
record = {
    "local_rank_given": local_rank_given,
    "args_local_rank": args.local_rank,
    "argv": sys.argv[1:],
    "env": {name: os.environ[name] for name in names},
    "world_size": deepspeed.comm.get_world_size(),
    "stage": engine.zero_optimization_stage(),
    "steps": engine.global_steps,
}
with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
