"""What each rank runs for tests/integration/test_trainer.py, and the single-process references it is compared with.

The ranks get a torchrun-style environment only. Every run trains a tiny Llama (uneven shapes) on fixed token
rows with the Trainer's sequential sampler, so the rows of a global step are the same for W ranks with micro batch
m and for one process with micro batch W * m: the reference is the plain transformers Trainer in one process.
Results are tensors and plain values.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import plain_torchrun_environment
from tests.helpers.models import tiny_llama_config


STEPS, GRAD_ACCUM, SEQ, VOCAB = 4, 2, 10, 61
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, intermediate_size=45))


def dataset(rows: int = STEPS * GRAD_ACCUM * 6) -> list[dict[str, torch.Tensor]]:
    data = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row} for row in data]


def args_kwargs(output_dir: str | Path, micro: int, **overrides: Any) -> dict[str, Any]:
    """TrainingArguments of every run: SGD (exact parity: Adam amplifies summation-order noise on near-zero
    gradients), linear decay, clipping at 1.0, accumulation 2, no checkpoints unless asked."""
    kwargs = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "max_steps": STEPS,
        "learning_rate": 0.1,
        "optim": "sgd",
        "lr_scheduler_type": "linear",
        "max_grad_norm": 1.0,
        "train_sampling_strategy": "sequential",
        "report_to": [],
        "use_cpu": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "ddp_timeout": 60,
        "seed": 0,
    }
    kwargs.update(overrides)
    return kwargs


def zero_config(stage: int, **zero: Any) -> dict[str, Any]:
    """Everything the Trainer can fill is "auto"; persistence threshold 10 * hidden = 320 shards every matrix."""
    autos = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": stage,
            **dict.fromkeys(autos, "auto"),
            "stage3_gather_16bit_weights_on_model_save": True,
            **zero,
        },
    }


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# ------------------------------------------------------------------------------------------- references (1 process)
def reference(world_size: int, micro: int, folder: Path, peft: bool = False, **overrides: Any) -> dict[str, Any]:
    """The plain transformers Trainer in this process on the full batch (micro * world_size rows per micro-step)."""
    from transformers import Trainer, TrainingArguments

    model = _lora(tiny_llama()) if peft else tiny_llama()
    args = TrainingArguments(**args_kwargs(folder, micro * world_size, **overrides))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(8))
    before = trainer.evaluate()["eval_loss"] if not peft else None
    trainer.train()
    after = trainer.evaluate()["eval_loss"] if not peft else None
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    return {"state": _trainable_state(model), "losses": losses(trainer), "eval": (before, after), "logits": logits}


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    return get_peft_model(model, config)


# --------------------------------------------------------------------------------------------------- in the ranks
PARTS = (
    "stage1",
    "stage2",
    "stage3",
    "eval_first",
    "reference_configs",
    "optimizer_blocks",
    "resume",
    "lora",
    "hp_search",
)
"""The 2-rank checks; each runs as its own body on the shared ranks, when a test first reads it."""


def run_part(rank: int, world_size: int, folder: str, part: str) -> Any:
    """Runs the check `part` (one of PARTS) on this rank; its files go under `<folder>/<part>`."""
    plain_torchrun_environment()
    root = Path(folder)
    if part.startswith("stage"):
        return _parity(rank, int(part.removeprefix("stage")), root / part)
    if part == "eval_first":
        return _eval_then_train(root / "eval_first")
    if part == "reference_configs":
        return {name: _reference_config(name, root / name) for name in ("zero2", "zero3")}
    if part == "optimizer_blocks":
        return _optimizer_blocks(root / "blocks")
    if part == "resume":
        return _resume(root / "resume")
    if part == "lora":
        return {stage: _lora_run(rank, stage, root / f"lora{stage}") for stage in (2, 3)}
    if part == "hp_search":
        return _hp_search(root / "hp")
    raise ValueError(f"{part=} is not one of {PARTS}")


def resume_on_three(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Resumes the 2-rank checkpoint `<folder>/resume/a/checkpoint-2` on 3 ranks (micro 2: the same 6 rows/step)."""
    plain_torchrun_environment()
    root = Path(folder) / "resume"
    trainer = _resume_trainer(root / "c", micro=2)
    trainer.train(resume_from_checkpoint=str(root / "a" / "checkpoint-2"))
    state = trainer.accelerator.get_state_dict(trainer.model)
    return {"state": state, "losses": losses(trainer), "engine_world_size": trainer.zero_engine.dp.world_size}


