"""Compile requested the way users request it reaches the model at 2 ranks, and trains as the same run eager:
`TrainingArguments(torch_compile=True, torch_compile_backend=...)` in our Trainer at stage 3 (per unit) and
`ZeroAccelerator(dynamo_backend=...)` at stage 2 (the whole model). Before, both were silently ignored (issue 51).
The environment variables `--dynamo_backend` / `dynamo_config` set are the same `TorchDynamoPlugin`
(tests/unit/test_compile_requests.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import plain_torchrun_environment, run_distributed
from tests.integration.trainer_checks import args_kwargs, dataset, losses, tiny_llama, zero_config


BACKEND = "aot_eager"


def _trainer_run(folder: Path, compile_args: dict[str, Any]) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from accelerate_zero import Trainer, TrainingArguments

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    config = zero_config(3, stage3_param_persistence_threshold=0)
    args = TrainingArguments(zero_config=config, **args_kwargs(folder, 2, max_steps=3, **compile_args))
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    engine = trainer.zero_engine
    return {
        "losses": losses(trainer),
        "state": trainer.accelerator.get_state_dict(model),
        "compiled": engine.is_compiled,
        "regions": list(engine.compiled_regions),
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }


def _accelerator_run(dynamo_backend: str | None) -> dict[str, Any]:
    import torch._dynamo
    from accelerate.state import AcceleratorState
    from torch._dynamo.utils import counters

    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    torch._dynamo.reset()
    counters.clear()
    AcceleratorState._reset_state()  # the dynamo settings are accelerate's process-wide state: the Trainer's stay
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    accelerator = ZeroAccelerator(ZeroPlugin(config=config), dynamo_backend=dynamo_backend)
    model, optimizer = accelerator.prepare(model, optimizer)
    gen = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        tokens = torch.randint(0, 61, (2, 10), generator=gen)
        accelerator.backward(model(input_ids=tokens, labels=tokens, use_cache=False).loss)
        optimizer.step()
        optimizer.zero_grad()
    engine = accelerator.zero_engines[0]
    return {
        "state": accelerator.get_state_dict(model),
        "compiled": engine.is_compiled,
        "regions": list(engine.compiled_regions),
        "graphs": counters["stats"]["unique_graphs"],
    }


def _checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    plain_torchrun_environment()
    root = Path(folder)
    return {
        "trainer eager": _trainer_run(root / "eager", {}),
        "trainer compiled": _trainer_run(root / "compiled", {"torch_compile": True, "torch_compile_backend": BACKEND}),
        "accelerator eager": _accelerator_run(None),
        "accelerator compiled": _accelerator_run(BACKEND),
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_trainer_and_accelerator_compile_and_train_as_eager(tmp_path: Path) -> None:
    runs = run_distributed(_checks, 2, str(tmp_path), timeout=600)[0]
    eager, compiled = runs["trainer eager"], runs["trainer compiled"]
    assert not eager["compiled"] and eager["graphs"] == 0
    assert compiled["compiled"] and compiled["regions"] == ["model.layers.0", "model.layers.1"], compiled
    assert compiled["graphs"] == 1 and compiled["breaks"] == 0, compiled
    assert compiled["losses"] == eager["losses"]
    assert _max_diff(compiled["state"], eager["state"]) < 1e-6
    eager, compiled = runs["accelerator eager"], runs["accelerator compiled"]
    assert not eager["compiled"] and compiled["compiled"] and compiled["regions"] == ["<model>"], compiled
    assert compiled["graphs"] == 1, compiled
    assert _max_diff(compiled["state"], eager["state"]) < 1e-6
