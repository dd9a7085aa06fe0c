"""GRPO at stage 3 with the training state asleep during generation, against awake (issue 33, item 3).

Usage:
    .venv/bin/python bench/grpo_sleep.py                       # W = 2, 4 steps each way (~2 min)
    .venv/bin/python bench/grpo_sleep.py --hidden 512 --layers 8 --json bench/out/grpo_sleep.json

`ZeroGRPOTrainer` (TRL's GRPOTrainer on the engine; transformers generation, no vLLM on a CPU) trains a Llama built
from recipes/assets/tiny-llama's config and tokenizer, widened to `--hidden` / `--layers` (AdamW, stage 3
with every tensor partitioned, `ds3_gather_for_generation` true: TRL's default; bf16 with fp32 masters as TRL's
default, `--fp32` otherwise), 2 prompts x 2 completions of up to
32 tokens per rank and step, once with `offload_states_during_generation` false and once true. Per generate call
(one rollout): what the engine holds on its device while generating (`memory_breakdown()`, read at every forward
of the call: the maximum) and the call's wall time, which includes the offload and the reload. On a CPU "the
device" is host memory too, so the bytes asleep are moved, not freed: the reading that carries to a GPU is what
the engine holds, which is what a colocated generator gets back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


ASSET = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "tiny-llama"
KINDS = ("parameters", "master_weights", "optimizer_states", "gradients", "total")
MB = 1e6


def worker(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from accelerate_zero.integrations.trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(ASSET)
    config.hidden_size, config.num_hidden_layers = args.hidden, args.layers
    config.intermediate_size, config.head_dim = 3 * args.hidden, args.hidden // config.num_attention_heads
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    calls: list[dict] = []
    held: list[dict] = []
    generating = [False]

    class Measured(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
            start, generating[0] = time.perf_counter(), True
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                generating[0] = False
                calls.append({"seconds": time.perf_counter() - start, "held": held[-1] if held else {}})

    def record(module, inputs):  # noqa: ANN001, ANN202
        if generating[0] and trainer.zero_engine is not None:
            reading = trainer.zero_engine.memory_breakdown()
            if not held or reading["total"] >= held[-1]["total"]:
                held.append(reading)

    model.register_forward_pre_hook(record)
    prompts = ["sort: c b a", "reverse: x y z w", "sort: q p", "reverse: 1 2 3"]
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    trainer = Measured(
        model=model,
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=GRPOConfig(
            output_dir=f"/tmp/az_grpo_sleep_{args.sleep}",
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=32,
            max_steps=args.steps,
            learning_rate=1e-4,
            beta=0.0,
            bf16=args.bf16,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            zero_config={"zero_optimization": zero},
            offload_states_during_generation=args.sleep,
        ),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts * 8]),
        processing_class=AutoTokenizer.from_pretrained(ASSET, padding_side="left"),
    )
    trainer.train()
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"calls": calls, "params": params}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 weights (default: bf16, as TRL)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sleep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {}
    for sleep in (False, True):
        out = f"/tmp/az_grpo_sleep_{sleep}.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.world_size}",
        ]
        command += [__file__, "--worker", "--out", out, "--hidden", str(args.hidden), "--layers", str(args.layers)]
        command += ["--steps", str(args.steps)] + (["--sleep"] if sleep else []) + ([] if args.bf16 else ["--fp32"])
        subprocess.run(command, env=env, check=True)
        results["asleep" if sleep else "awake"] = json.loads(Path(out).read_text())
    params = results["awake"]["params"]
    print(f"\n{params / 1e6:.1f}M parameters, W = {args.world_size}; per rollout after the first step (rank 0):")
    print("| run | " + " | ".join(f"{k} held while generating (MB)" for k in KINDS) + " | s per rollout |")
    for run, got in results.items():
        later = got["calls"][1:]  # the first rollout comes before any optimizer state exists
        held = {k: max(c["held"].get(k, 0) for c in later) / MB for k in KINDS}
        seconds = statistics.median(c["seconds"] for c in later)
        print(f"| {run} | " + " | ".join(f"{held[k]:.1f}" for k in KINDS) + f" | {seconds:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