def _trainer(model: Any, output_dir: Path, micro: int, config: Any, **overrides: Any) -> Any:
    from accelerate_zero import Trainer, TrainingArguments

    args = TrainingArguments(zero_config=config, **args_kwargs(output_dir, micro, **overrides))
    return Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(8))


def _parity(rank: int, stage: int, folder: Path) -> dict[str, Any]:
    """Training at `stage` (micro 2 per rank); at stage 3 also save_model -> from_pretrained on rank 0."""
    model = tiny_llama()
    trainer = _trainer(model, folder, 2, zero_config(stage))
    trainer.train()
    out = {
        "losses": losses(trainer),
        "norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
        "state": trainer.accelerator.get_state_dict(model),
        "accelerator": type(trainer.accelerator).__name__,
        "engine_stage": trainer.zero_engine.stage,
        "filled": {
            "reduce_bucket_size": trainer.zero_engine.config.zero_optimization.reduce_bucket_size,
            "persistence": trainer.zero_engine.config.zero_optimization.stage3_param_persistence_threshold,
            "train_batch_size": trainer.zero_engine.config.train_batch_size,
        },
    }
    if stage == 3:
        model.eval()
        with torch.no_grad():
            out["engine_logits"] = model(input_ids=PROBE).logits
        trainer.save_model(str(folder / "saved"))
        if rank == 0:
            from transformers import LlamaForCausalLM

            loaded = LlamaForCausalLM.from_pretrained(folder / "saved")
            with torch.no_grad():
                out["loaded_logits"] = loaded.eval()(input_ids=PROBE).logits
            out["saved_files"] = sorted(p.name for p in (folder / "saved").iterdir())
    return out


def _eval_then_train(folder: Path) -> dict[str, Any]:
    """Stage 3: evaluate before training (the model is sharded for inference), train, evaluate again."""
    model = tiny_llama()
    trainer = _trainer(model, folder, 2, zero_config(3))
    before = trainer.evaluate()["eval_loss"]
    sharded_for_eval = model.model.layers[0].self_attn.q_proj.weight.numel() == 0  # a placeholder at rest
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    return {
        "eval": (before, after),
        "sharded_for_eval": sharded_for_eval,
        "state": trainer.accelerator.get_state_dict(model),
    }


