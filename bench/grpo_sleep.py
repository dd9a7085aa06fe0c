"""GRPO at stage 3 with the training state asleep during generation, against awake (bench/README.md,
"grpo_sleep.py").
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import cli, launch, report


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


def grpo_sleep(
    world_size: int = 2, hidden: int = 256, layers: int = 6, steps: int = 4, fp32: bool = False
) -> cli.Answer:
    """`ZeroGRPOTrainer` on a widened tiny-llama, with `offload_states_during_generation` false then true: what the
    engine holds on its device while generating (the largest `memory_breakdown()` at a forward of the call) and the
    call's wall time, per rollout after the first (which comes before any optimizer state exists).

    Args:
        world_size: ranks.
        hidden: the Llama's width.
        layers: its decoder layers.
        steps: GRPO steps each way.
        fp32: fp32 weights (default: bf16, as TRL).
    """
    results = {}
    for sleep in (False, True):
        kwargs = {"hidden": hidden, "layers": layers, "steps": steps, "sleep": sleep, "bf16": not fp32}
        name = "asleep" if sleep else "awake"
        results[name] = launch.on_ranks(world_size, grpo, kwargs, name=name, backend="none").results[0]
    rows = []
    for run, got in results.items():
        later = got["calls"][1:]
        held = [f"{max(c['held'].get(k, 0) for c in later) / MB:.1f}" for k in KINDS]
        rows.append((run, *held, f"{statistics.median(c['seconds'] for c in later):.3f}"))
    table = report.table(["run", *(f"{k} held while generating (MB)" for k in KINDS), "s per rollout"], rows)
    title = f"grpo_sleep: {results['awake']['params'] / 1e6:.1f}M parameters, W = {world_size}, rank 0"
    return cli.Answer(title, table, results)


if __name__ == "__main__":
    sys.exit(cli.main(grpo_sleep))
