"""What each rank runs for tests/integration/test_trl_trainers.py: the ready-made TRL trainers at stage 3 on 2 ranks
(one spawned group for all of them). Results are plain values. Whether they train to TRL's numbers is
tests/integration/test_trl_numerics.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import plain_torchrun_environment


MODEL = Path(__file__).resolve().parents[2] / "recipes" / "assets" / "tiny-llama"
PROMPTS = ["sort: c b a", "reverse: x y z w", "sort: q p", "reverse: 1 2 3"]
# Every parameter sharded, and every unit released after its forward (the tiny model is far below DeepSpeed's
# default stage3_max_reuse_distance of 1e9 elements, under which a no-grad forward keeps units for the next one).
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}


def common(output_dir: str) -> dict[str, Any]:
    return dict(
        output_dir=output_dir,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        bf16=False,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        ddp_timeout=120,
        zero_config=ZERO3,
    )


def load(name: str = "model") -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def held_bytes(model: torch.nn.Module, engine: Any) -> dict[str, int]:
    """Bytes this rank holds for `model`'s parameters: materialised `.data` plus the engine's shards."""
    data = sum(p.data.numel() * p.data.element_size() for p in model.parameters())
    shards = (
        0 if engine is None else sum(f.shard.numel() * f.shard.element_size() for u in engine.units for f in u.flats)
    )
    full = sum(math_numel(p, engine) * 4 for p in model.parameters())
    return {"data": data, "shards": shards, "full_fp32": full}


def math_numel(param: torch.nn.Parameter, engine: Any) -> int:
    if engine is not None:
        for unit in engine.units:
            for flat in unit.flats:
                for p, view in zip(flat.params, flat.views, strict=True):
                    if p is param:
                        return view.numel()
    return param.numel()


def dpo(folder: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from accelerate_zero.integrations.trl import DPOConfig, DPOTrainer

    rows = [{"prompt": p, "chosen": " yes", "rejected": " no"} for p in PROMPTS] * 4
    args = DPOConfig(per_device_train_batch_size=2, **common(str(folder / "dpo")))
    trainer = DPOTrainer(
        model=load(),
        ref_model=load("ref"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(MODEL),
    )
    seen: list[dict[str, int]] = []

    class Held(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:  # what the reference model holds between steps
            entry = trainer.accelerator.prepared_model_of(trainer.ref_model)
            seen.append(held_bytes(trainer.ref_model, entry.engine if entry is not None else None))

    trainer.add_callback(Held())
    trainer.train()
    entry = trainer.accelerator.prepared_model_of(trainer.ref_model)
    return {
        "steps": trainer.state.global_step,
        "ref_prepared": entry is not None and entry.optimizer is None,
        "ref_held_during_training": seen,
        "policy_stage": trainer.zero_engine.stage,
    }


def grpo(folder: Path, gather: bool, sleep: bool = False) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer

    import accelerate_zero
    from accelerate_zero.integrations.trl import GRPOConfig, GRPOTrainer

    calls: list[dict[str, float]] = []
    held_while_generating: list[dict[str, int]] = []
    generating = [False]

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
            engine = self.zero_engine
            engine.reset_comm_stats()
            start = time.perf_counter()
            generating[0] = True
            try:
                out = super()._generate_single_turn(*a, **k)
            finally:
                generating[0] = False
            stats = engine.comm_stats()
            calls.append({"seconds": time.perf_counter() - start, "collectives": stats["total"]["calls"]})
            return out

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        beta=0.1,  # a reference model
        ds3_gather_for_generation=gather,
        offload_states_during_generation=sleep,
        **common(str(folder / f"grpo_{gather}_{sleep}")),
    )
    model = load()

    def record(module: Any, args: Any) -> None:  # every forward of a generate call: what the engine holds then
        if generating[0] and trainer.zero_engine is not None:
            held_while_generating.append(trainer.zero_engine.memory_breakdown())

    model.register_forward_pre_hook(record)
    trainer = Timed(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 4]),
        processing_class=AutoTokenizer.from_pretrained(MODEL, padding_side="left"),
    )
    trainer.train()
    ref_entry = trainer.accelerator.prepared_model_of(trainer.ref_model)
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        trained = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    kinds = ("optimizer_states", "master_weights", "gradients", "parameters")
    return {
        "trained": trained,
        "held_while_generating": {k: max((h[k] for h in held_while_generating), default=-1) for k in kinds},
        "steps": trainer.state.global_step,
        "generate": calls,
        "units": len(trainer.zero_engine.units),
        "ref_sharded": ref_entry is not None and ref_entry.engine.stage == 3,
    }


def all_checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    plain_torchrun_environment()
    root = Path(folder)
    return {
        "dpo": dpo(root),
        "grpo_gather": grpo(root, gather=True),
        "grpo_no_gather": grpo(root, gather=False),
        "grpo_asleep": grpo(root, gather=True, sleep=True),
    }
