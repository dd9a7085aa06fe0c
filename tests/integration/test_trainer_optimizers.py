"""Optimizers that read a parameter whole, through the Trainer and TRL, against the same trainer in one process.

On 2 ranks (one pooled body): `TrainingArguments(optim="adafactor")` at stage 3, `optim="adamw_8bit"` at stage 2
(the Trainer's 32-bit override of the embeddings must follow them to their masters: optim/bitsandbytes.py), and a
Muon + AdamW chain passed as `optimizers=(chain, None)` at stage 3 with the optimizer offloaded, once to the Trainer
and once to TRL's SFTTrainer. Each reference is the plain transformers/TRL trainer on the full batch in this process
(tests/integration/trainer_checks.py: the same rows per step at any world size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import plain_torchrun_environment, run_distributed
from tests.helpers.models import update_error
from tests.integration import trainer_checks as checks


WORLD_SIZE, MICRO = 2, 2
ASSETS = Path(__file__).resolve().parents[2] / "recipes" / "assets"
MUON_BOUND = 0.01
"""||weights - reference|| / ||reference - start||, measured 0.45% (Trainer) and 0.40% (SFTTrainer) at 2 ranks while
the losses agree to 3e-6: the bf16 Newton-Schulz iteration rounds the last bit of gradients averaged in another order."""
ZERO3 = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
RUNS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    # name: (stage, zero_optimization keys, TrainingArguments overrides)
    "adafactor": (3, ZERO3, {"optim": "adafactor", "learning_rate": 1e-2}),
    "adamw_8bit": (2, {"reduce_bucket_size": 200}, {"optim": "adamw_8bit", "learning_rate": 1e-2}),
    "muon": (3, {**ZERO3, **OFFLOAD}, {"learning_rate": 1e-2}),  # the chain's own lrs, scheduled
}


def model_for(name: str) -> torch.nn.Module:
    """The tiny Llama; for the 8-bit run one whose matrices and embedding reach bitsandbytes' 8-bit threshold (4096
    elements), so the matrices step with 8-bit state and the embedding with the Trainer's 32-bit override."""
    if name != "adamw_8bit":
        return checks.tiny_llama()
    from transformers import LlamaForCausalLM

    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=160, intermediate_size=128))


def muon_chain(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Muon on the hidden matrices, AdamW on the rest (DeepSpeed's split: optim/muon.py `takes_muon`)."""
    from accelerate_zero.optim.chain import OptimizerChain
    from accelerate_zero.optim.muon import takes_muon

    hidden = [p for n, p in model.named_parameters() if takes_muon(n, p)]
    rest = [p for n, p in model.named_parameters() if not takes_muon(n, p)]
    return OptimizerChain(torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-2))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(name: str, folder: Path) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    _, _, overrides = RUNS[name]
    model = model_for(name)
    args = TrainingArguments(**checks.args_kwargs(folder, MICRO * WORLD_SIZE, **overrides))
    optimizers = (muon_chain(model), None) if name == "muon" else (None, None)
    trainer = Trainer(model=model, args=args, train_dataset=checks.dataset(), optimizers=optimizers)
    trainer.train()
    return {"state": _state(model), "losses": checks.losses(trainer)}


def _sft(folder: Path, world_size: int | None) -> tuple[Any, torch.nn.Module]:
    """TRL's SFTTrainer (ours on `world_size` ranks at stage 3 with offload, or TRL's in one process) with the chain."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    from accelerate_zero.integrations import trl as zero_trl

    model = checks.tiny_llama()
    rows = [{"input_ids": r["input_ids"].tolist()} for r in checks.dataset()]
    micro = MICRO if world_size else MICRO * WORLD_SIZE
    values = dict(checks.args_kwargs(folder, micro), bf16=False)
    values.pop("ddp_timeout")
    values["optim"], values["learning_rate"] = "adamw_torch", 1e-2
    if world_size is None:
        args = trl.SFTConfig(**values)
        cls = trl.SFTTrainer
    else:
        zero = {
            "zero_optimization": {"stage": 3, **ZERO3, **OFFLOAD, "stage3_gather_16bit_weights_on_model_save": True}
        }
        zero["zero_force_ds_cpu_optimizer"] = False
        args, cls = zero_trl.SFTConfig(zero_config=zero, **values), zero_trl.SFTTrainer
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")  # rows are token ids already: only for padding
    data = Dataset.from_list(rows)
    optimizers = (muon_chain(model), None)
    trainer = cls(model=model, args=args, train_dataset=data, processing_class=tokenizer, optimizers=optimizers)
    trainer.train()
    return trainer, model


def _ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from accelerate_zero import Trainer, TrainingArguments

    plain_torchrun_environment()
    out: dict[str, Any] = {}
    for name, (stage, zero, overrides) in RUNS.items():
        model = model_for(name)
        config = {**checks.zero_config(stage, **zero), "zero_force_ds_cpu_optimizer": False}
        args = TrainingArguments(zero_config=config, **checks.args_kwargs(Path(folder) / name, MICRO, **overrides))
        optimizers = (muon_chain(model), None) if name == "muon" else (None, None)
        trainer = Trainer(model=model, args=args, train_dataset=checks.dataset(), optimizers=optimizers)
        trainer.train()
        out[name] = {
            "state": trainer.accelerator.get_state_dict(model),
            "losses": checks.losses(trainer),
            "whole": trainer.zero_engine.sharded_optimizer.owned is not None,
            "state kinds": _state_kinds(trainer.zero_engine.optimizer),
        }
    trainer, model = _sft(Path(folder) / "sft", world_size)
    out["sft"] = {
        "state": trainer.accelerator.get_state_dict(model),
        "losses": checks.losses(trainer),
        "whole": trainer.zero_engine.sharded_optimizer.owned is not None,
    }
    return out


def _state_kinds(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """numel -> "8-bit" or "32-bit": how each tensor this rank steps keeps its state."""
    return {
        p.numel(): "8-bit" if optimizer.state[p]["state1"].dtype == torch.uint8 else "32-bit"
        for group in optimizer.param_groups
        for p in group["params"]
        if "state1" in optimizer.state.get(p, {})
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _error(name: str, run: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(the error, its bound): Muon orthogonalises in bf16, where the fp32 rounding of a gradient averaged over ranks
    can move the last bit of a value, so its runs are compared by the error relative to the training update (see
    MUON_BOUND); the others by the largest difference of any weight."""
    if name not in ("muon", "sft"):
        return _max_diff(run, expected), 1e-5
    return update_error(run, expected, _state(checks.tiny_llama())), MUON_BOUND


def test_trainer_and_trl_with_whole_tensor_optimizers(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    ranks = run_distributed(_ranks, WORLD_SIZE, str(tmp_path))
    failures = []
    expected = {name: reference(name, tmp_path / f"ref-{name}") for name in RUNS}
    trainer, model = _sft(tmp_path / "ref-sft", None)
    expected["sft"] = {"state": _state(model), "losses": checks.losses(trainer)}
    for name, wanted in expected.items():
        run = ranks[0][name]
        error, bound = _error(name, run["state"], wanted["state"])
        if error > bound or run["losses"] != pytest.approx(wanted["losses"], abs=1e-5) or not run["whole"]:
            failures.append(f"{name}: error {error:.3g} (bound {bound}), losses {run['losses']} vs {wanted['losses']}")
    assert not failures, "\n".join(failures)
    kinds = {k: v for rank in ranks for k, v in rank["adamw_8bit"]["state kinds"].items()}
    assert kinds[160 * 32] == "32-bit" and kinds[128 * 32] == "8-bit", kinds  # the embedding's override kept
