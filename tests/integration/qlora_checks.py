"""What each rank runs for tests/integration/test_qlora.py, and the one-process reference it is compared with.

The model is the recipe's (recipes/qlora.py): the embedded tiny Llama with its linear layers quantized to NF4 as
they load, frozen, prepared for k-bit training, LoRA adapters on every linear layer. The Trainer reads distinct
token rows in order (`train_sampling_strategy="sequential"`), so a global step holds the same rows for 2 ranks of
micro batch 2 as for one process of micro batch 4: the reference is the plain transformers Trainer in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import plain_torchrun_environment


REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
MODEL = RECIPES / "assets" / "tiny-llama"
PROBE = torch.tensor([[1, 5, 9, 14, 20, 27, 33, 40]])
STEPS, MICRO, SEQ, CLIP = 3, 2, 16, 1.2


def recipe_modules() -> tuple[Any, Any]:
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    import qlora
    import sft

    return qlora, sft


PARTS: dict[str, tuple[int, torch.dtype | None]] = {
    "stage2": (2, None),
    "stage3": (3, None),
    "stage3_fp32_storage": (3, torch.float32),
}
"""The 2-rank runs: (stage, `bnb_4bit_quant_storage`). None is the recipe's uint8: the packed 4-bit weights are not
floating point and ZeRO keeps them whole on every rank. A floating-point storage dtype (what transformers documents
for QLoRA under DeepSpeed ZeRO-3) makes them parameters like any other: stage 3 partitions the base too."""


def quantized_model(storage: torch.dtype | None = None) -> torch.nn.Module:
    """The recipe's model, with the adapters every run starts from (LoRA B is zero: the adapters begin as a no-op)."""
    qlora, _ = recipe_modules()
    torch.manual_seed(0)
    base = qlora.load_quantized(str(MODEL), "nf4") if storage is None else _load_stored_as(storage)
    return qlora.with_adapters(base, qlora.QLoRAScriptArguments(), True)


def _load_stored_as(storage: torch.dtype) -> torch.nn.Module:
    """recipes/qlora.py's `load_quantized`, with the packed 4-bit values stored in `storage`."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=storage,
    )
    return AutoModelForCausalLM.from_pretrained(str(MODEL), quantization_config=quantization, dtype=torch.float32)


def rows(world_size: int) -> list[dict[str, list[int]]]:
    """Distinct rows (ids 3..296 of the 297-token vocabulary), `world_size * MICRO` per step."""
    ids = torch.randint(3, 297, (STEPS * world_size * MICRO, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def training_kwargs(folder: Path, micro: int) -> dict[str, Any]:
    """SGD with momentum, clipping at 1.2, gradient checkpointing (as the recipe), rows in order, no schedule.

    Not the recipe's AdamW: its update m / sqrt(v) is about lr * sign(g) whatever the gradient's scale, so a gradient
    summed instead of averaged over the ranks would train the same, and it turns the summation-order noise of
    near-zero gradients into differences of order lr. SGD's update is linear in the gradient: the runs agree to fp32
    rounding, and a wrong scale shows. The gradient norms are 1.57, 1.27 and 1.04: the clip acts on the first two
    steps and not on the third, which a clip would otherwise hide a wrong scale in."""
    return {
        "output_dir": str(folder),
        "per_device_train_batch_size": micro,
        "max_steps": STEPS,
        "learning_rate": 0.5,
        "optim": "sgd",
        "optim_args": "momentum=0.9",
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "max_grad_norm": CLIP,
        "gradient_checkpointing": True,
        "train_sampling_strategy": "sequential",
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "ddp_timeout": 60,
        "seed": 0,
    }


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference(folder: Path, world_size: int) -> dict[str, Any]:
    """The plain transformers Trainer in this process on the full batch (`world_size * MICRO` rows per step)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    _, sft = recipe_modules()
    model = quantized_model()
    start = adapters(model)
    args = TrainingArguments(**training_kwargs(folder, world_size * MICRO))
    trainer = Trainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows(world_size)), data_collator=sft.Collator(0)
    )
    trainer.train()
    return {"start": start, "trained": adapters(model), "norms": grad_norms(trainer)}


