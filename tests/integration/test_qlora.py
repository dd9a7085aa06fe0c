"""QLoRA on the ZeRO engine: LoRA adapters on a 4-bit NF4 base (bitsandbytes, on the CPU) at stages 2 and 3.

One spawned group of 2 ranks trains the recipe's model (recipes/qlora.py's loading and adapters) with the Trainer
for a few steps at each stage and checks that the quantized base gets no gradient, no optimizer state and is not
changed or partitioned, and that the saved adapter reloads onto a freshly quantized base with the same logits. One
real `accelerate-zero launch` runs the recipe end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import plain_torchrun_environment, shared_parts


pytest.importorskip("bitsandbytes")

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
MODEL = RECIPES / "assets" / "tiny-llama"
PROBE = torch.tensor([[1, 5, 9, 14, 20, 27, 33, 40]])


def _recipe_modules() -> tuple[Any, Any]:
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    import qlora
    import sft

    return qlora, sft


def _stage(rank: int, world_size: int, folder: str, stage: int) -> dict[str, Any]:
    plain_torchrun_environment()
    return _train(rank, stage, Path(folder) / f"stage{stage}")


def _train(rank: int, stage: int, folder: Path) -> dict[str, Any]:
    from datasets import Dataset

    from accelerate_zero import Trainer, TrainingArguments

    qlora, sft = _recipe_modules()
    torch.manual_seed(0)
    model = qlora.with_adapters(qlora.load_quantized(str(MODEL), "nf4"), qlora.QLoRAScriptArguments(), True)
    quantized = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_floating_point()}
    rows = [{"input_ids": list(range(1, 17)), "labels": list(range(1, 17))} for _ in range(16)]
    args = TrainingArguments(
        output_dir=str(folder),
        zero_config={"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}},
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        gradient_checkpointing=True,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        ddp_timeout=60,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=sft.Collator(0))
    trainer.train()
    # Compared before any inference forward: on the CPU bitsandbytes repacks 4-bit weights in place on the first
    # forward without gradients (its inference kernel's layout), which is not a change of the values.
    unchanged = all(torch.equal(p, quantized[n]) for n, p in model.named_parameters() if n in quantized)
    engine = trainer.zero_engine
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    state_numel = sum(t.numel() for s in engine.optimizer.state.values() for t in s.values() if t.ndim > 0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if stage == 2 else None
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    trainer.save_model(str(folder / "adapter"))
    out = {
        "quantized_unchanged": unchanged,
        "quantized_whole": all(
            p.numel() == quantized[n].numel() for n, p in model.named_parameters() if n in quantized
        ),
        "quantized_count": len(quantized),
        "quantized_grads": [n for n, p in model.named_parameters() if n in quantized and p.grad is not None],
        "quantized_optimized": sum(id(p) in optimized for n, p in model.named_parameters() if n in quantized),
        "adam_state_numel": state_numel,
        "trainable_numel": trainable,
        "shard_numel": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]),
        "logits": logits,
    }
    if rank == 0:
        from peft import PeftModel

        out["files"] = sorted(p.name for p in (folder / "adapter").iterdir())
        reloaded = PeftModel.from_pretrained(qlora.load_quantized(str(MODEL), "nf4"), folder / "adapter").eval()
        with torch.no_grad():
            out["reloaded_logits"] = reloaded(input_ids=PROBE).logits
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """`ranks[r][stage]`: rank r's QLoRA run at `stage` (2 or 3), each its own body, run when a test first reads it."""
    return shared_parts(_stage, 2, str(tmp_path_factory.mktemp("qlora")))


@pytest.mark.parametrize("stage", [2, 3])
def test_quantized_base_is_frozen_whole_and_untouched(ranks: Any, stage: int) -> None:
    for rank in ranks:
        run = rank[stage]
        assert run["quantized_count"] > 0 and run["quantized_unchanged"] and run["quantized_whole"]
        assert run["quantized_grads"] == [] and run["quantized_optimized"] == 0
        # Adam keeps two fp32 moments of this rank's shard of the adapters only
        assert run["adam_state_numel"] == 2 * run["shard_numel"]
        if run["trainable_numel"] is not None:
            assert run["shard_numel"] <= run["trainable_numel"] // 2 + 64  # sharded over 2 ranks (+ padding)


@pytest.mark.parametrize("stage", [2, 3])
def test_adapter_reloads_onto_its_quantized_base(ranks: Any, stage: int) -> None:
    run = ranks[0][stage]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(run["files"])
    assert torch.allclose(run["reloaded_logits"], run["logits"], atol=1e-5)


def test_recipe_runs_under_the_launcher(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "accelerate_zero.cli.main",
        "launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "zero3.yaml"),
        str(RECIPES / "qlora.py"),
        "--config",
        str(RECIPES / "configs" / "qlora_demo.yaml"),
        "--max_steps",
        "4",
        "--logging_steps",
        "2",
        "--eval_samples",
        "8",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "ACCELERATE_ZERO_PG_TIMEOUT": "60"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out exact match" in result.stdout
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