def _reference_config(name: str, folder: Path) -> dict[str, Any]:
    """transformers' own test config, unchanged, with arguments that agree with its fixed values."""
    path = FIXTURES / f"ds_config_{name}.json"
    overrides: dict[str, Any] = {"optim": "adamw_torch", "max_steps": 3}
    if name == "zero3":  # its optimizer, scheduler and fp16 values are written out, not "auto"
        overrides.update(
            learning_rate=3e-5, adam_beta1=0.8, adam_epsilon=1e-8, weight_decay=3e-7, warmup_steps=500, fp16=True
        )
    trainer = _trainer(tiny_llama(), folder, 2, str(path), **overrides)
    trainer.train()
    engine = trainer.zero_engine
    config = engine.config
    return {
        "losses": losses(trainer),
        "optimizer": type(engine.optimizer).__name__,
        "optimizer_params": {k: engine.optimizer.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")},
        "scheduler": type(engine.lr_scheduler).__name__,
        "scheduler_params": dict(config.scheduler.params),
        "offload": tuple(
            block.device if block is not None else "none"
            for block in (config.zero_optimization.offload_optimizer, config.zero_optimization.offload_param)
        ),
        "fp16": config.fp16.enabled,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "micro": config.train_micro_batch_size_per_gpu,
        "accumulation": config.gradient_accumulation_steps,
        "clipping": config.gradient_clipping,
    }


def _optimizer_blocks(folder: Path) -> dict[str, Any]:
    """The config's optimizer with the Trainer's scheduler (no scheduler block), and both blocks (WarmupDecayLR)."""
    out = {}
    for name, scheduler in (
        ("optimizer_only", None),
        (
            "both",
            {
                "type": "WarmupDecayLR",
                "params": dict.fromkeys(
                    ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto"
                ),
            },
        ),
    ):
        config = zero_config(2)
        config["optimizer"] = {"type": "SGD", "params": {"lr": "auto", "momentum": 0.0}}
        if scheduler is not None:
            config["scheduler"] = scheduler
        trainer = _trainer(tiny_llama(), folder / name, 2, config, warmup_steps=1)
        trainer.train()
        engine = trainer.zero_engine
        out[name] = {
            "lrs": [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
            "global_steps": engine.global_steps,
            "engine_lr": engine.optimizer.param_groups[0]["lr"],
            "scheduler": type(engine.lr_scheduler).__name__,
            "scheduler_params": dict(engine.config.scheduler.params) if engine.config.scheduler else None,
            "state": trainer.accelerator.get_state_dict(trainer.model),
            "losses": losses(trainer),
        }
    return out


def _resume_trainer(folder: Path, micro: int, **overrides: Any) -> Any:
    config = zero_config(3)
    return _trainer(
        tiny_llama(),
        folder,
        micro,
        config,
        optim_args="momentum=0.9",
        save_strategy="steps",
        save_steps=2,
        **overrides,
    )


def _resume(folder: Path) -> dict[str, Any]:
    """Run a: 4 steps, checkpoints at 2 and 4. Run b: resumes a's checkpoint-2 (same 2 ranks)."""
    a = _resume_trainer(folder / "a", micro=3)
    a.train()
    b = _resume_trainer(folder / "b", micro=3)
    b.train(resume_from_checkpoint=str(folder / "a" / "checkpoint-2"))
    return {
        "a": {"state": a.accelerator.get_state_dict(a.model), "losses": losses(a)},
        "b": {"state": b.accelerator.get_state_dict(b.model), "losses": losses(b)},
        "files": sorted(p.name for p in (folder / "a" / "checkpoint-2").iterdir()),
    }


def _lora_run(rank: int, stage: int, folder: Path) -> dict[str, Any]:
    """LoRA adapters on the tiny Llama with gradient checkpointing; save_model writes the adapter."""
    model = _lora(tiny_llama())
    trainer = _trainer(model, folder, 2, zero_config(stage), gradient_checkpointing=True)
    trainer.train()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    engine, saved_keys = trainer.zero_engine, []
    gather = engine.full_state_dict

    def recording_gather(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        state = gather(*args, **kwargs)
        saved_keys.append(sorted(state))
        return state

    engine.full_state_dict = recording_gather  # what save_model gathers onto rank 0
    trainer.save_model(str(folder / "adapter"))
    engine.full_state_dict = gather
    out: dict[str, Any] = {"logits": logits, "losses": losses(trainer), "saved_keys": saved_keys}
    state = trainer.accelerator.get_state_dict(model)
    if rank == 0:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        out["state"] = {k: v for k, v in state.items() if k in trainable}
        out["trainable"], out["all_keys"] = sorted(trainable), sorted(state)
        out["files"] = sorted(p.name for p in (folder / "adapter").iterdir())
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(tiny_llama(), folder / "adapter").eval()
        with torch.no_grad():
            out["reloaded_logits"] = reloaded(input_ids=PROBE).logits
    out["finite"] = all(math.isfinite(x) for x in out["losses"])
    return out


def _hp_search(folder: Path) -> dict[str, Any]:
    """Trainer.hyperparameter_search (optuna, 2 trials on a grid) at stage 3 with the config's optimizer block
    taking the learning rate from "auto": each trial's optimizer must step with that trial's learning rate."""
    import optuna
    from transformers import TrainerCallback

    from accelerate_zero import Trainer, TrainingArguments

    used: list[tuple[float, float]] = []

    class RecordLearningRate(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if state.global_step == 1:
                used.append((args.learning_rate, optimizer.param_groups[0]["lr"]))

    config = zero_config(3)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    overrides = {"max_steps": 2, "lr_scheduler_type": "constant"}
    args = TrainingArguments(zero_config=config, **args_kwargs(folder, 2, **overrides))
    trainer = Trainer(
        model_init=lambda: tiny_llama(),
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset(8),
        callbacks=[RecordLearningRate()],
    )
    grid = {"learning_rate": [5e-2, 1e-3]}
    best = trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_categorical("learning_rate", grid["learning_rate"])},
        backend="optuna",
        n_trials=2,
        direction="minimize",
        sampler=optuna.samplers.GridSampler(grid, seed=0),
    )
    return {"used": used, "best": best.hyperparameters if best is not None else None}