def grad_norms(trainer: Any) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def run_part(rank: int, world_size: int, folder: str, part: str) -> dict[str, Any]:
    """Trains the run `part` (one of PARTS) with the ZeRO Trainer; at stage 3 every floating-point parameter is
    partitioned (`stage3_param_persistence_threshold: 0`), the frozen embeddings and norms as well as the adapters."""
    plain_torchrun_environment()
    stage, storage = PARTS[part]
    return _train(rank, world_size, stage, storage, Path(folder) / part)


def _train(rank: int, world_size: int, stage: int, storage: torch.dtype | None, folder: Path) -> dict[str, Any]:
    from datasets import Dataset

    from accelerate_zero import Trainer, TrainingArguments

    qlora, sft = recipe_modules()
    model = quantized_model(storage)
    quantized = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_floating_point()}
    packed = [n for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True, "stage3_param_persistence_threshold": 0}
    # "auto": max_grad_norm; a config without the key clips at DeepSpeed's default 1.0 (as transformers + DeepSpeed)
    config = {"gradient_clipping": "auto", "zero_optimization": zero}
    args = TrainingArguments(zero_config=config, **training_kwargs(folder, MICRO))
    trainer = Trainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows(world_size)), data_collator=sft.Collator(0)
    )
    trainer.train()
    # Compared before any inference forward: on the CPU bitsandbytes repacks 4-bit weights in place on the first
    # forward without gradients (its inference kernel's layout), which is not a change of the values.
    unchanged = all(torch.equal(p, quantized[n]) for n, p in model.named_parameters() if n in quantized)
    engine = trainer.zero_engine
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    out: dict[str, Any] = {
        "quantized_unchanged": unchanged,
        "quantized_whole": all(
            p.numel() == quantized[n].numel() for n, p in model.named_parameters() if n in quantized
        ),
        "quantized_count": len(quantized),
        "quantized_grads": [n for n, p in model.named_parameters() if n in quantized and p.grad is not None],
        "quantized_optimized": sum(id(p) in optimized for n, p in model.named_parameters() if n in quantized),
        "state_numel": sum(t.numel() for s in engine.optimizer.state.values() for t in s.values() if t.ndim > 0),
        "shard_numel": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]),
        # a stage-3 parameter outside forward is an empty placeholder: its values live in the ranks' shards
        "floating_whole": sorted(n for n, p in model.named_parameters() if p.is_floating_point() and p.numel() > 0),
        "floating_count": sum(p.is_floating_point() for p in model.parameters()),
        "packed_count": len(packed),
        "norms": grad_norms(trainer),
    }
    state = trainer.accelerator.get_state_dict(model)  # gathered onto rank 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out["trained"] = {k: v for k, v in state.items() if k in trainable} if rank == 0 else {}
    if rank == 0:  # the packed 4-bit base, gathered, is bit for bit a fresh load's (a float storage may hold NaN bits)
        fresh = dict(quantized_model(storage).named_parameters())
        out["packed_unchanged"] = all(
            torch.equal(state[n].view(torch.uint8), fresh[n].view(torch.uint8)) for n in packed
        )
    model.eval()
    with torch.no_grad():
        out["logits"] = model(input_ids=PROBE).logits
    trainer.save_model(str(folder / "adapter"))
    if rank == 0:
        from peft import PeftModel

        out["files"] = sorted(p.name for p in (folder / "adapter").iterdir())
        reloaded = PeftModel.from_pretrained(qlora.load_quantized(str(MODEL), "nf4"), folder / "adapter").eval()
        with torch.no_grad():
            out["reloaded_logits"] = reloaded(input_ids=PROBE).logits
    return out
