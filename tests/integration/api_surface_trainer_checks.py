"""What each rank runs for the Trainer tests of tests/integration/test_api_surface.py (`Trainer.predict` at stage 3,
training at stage 0), and the single-process reference both are compared with: the plain transformers Trainer.

The model, data and arguments are tests/integration/trainer_checks.py's (a tiny Llama with uneven shapes, the
Trainer's sequential sampler, SGD), so W ranks with micro batch m see the rows one process sees with W * m.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.helpers.dist import plain_torchrun_environment
from tests.integration.trainer_checks import args_kwargs, dataset, losses, tiny_llama, zero_config


MICRO = 2
PREDICT_ROWS = 10
"""With 2 ranks and an eval batch of 2 per rank the last global batch is short: rank 1 gets a batch accelerate
repeats from the start, which `gather_for_metrics` must drop (10 predictions, not 12)."""
TIMING = ("runtime", "samples_per_second", "steps_per_second")


def predict_set() -> list[dict[str, torch.Tensor]]:
    return dataset(PREDICT_ROWS)


def token_accuracy(prediction: Any) -> dict[str, float]:
    """`compute_metrics`: next-token accuracy of the logits' argmax."""
    predicted = prediction.predictions[:, :-1].argmax(-1)
    return {"accuracy": float((predicted == prediction.label_ids[:, 1:]).mean())}


def prediction(output: Any) -> dict[str, Any]:
    """What `Trainer.predict` returned, timings left out."""
    return {
        "predictions": torch.from_numpy(np.asarray(output.predictions)),
        "label_ids": torch.from_numpy(np.asarray(output.label_ids)),
        "metrics": {k: v for k, v in output.metrics.items() if not k.endswith(TIMING)},
    }


def grad_norms(trainer: Any) -> list[float]:
    """The gradient norm logged at each step (before clipping): where a wrongly scaled gradient shows even when
    clipping to 1.0 hides it in the weights."""
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference(world_size: int, folder: Path) -> dict[str, Any]:
    """The plain transformers Trainer in this process on the full batch: predict, train, predict."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama()
    rows = MICRO * world_size
    args = TrainingArguments(**args_kwargs(folder, rows, per_device_eval_batch_size=rows))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), compute_metrics=token_accuracy)
    before = prediction(trainer.predict(predict_set()))
    trainer.train()
    after = prediction(trainer.predict(predict_set()))
    return {
        "before": before,
        "after": after,
        "losses": losses(trainer),
        "norms": grad_norms(trainer),
        "state": trainable_state(model),
    }


def run_part(rank: int, world_size: int, folder: str, part: str) -> dict[str, Any]:
    """`predict`: predict at stage 3 before training (the model prepared for inference, sharded), train, predict
    again (the training engine); `stage0`: training at stage 0."""
    from accelerate_zero import Trainer, TrainingArguments

    plain_torchrun_environment()
    stage = {"predict": 3, "stage0": 0}[part]
    model = tiny_llama()
    kwargs = args_kwargs(Path(folder) / part, MICRO, per_device_eval_batch_size=MICRO)
    args = TrainingArguments(zero_config=zero_config(stage), **kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), compute_metrics=token_accuracy)
    out: dict[str, Any] = {}
    if part == "predict":
        out["before"] = prediction(trainer.predict(predict_set()))
        entry = trainer.accelerator.prepared_model_of(model)  # predict prepared it for inference: no optimizer
        memory = entry.engine.memory_breakdown()
        out["inference_engine"] = {
            "stage": entry.engine.stage,
            "optimizer": entry.optimizer,
            "training_state_bytes": memory["gradients"] + memory["master_weights"] + memory["optimizer_states"],
        }
    trainer.train()
    if part == "predict":
        out["after"] = prediction(trainer.predict(predict_set()))
    out.update(
        losses=losses(trainer),
        norms=grad_norms(trainer),
        engine_stage=trainer.zero_engine.stage,
        engine_world_size=trainer.zero_engine.dp.world_size,
        state=trainer.accelerator.get_state_dict(model),
    )
    return out
