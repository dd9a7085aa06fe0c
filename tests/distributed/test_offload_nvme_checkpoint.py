"""Engine checkpoints with NVMe offload: save, continue, and compare with a reload-and-continue run.

At 2 ranks each case trains 3 steps, saves, trains 3 more (the uninterrupted run), then a fresh engine with the
same config loads the checkpoint and trains the same 3 steps: bit-identical. At 3 ranks (another partitioning
of the same files), with NVMe offload and without offload, the continuation matches to float rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import gathered_flat, make_batches, make_model, train_steps


STEPS, GLOBAL_BATCH = 6, 6


def _zero(case: str, nvme_path: str) -> dict[str, Any]:
    optimizer = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}
    if case == "stage 2, optimizer nvme":
        return {"stage": 2, "offload_optimizer": optimizer, "sub_group_size": 50, "reduce_bucket_size": 60}
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 10, "sub_group_size": 50}
    if case == "stage 3, none":
        return zero
    zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0, "buffer_count": 2}
    zero["offload_optimizer"] = optimizer if case == "stage 3, optimizer and params nvme" else {"device": "cpu"}
    return zero


CASES = ("stage 2, optimizer nvme", "stage 3, optimizer and params nvme", "stage 3, optimizer cpu, params nvme")


def _engine(case: str, nvme_path: str) -> tuple[Any, torch.nn.Module]:
    import accelerate_zero

    model = make_model(seed=5)  # a different init than the loaded weights: loading must overwrite it
    # the frozen LayerNorm makes stage-3 units hold frozen shards too (saved as parameters, not masters)
    model.norm.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    config = {"gradient_clipping": 1.0, "zero_optimization": _zero(case, nvme_path)}
    return accelerate_zero.initialize(model, optimizer, config=config, lr_scheduler=scheduler), model


def _steps(engine: Any, rank: int, world_size: int, steps: range) -> None:
    train_steps(engine, make_batches(STEPS, 1, GLOBAL_BATCH), rank, world_size, steps)


def _save_continue_reload(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out = {}
    for index, case in enumerate(CASES):
        torch.manual_seed(0)
        engine, model = _engine(case, f"{folder}/nvme{index}")
        _steps(engine, rank, world_size, range(3))
        engine.save_checkpoint(f"{folder}/ckpt{index}", client_state={"case": case})
        _steps(engine, rank, world_size, range(3, STEPS))
        original = gathered_flat(model)
        engine.destroy()
        engine, model = _engine(case, f"{folder}/nvme{index}")
        _, client_state = engine.load_checkpoint(f"{folder}/ckpt{index}")
        _steps(engine, rank, world_size, range(3, STEPS))
        out[case] = {"original": original, "resumed": gathered_flat(model), "client": client_state["case"]}
        engine.destroy()
    return out


def _reload_elsewhere(rank: int, world_size: int, folder: str) -> dict[str, torch.Tensor]:
    """The NVMe stage-3 checkpoint (case 1) loaded into NVMe offload and into no offload, at this world size."""
    out = {}
    for case in ("stage 3, optimizer and params nvme", "stage 3, none"):
        engine, model = _engine(case, f"{folder}/nvme_other")
        engine.load_checkpoint(f"{folder}/ckpt1")
        _steps(engine, rank, world_size, range(3, STEPS))
        out[case] = gathered_flat(model)
        engine.destroy()
    return out


def test_nvme_checkpoint_resumes_exactly_and_on_other_world_sizes(tmp_path: Path) -> None:
    folder = str(tmp_path)
    runs = run_distributed(_save_continue_reload, 2, folder)[0]
    for case in CASES:
        assert runs[case]["client"] == case
        assert torch.equal(runs[case]["resumed"], runs[case]["original"]), case  # bit-identical continuation
    original = runs["stage 3, optimizer and params nvme"]["original"]
    for case, params in run_distributed(_reload_elsewhere, 3, folder)[0].items():
        assert (params - original).abs().max().item() < 1e-6, case
