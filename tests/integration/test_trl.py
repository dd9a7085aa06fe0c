"""A TRL trainer composed with `ZeroTrainerMixin` (what open-r1 users run): `SFTTrainer` at stage 3 on 2 ranks
against TRL's own `SFTTrainer` in one process on the full batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import plain_torchrun_environment, run_distributed


pytest.importorskip("trl")

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "assets" / "tiny-llama"
PUZZLES = [("sort: c b a", "a b c"), ("reverse: x y z w", "w z y x")]


def _rows() -> list[dict[str, Any]]:
    # One conversation repeated: every micro-batch's loss equals the full batch's however TRL orders, pads and
    # normalises, so the only difference left between the runs is how the gradient is computed and applied.
    question, answer = PUZZLES[1]
    return [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}] * 32


def _train(output_dir: str, batch: int, zero: bool) -> dict[str, torch.Tensor]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from accelerate_zero import ZeroArgumentsMixin, ZeroTrainerMixin

    @dataclass
    class ZeroSFTConfig(ZeroArgumentsMixin, SFTConfig):
        pass

    class ZeroSFTTrainer(ZeroTrainerMixin, SFTTrainer):
        pass

    kwargs = dict(
        output_dir=output_dir,
        max_steps=3,
        per_device_train_batch_size=batch,
        learning_rate=0.05,
        optim="sgd",
        max_grad_norm=1.0,
        bf16=False,  # TRL defaults to bf16: our engine would keep 16-bit weights, the reference autocasts
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        ddp_timeout=60,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    if zero:
        zero_optimization = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        config = {"zero_optimization": zero_optimization}
        args, trainer_class = ZeroSFTConfig(zero_config=config, **kwargs), ZeroSFTTrainer
    else:
        args, trainer_class = SFTConfig(**kwargs), SFTTrainer
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    trainer = trainer_class(
        model=model, args=args, train_dataset=Dataset.from_list(_rows()), processing_class=tokenizer
    )
    trainer.train()
    if zero:
        return {"state": trainer.accelerator.get_state_dict(model), "world_size": trainer.zero_engine.dp.world_size}
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    plain_torchrun_environment()
    return _train(folder, batch=4, zero=True)


def test_sft_trainer_with_the_mixin_matches_trl_in_one_process(tmp_path: Path) -> None:
    ranks = run_distributed(_ranks, 2, str(tmp_path / "zero"))
    reference = _train(str(tmp_path / "reference"), batch=8, zero=False)["state"]
    assert ranks[0]["world_size"] == 2
    state = ranks[0]["state"]
    diff = max((state[k] - reference[k]).abs().max().item() for k in reference)
    moved = max((reference[k] - v).abs().max().item() for k, v in _initial().items())
    assert moved > 1e-3 and diff < 1e-6, (moved, diff)


def _initial() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).state_dict()
