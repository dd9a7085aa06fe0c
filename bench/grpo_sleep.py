"""GRPO at stage 3 with the training state asleep during generation, against awake (issue 33, item 3;
bench/README.md, "grpo_sleep.py").

Usage:
    .venv/bin/python bench/grpo_sleep.py                       # W = 2, 4 steps each way (~2 min)
    .venv/bin/python bench/grpo_sleep.py --hidden 512 --layers 8 --json bench/out/grpo_sleep.json

`ZeroGRPOTrainer` trains a Llama built from recipes/assets/tiny-llama's config and tokenizer, widened, once with
`offload_states_during_generation` false and once true. Per rollout: what the engine holds on its device while
generating (`memory_breakdown()` at every forward of the call: the maximum) and the call's wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from harness import launch, report


ASSET = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "tiny-llama"
KINDS = ("parameters", "master_weights", "optimizer_states", "gradients", "total")
MB = 1e6


def grpo(hidden: int, layers: int, steps: int, sleep: bool, bf16: bool) -> dict[str, Any]:
    """Rank function: GRPO for `steps` steps; every generate call's seconds and the largest breakdown inside it."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from accelerate_zero.integrations.trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(ASSET)
    config.hidden_size, config.num_hidden_layers = hidden, layers
    config.intermediate_size, config.head_dim = 3 * hidden, hidden // config.num_attention_heads
    model = LlamaForCausalLM(config)
    calls: list[dict] = []
    held: list[dict] = []
    generating = [False]

    class Measured(GRPOTrainer):
        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            start, generating[0] = time.perf_counter(), True
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                generating[0] = False
                calls.append({"seconds": time.perf_counter() - start, "held": held[-1] if held else {}})

    def record(module: Any, inputs: Any) -> None:
        if generating[0] and trainer.zero_engine is not None:
            reading = trainer.zero_engine.memory_breakdown()
            if not held or reading["total"] >= held[-1]["total"]:
                held.append(reading)

    model.register_forward_pre_hook(record)
    prompts = ["sort: c b a", "reverse: x y z w", "sort: q p", "reverse: 1 2 3"]
    arguments = GRPOConfig(
        output_dir=f"/tmp/az_grpo_sleep_{sleep}", per_device_train_batch_size=4, num_generations=2,
        max_completion_length=32, max_steps=steps, learning_rate=1e-4, beta=0.0, bf16=bf16, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, offload_states_during_generation=sleep,
        zero_config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    )  # fmt: skip
    trainer = Measured(
        model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions], args=arguments,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts * 8]),
        processing_class=AutoTokenizer.from_pretrained(ASSET, padding_side="left"),
    )  # fmt: skip
    trainer.train()
    return {"calls": calls, "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 weights (default: bf16, as TRL)")
    args = parser.parse_args()
    facts, results = report.machine_facts(), {}
    for sleep in (False, True):
        kwargs = {"hidden": args.hidden, "layers": args.layers, "steps": args.steps, "sleep": sleep, "bf16": args.bf16}
        name = "asleep" if sleep else "awake"
        results[name] = launch.on_ranks(args.world_size, grpo, kwargs, name=name, backend="none").results[0]
    print(
        report.header(facts, f"grpo_sleep: {results['awake']['params'] / 1e6:.1f}M parameters, W = {args.world_size}")
    )
    print("Per rollout after the first step (rank 0; the first rollout comes before any optimizer state exists):\n")
    rows = []
    for run, got in results.items():
        later = got["calls"][1:]
        held = [f"{max(c['held'].get(k, 0) for c in later) / MB:.1f}" for k in KINDS]
        rows.append((run, *held, f"{statistics.median(c['seconds'] for c in later):.3f}"))
    print(report.table(["run", *(f"{k} held while generating (MB)" for k in KINDS), "s per rollout"], rows))
    if args.json:
        report.save_json(args.json, results, facts)


if __name__ == "__main__":
    main()
